"""Text in and out: one tokenizer wrapper for every model, chat templates and incremental detokenization.

Built on the `tokenizers` library (Rust, thread-safe encode_batch). `transformers` is not needed
at serving time for text handling.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer


class TextTokenizer:
    """encode/decode with the model's special tokens; knows its pad id and special ids."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None) -> None:
        self.tok = tokenizer
        self.tok.no_truncation()
        self.tok.no_padding()
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})  # e.g. {"bos_token": "<s>", "eos_token": "</s>"}

    @classmethod
    def from_file(cls, path: str | Path, chat_template: str | None = None,
                  special_tokens: dict[str, str] | None = None) -> TextTokenizer:
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer at {path}")
        return cls(Tokenizer.from_file(str(path)), chat_template, special_tokens)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> TextTokenizer:
        """The tokenizer of a Hugging Face model directory: tokenizer.json, with the chat template of
        chat_template.jinja or tokenizer_config.json and its bos/eos tokens (the names templates use)."""
        root = Path(path)
        config_file = root / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text()
        special = {}
        for name in ("bos_token", "eos_token"):
            value = config.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str) and value:
                special[name] = value
        return cls.from_file(root, template if isinstance(template, str) else None, special)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def token_bytes(self, token: int) -> bytes:
        """A token's own bytes: for a byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) the bytes its symbols
        stand for, so a piece of a multi-byte character is that piece; otherwise its decoded text."""
        symbols = self.tok.id_to_token(token)
        if symbols is not None and _byte_level(self.tok):
            table = _unicode_to_byte()
            if all(ch in table for ch in symbols):
                return bytes(table[ch] for ch in symbols)
        return self.decode([token], skip_special_tokens=False).encode("utf-8", "surrogatepass")

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        return self.tok.decode_batch([list(ids) for ids in batch], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **context: Any) -> str:
        """Render the model's chat template (Jinja, in a sandbox, as `transformers` does); `context`
        adds variables the template may read (e.g. `tools`)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        template = _compile_template(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **self.special_tokens, **context)


def _byte_level(tok: Tokenizer) -> bool:
    return type(tok.decoder).__name__ == "ByteLevel"


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte -> printable-character table (byte-level BPE vocabularies), inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


@functools.lru_cache(maxsize=8)
def _compile_template(source: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


@dataclass
class IncrementalDetokenizer:
    """Turns a growing token list into text pieces whose concatenation equals decode(all tokens).

    Tokens are decoded in a sliding window (prefix_offset .. end) and a piece is released only
    when it does not end in an incomplete UTF-8 sequence (U+FFFD), as vLLM and TGI do, so
    multi-byte characters split over several tokens stream correctly.
    """

    tokenizer: TextTokenizer
    prompt: list[int] = field(default_factory=list)  # context for leading-space handling; not emitted
    tokens: list[int] = field(default_factory=list)
    _prefix: int = 0
    _read: int = 0

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt[-4:])  # a little context so the first piece decodes as in the whole
        self._prefix = 0
        self._read = len(self.tokens)

    def push(self, token: int) -> str:
        """Add one token; return the newly complete text (may be empty)."""
        self.tokens.append(token)
        prefix_text = self.tokenizer.decode(self.tokens[self._prefix:self._read])
        full_text = self.tokenizer.decode(self.tokens[self._prefix:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.tokens)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character is emitted as decode() would)."""
        prefix_text = self.tokenizer.decode(self.tokens[self._prefix:self._read])
        full_text = self.tokenizer.decode(self.tokens[self._prefix:])
        self._prefix = self._read = len(self.tokens)
        return full_text[len(prefix_text):]
