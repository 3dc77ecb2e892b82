"""Request bodies of the baseline systems: the subset of our API the benchmark sends, same field names.

Generation is an OpenAI-style `/v1/completions` without streaming (the baselines answer when the
whole output is done); `ignore_eos` is vLLM's extension (always produce max_tokens).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ClassifyIn(_Body):
    inputs: str | list[str] = Field(min_length=1)
    model: str | None = None
    truncate: bool = True


class TranslateIn(_Body):
    inputs: str | list[str] = Field(min_length=1)
    source_lang: str
    target_lang: str
    beam_size: int | None = Field(None, ge=1, le=8)
    max_new_tokens: int | None = Field(None, ge=1, le=4096)
    model: str | None = None
    truncate: bool = True


class CompletionIn(_Body):
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    ignore_eos: bool = False
    model: str | None = None


def as_list(inputs: str | list[str]) -> list[str]:
    return [inputs] if isinstance(inputs, str) else inputs


def completion_response(
    model: str, text: str, prompt_tokens: int, completion_tokens: int, finish_reason: str
) -> dict[str, object]:
    return {
        "object": "text_completion",
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
