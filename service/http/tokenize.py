"""vLLM's /tokenize and /detokenize for the generators: what a prompt (or a chat through the
model's template) costs in tokens before sending it, and the text of token ids. No torch here: the
generator replica tokenizes (service/replica/generator.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr, model_validator

from ..messages import GenerationRequest
from .generation_schemas import MAX_MESSAGES, MAX_TOOLS, ChatMessageIn, ToolDef, tools_of
from .routing import Backend, InputLimits, ModelRoutes
from .schemas import _Body

MAX_DETOKENIZE = 131_072  # token ids per request


class TokenizeRequest(_Body):
    model: StrictStr | None = Field(None, description="Model name (see /v1/models); default: the first generator.")
    prompt: StrictStr | None = Field(None, description="A text; or send `messages`.")
    messages: list[ChatMessageIn] | None = Field(None, min_length=1, max_length=MAX_MESSAGES,
                                                 description="A chat, rendered with the model's template.")
    tools: list[ToolDef] | None = Field(None, min_length=1, max_length=MAX_TOOLS,
                                        description="With messages: the functions, shown to the model as "
                                                    "/v1/chat/completions shows them (tool_choice other than none).")
    add_special_tokens: StrictBool = Field(True, description="A prompt with the model's special tokens (as "
                                                             "/v1/completions sends it).")
    return_token_strs: StrictBool = Field(False, description="Also each token's text.")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools need messages (a chat)")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Body):
    model: StrictStr | None = None
    tokens: list[StrictInt] = Field(max_length=MAX_DETOKENIZE, description="Token ids.")


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize_router(routes: ModelRoutes, backend: Backend, limits: InputLimits,
                    errors: dict[int | str, dict[str, Any]]) -> APIRouter:
    router = APIRouter(tags=["generation"])

    @router.post("/tokenize", response_model=TokenizeResponse, responses=errors)
    async def tokenize(body: TokenizeRequest) -> Any:
        """Token ids of a prompt, or of a chat rendered with the model's chat template (vLLM's shape)."""
        route = routes.resolve("generate", body.model)
        messages = None if body.messages is None else tuple(m.message() for m in body.messages)
        request = GenerationRequest(request_id="tokenize", prompt=body.prompt, messages=messages,
                                    tools=tools_of(body.tools))
        await limits.check_prompts(route.deployment, [request])
        out = await backend.call(route.deployment, "tokenize", request, body.add_special_tokens)
        return TokenizeResponse(count=len(out.tokens), max_model_len=out.max_model_len, tokens=list(out.tokens),
                                token_strs=list(out.token_strs) if body.return_token_strs else None)

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=errors)
    async def detokenize(body: DetokenizeRequest) -> Any:
        """The text of token ids (special tokens shown)."""
        route = routes.resolve("generate", body.model)
        return DetokenizeResponse(prompt=await backend.call(route.deployment, "detokenize", body.tokens))

    return router
