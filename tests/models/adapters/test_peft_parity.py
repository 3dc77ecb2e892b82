"""Adapters equal to `peft`: tiny random HF models with LoRA adapters of different ranks, saved by peft,
served by ours side by side in one batch with rows of the bare base.

    B rows (one per adapter, plus the base), T tokens, V vocabulary, C width
"""

from __future__ import annotations

import copy
import json

import peft
import pytest
import torch
import transformers as hf
from torch import Tensor

from models.adapters import AdapterError, LoraLinear, ResidentAdapters, read_adapter
from models.checkpoints import bert, distilbert, gpt2, llama, roberta
from models.projections.fuse import fuse_projections

VOCAB = 100
# (rank, alpha, rsLoRA, target modules by family role): three adapters of different ranks and targets
ADAPTERS = [(4, 8, False, "attention"), (8, 4, True, "all"), (2, 16, False, "mlp")]
TARGETS = {
    "llama": {"attention": ["q_proj", "k_proj", "v_proj", "o_proj"], "mlp": ["gate_proj", "up_proj", "down_proj"]},
    "gpt2": {"attention": ["c_attn", "attn.c_proj"], "mlp": ["c_fc", "mlp.c_proj"]},
    "bert": {"attention": ["query", "key", "value", "attention.output.dense"],
             "mlp": ["intermediate.dense", r"\d+\.output\.dense"]},
}


def hf_model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        cfg = hf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        return hf.LlamaForCausalLM(cfg).eval()
    if family == "gpt2":
        cfg = hf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
        return hf.GPT2LMHeadModel(cfg).eval()
    cfg = hf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=48, max_position_embeddings=64, attn_implementation="eager")
    return hf.BertModel(cfg).eval()


def ours_from(family: str, model: torch.nn.Module) -> torch.nn.Module:
    importer = {"llama": llama.from_hf, "gpt2": gpt2.from_hf, "bert": bert.from_hf}[family]
    return importer(model.config.to_dict(), model.state_dict())


def target_modules(family: str, which: str) -> list[str] | str:
    t = TARGETS[family]
    names = t["attention"] + t["mlp"] if which == "all" else t[which]
    if family == "bert" and which != "attention":  # a regex: `output.dense` alone would match attention's
        return "|".join(rf".*{n}" if "\\" in n else rf".*\.{n}" for n in names)
    return names


def save_adapters(family: str, base: torch.nn.Module, root) -> list[tuple[str, torch.nn.Module]]:
    """Each of ADAPTERS as a peft model over its own copy of `base`, saved under root/<name>."""
    out = []
    for i, (r, alpha, rs, which) in enumerate(ADAPTERS):
        torch.manual_seed(10 + i)
        cfg = peft.LoraConfig(r=r, lora_alpha=alpha, use_rslora=rs, target_modules=target_modules(family, which),
                              init_lora_weights=False, fan_in_fan_out=family == "gpt2")
        model = peft.get_peft_model(copy.deepcopy(base), cfg).eval()
        name = f"a{i}"
        model.save_pretrained(root / name)
        out.append((name, model))
    return out


def ids_batch(rows: int, t: int = 6) -> Tensor:
    return torch.randint(3, VOCAB, (rows, t), generator=torch.Generator().manual_seed(1))  # (B, T)


def reference(family: str, model: torch.nn.Module, ids: Tensor) -> Tensor:
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.logits if family != "bert" else out.last_hidden_state  # (B, T, V) or (B, T, C)


def ours_out(family: str, model: torch.nn.Module, ids: Tensor, slots: Tensor | None) -> Tensor:
    with torch.no_grad():
        return model(ids, adapters=slots)  # (B, T, V) or (B, T, C)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_a_batch_mixing_three_adapters_and_the_base_gives_each_row_what_peft_gives_it(family, fused, tmp_path):
    base = hf_model(family)
    adapters = save_adapters(family, base, tmp_path)
    ours = ours_from(family, base)
    if fused:
        fuse_projections(ours)
    resident = ResidentAdapters([ours], capacity=4, rank=8)
    slots = [resident.load(read_adapter(tmp_path / name)) for name, _ in adapters]
    n = len(adapters) + 1
    ids = ids_batch(n)  # (B, T): rows 0..2 the adapters, the last row the base
    index = torch.tensor([*slots, -1])  # (B,)
    mixed = ours_out(family, ours, ids, index)
    for row, (_, model) in enumerate(adapters):
        ref = reference(family, model, ids[row:row + 1])[0]
        torch.testing.assert_close(mixed[row], ref, atol=1e-4, rtol=1e-4)
        alone = ours_out(family, ours, ids[row:row + 1], index[row:row + 1])[0]
        torch.testing.assert_close(mixed[row], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[-1], reference(family, base, ids[-1:])[0], atol=1e-4, rtol=1e-4)
    # an adapter changes what it adapts: rows differ from the base on the same tokens
    assert not torch.allclose(mixed[0], ours_out(family, ours, ids[:1], None)[0], atol=1e-3)


def test_greedy_tokens_of_an_adapter_equal_peft(tmp_path):
    base = hf_model("llama")
    (name, model), *_ = save_adapters("llama", base, tmp_path)
    ours = ours_from("llama", base)
    resident = ResidentAdapters([ours], capacity=1, rank=8)
    slot = resident.load(read_adapter(tmp_path / name))
    ids = ids_batch(1, 4)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
        seq = ids
        for _ in range(8):
            nxt = ours(seq, adapters=torch.tensor([slot]))[:, -1].argmax(-1, keepdim=True)  # (1, 1)
            seq = torch.cat([seq, nxt], 1)
    assert seq.tolist() == ref.tolist()


def test_slots_are_reused_least_recently_used_first_and_never_under_a_request(tmp_path):
    base = hf_model("llama")
    adapters = save_adapters("llama", base, tmp_path)
    ours = ours_from("llama", base)
    resident = ResidentAdapters([ours], capacity=2, rank=8)
    a0, a1, a2 = (read_adapter(tmp_path / name) for name, _ in adapters)
    resident.load(a0)
    resident.load(a1)
    held = resident.acquire("a0").slot  # a0 is now the most recent, and held
    resident.load(a2)  # evicts a1
    assert sorted(resident.names) == ["a0", "a2"]
    resident.acquire("a2")
    with pytest.raises(AdapterError, match="running requests"):
        resident.load(a1)
    resident.release(held)
    assert resident.load(a1) == held and sorted(resident.names) == ["a1", "a2"]


def test_an_unloaded_slot_adds_nothing(tmp_path):
    base = hf_model("llama")
    (name, _), *_ = save_adapters("llama", base, tmp_path)
    ours = ours_from("llama", base)
    ids = ids_batch(1)
    plain = ours_out("llama", ours, ids, None)
    resident = ResidentAdapters([ours], capacity=1, rank=8)
    slot = resident.load(read_adapter(tmp_path / name))
    resident.unload(name)
    torch.testing.assert_close(ours_out("llama", ours, ids, torch.tensor([slot])), plain, atol=0, rtol=0)
    assert all(isinstance(m, LoraLinear) for m in (ours.stack.blocks[0].self_attn.q_proj, ours.stack.blocks[1].ff.down))


def _config(path, **changes) -> None:
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(("change", "message"), [
    ({"use_dora": True}, "DoRA"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not served"),
    ({"bias": "all"}, "bias='all'"),
    ({"r": 0}, "r must be a positive number"),
])
def test_what_we_do_not_compute_as_peft_does_is_refused_by_name(tmp_path, change, message):
    base = hf_model("llama")
    (name, _), *_ = save_adapters("llama", base, tmp_path)
    _config(tmp_path / name, **change)
    with pytest.raises(AdapterError, match=message):
        read_adapter(tmp_path / name)


def test_a_malformed_weights_file_and_a_foreign_module_are_refused(tmp_path):
    base = hf_model("llama")
    (name, _), *_ = save_adapters("llama", base, tmp_path)
    (tmp_path / name / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match="not a readable safetensors file"):
        read_adapter(tmp_path / name)
    torch.manual_seed(3)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=2, target_modules=["lm_head"]))
    model.save_pretrained(tmp_path / "head")
    with pytest.raises(AdapterError, match="lm_head"):
        read_adapter(tmp_path / "head")


def test_a_larger_rank_than_the_slots_take_is_refused(tmp_path):
    base = hf_model("llama")
    adapters = save_adapters("llama", base, tmp_path)
    ours = ours_from("llama", base)
    resident = ResidentAdapters([ours], capacity=1, rank=4)
    with pytest.raises(AdapterError, match="rank 8"):
        resident.load(read_adapter(tmp_path / adapters[1][0]))


def test_an_adapter_with_modules_to_save_is_refused_by_name(tmp_path):
    base = hf_model("llama")
    torch.manual_seed(4)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=2, target_modules=["q_proj"],
                                                                       modules_to_save=["lm_head"]))
    model.save_pretrained(tmp_path / "saved")
    adapter = read_adapter(tmp_path / "saved")
    assert adapter.saved
    with pytest.raises(AdapterError, match=r"saves 'lm_head' \(modules_to_save\); only a sequence classifier's head"):
        ResidentAdapters([ours_from("llama", base)], capacity=1, rank=4).load(adapter)


def hf_classifier(family: str, labels: int) -> torch.nn.Module:
    """A tiny random sequence classifier of `family` with `labels` outputs (the encoder: seed 0's)."""
    torch.manual_seed(0)
    if family == "distilbert":
        cfg = hf.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=48,
                                  max_position_embeddings=64, num_labels=labels)
        return hf.DistilBertForSequenceClassification(cfg).eval()
    kind = {"bert": (hf.BertConfig, hf.BertForSequenceClassification),
            "roberta": (hf.RobertaConfig, hf.RobertaForSequenceClassification)}[family]
    cfg = kind[0](vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                  max_position_embeddings=72, num_labels=labels, attn_implementation="eager")
    return kind[1](cfg).eval()


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_a_classification_adapter_with_its_own_head_labels_as_peft_does(family, tmp_path):
    """A SEQ_CLS adapter trained on the base's encoder with a new 3-label head (PEFT saves the head whole:
    modules_to_save) beside rows of the bare 2-label base in one batch: each row's logits as peft's model
    and the base's give them, its labels from the adapter's config.json."""
    base = hf_classifier(family, 2)
    tuned = hf_classifier(family, 3)
    tuned.load_state_dict({k: v for k, v in base.state_dict().items() if not k.startswith(("classifier", "score"))},
                          strict=False)  # the same encoder (and pooler / pre_classifier), a new classifier
    targets = ["q_lin", "v_lin"] if family == "distilbert" else ["query", "value"]
    torch.manual_seed(5)
    model = peft.get_peft_model(tuned, peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8,
                                                       target_modules=targets, init_lora_weights=False)).eval()
    model.save_pretrained(tmp_path / "sentiment")
    tuned.config.id2label = {0: "negative", 1: "neutral", 2: "positive"}
    tuned.config.save_pretrained(tmp_path / "sentiment")
    importer = {"bert": bert.from_hf, "roberta": roberta.from_hf, "distilbert": distilbert.from_hf}[family]
    ours = importer(base.config.to_dict(), base.state_dict())
    resident = ResidentAdapters([ours], capacity=2, rank=4)
    slot = resident.load(read_adapter(tmp_path / "sentiment"))
    head = resident.head(slot)
    assert head is not None and head.labels == ("negative", "neutral", "positive")
    ids = torch.randint(3, VOCAB, (3, 7), generator=torch.Generator().manual_seed(2))  # (B, T)
    keep = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        hidden = ours(ids, keep, adapters=torch.tensor([slot, -1, slot]))  # (B, T, C)
        tuned_rows = ours.logits(hidden[[0, 2]], keep[[0, 2]], head.weights)  # (2, 3)
        base_row = ours.logits(hidden[[1]], keep[[1]])  # (1, 2)
        ref_tuned, ref_base = model(input_ids=ids[[0, 2]]).logits, base(input_ids=ids[[1]]).logits
    torch.testing.assert_close(tuned_rows, ref_tuned, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(base_row, ref_base, atol=1e-4, rtol=1e-4)
    assert tuned_rows.argmax(-1).tolist() == ref_tuned.argmax(-1).tolist()
    resident.unload("sentiment")
    assert resident.head(slot) is None


def test_a_head_the_model_cannot_take_is_refused_by_name(tmp_path):
    """A classification adapter on an encoder without a classification head, and one whose classifier
    takes another width: refused, naming the problem."""
    base = hf_classifier("bert", 2)
    torch.manual_seed(6)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(task_type="SEQ_CLS", r=2,
                                                                       target_modules=["query"]))
    model.save_pretrained(tmp_path / "cls")
    adapter = read_adapter(tmp_path / "cls")
    plain = hf_model("bert")  # the same family with no head
    with pytest.raises(AdapterError, match="has none to replace"):
        ResidentAdapters([ours_from("bert", plain)], capacity=1, rank=4).load(adapter)
    adapter.saved["classifier.weight"] = torch.zeros(2, 16)
    with pytest.raises(AdapterError, match=r"its head weight is \(2, 16\); this model's takes 32 inputs"):
        ResidentAdapters([bert.from_hf(base.config.to_dict(), base.state_dict())], capacity=1, rank=4).load(adapter)
