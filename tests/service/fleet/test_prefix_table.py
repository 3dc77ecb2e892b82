"""The prefix table behind prefix-aware routing: longest prefix wins, whole chunks only, bounded."""

from __future__ import annotations

from service.fleet.prefix_table import PrefixTable, chunk_keys, session_key

SYSTEM = "You are a helpful assistant for the Acme support desk. " * 8  # 440 characters


def test_chunk_keys_are_chained_whole_chunks() -> None:
    keys = list(chunk_keys("a" * 20 + "b" * 5, 10))
    assert [chars for _, chars in keys] == [10, 20]  # the partial chunk is no key
    # the same chunk text after a different prefix is another key
    assert list(chunk_keys("x" * 10 + "a" * 10, 10))[1][0] != keys[1][0]


def test_the_longest_matching_prefix_wins_among_candidates() -> None:
    table = PrefixTable(chunk_chars=32)
    table.record(table.chain(SYSTEM + "turn one"), "A")
    table.record(table.chain(SYSTEM[:100]), "B")
    match = table.match(table.chain(SYSTEM + "turn one, and turn two"), {"A", "B"})
    assert match.replicas == ("A",) and match.chars == len(SYSTEM + "turn one") // 32 * 32
    # B holds only the first 96 characters; without A among the candidates, that is the match
    only_b = table.match(table.chain(SYSTEM), {"B"})
    assert only_b.replicas == ("B",) and only_b.chars == 96
    assert table.match(table.chain("something else entirely, long enough to be a chunk"), {"A", "B"}).chars == 0
    assert table.match(table.chain(SYSTEM), {"C"}).replicas == ()


def test_owners_are_most_recent_first_and_forgotten_with_their_replica() -> None:
    table = PrefixTable(chunk_chars=32)
    table.record(table.chain(SYSTEM), "A")
    table.record(table.chain(SYSTEM), "B")
    assert table.match(table.chain(SYSTEM), {"A", "B"}).replicas == ("B", "A")
    table.forget("B")
    assert table.match(table.chain(SYSTEM), {"A", "B"}).replicas == ("A",)
    table.forget("A")
    assert len(table) == 0


def test_the_table_is_bounded_least_recently_used_first() -> None:
    table = PrefixTable(chunk_chars=16, max_chunks=10)
    table.record(table.chain("a" * 160), "A")  # 10 chunks
    table.match(table.chain("a" * 160), {"A"})  # touched: most recent
    table.record(table.chain("b" * 80), "B")  # 5 more: the table drops 5 chunks
    assert len(table) == 10
    assert table.match(table.chain("b" * 80), {"B"}).chars == 80


def test_sessions_remember_their_replica_by_digest_only() -> None:
    table = PrefixTable(max_sessions=2)
    table.bind_session("alice", "A")
    table.bind_session("bob", "B")
    assert table.session("alice") == "A" and table.session("carol") is None
    table.bind_session("carol", "A")  # bob is the least recently used
    assert table.session("bob") is None and table.session("carol") == "A"
    assert "alice" not in repr(table._sessions) and session_key("alice") in table._sessions
    table.forget("A")
    assert table.session("alice") is None
