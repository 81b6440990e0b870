"""OpenAI-compatible response, stream-chunk and error models of the public API (the request
models are in :mod:`router.schemas`).

Units: token counts in tokens, ``created`` in Unix seconds.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field


# ----------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    """A fresh response id such as ``cmpl-3f2a…``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix time in whole seconds (the ``created`` field)."""
    return int(time.time())


class PromptTokensDetails(BaseModel):
    """``usage.prompt_tokens_details``: ``cached_tokens`` = the prefix the prefill reused."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token usage of a request (all choices)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ResponseFunction(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of a tool call (``id``, ``type``, ``function.name`` on its first)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    """A streamed completions chunk (same object name as the full response, like OpenAI)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "k3serve"
    max_model_len: int | None = None
    #: tokens per cache block of the workers (hashing granularity); ``None`` before any
    #: worker registered. A trace replay checks its block size against it (``k3serve bench``).
    block_size: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ----------------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI-style error body."""

    error: ErrorInfo


def validation_error_info(errors: list[dict[str, Any]]) -> ErrorInfo:
    """OpenAI-style error for pydantic/FastAPI validation errors (first error named in full).

    Args:
        errors: ``RequestValidationError.errors()`` / ``ValidationError.errors()``.
    """
    if not errors:
        return ErrorInfo(message="invalid request", type="invalid_request_error")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return ErrorInfo(message=f"request body is not valid JSON: {first.get('msg', '')}",
                         type="invalid_request_error", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # loc = field path, then (for unions) member tags such as "str" or "list[int]"
    param = loc[0] if loc else None
    path = ".".join(p for p in loc if not _is_type_tag(p))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    text = f"{path}: {msg}" if path else msg
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return ErrorInfo(message=text, type="invalid_request_error", param=param,
                     code="invalid_value")


def _is_type_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "dict", "list", "none") or "[" in part
