"""OpenAI-compatible request models of the public API (responses: :mod:`router.responses`).

Requests validate strictly enough that bad input is a 400 with an OpenAI-style body
(``{"error": {"message", "type", "param", "code"}}``), never a 500: types, ranges
(``max_tokens >= 1``, ``0 <= temperature <= 2``, ``0 < top_p <= 1``, penalties in [-2, 2]),
and parameters we do not implement when set to a non-default value (``echo``, ``suffix``,
``best_of != n``, ``logit_bias``), and combinations we do not serve (a forced ``tool_choice``
or tools with ``response_format`` JSON, ``stream_options`` without ``stream``). Unknown fields are ignored, as most OpenAI-compatible
servers do, so newer clients keep working. ``cache_salt`` is an extra field: requests with
different salts never share cached prefixes (DESIGN.md §3, tenant isolation).

The sampling fields take their types and ranges from :mod:`k3serve.sampling` (the one
definition, shared with the internal messages and the engine), narrowed where OpenAI's API is
narrower (``temperature <= 2``, ``n <= 16``, completions' ``logprobs <= 5``);
:data:`SAMPLING_FIELDS` maps the OpenAI names to :class:`~k3serve.sampling.SamplingParams`'
and ``router/preprocess.py`` builds the params of each choice.

Units: token counts in tokens, ``created`` in Unix seconds.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from k3serve.sampling import (
    Logprobs,
    MaxTokens,
    MinP,
    N,
    Penalty,
    RepetitionPenalty,
    Seed,
    Temperature,
    TopK,
    TopP,
    non_empty_stops,
)

MAX_N = 16
MAX_STOP = 16
MAX_COMPLETION_LOGPROBS = 5

#: The sampling fields of the OpenAI requests: OpenAI name → ``SamplingParams`` field. Each is
#: annotated with that field's type from :mod:`k3serve.sampling` (narrowed, never widened).
SAMPLING_FIELDS = {
    "n": "n", "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens",
    "temperature": "temperature", "top_p": "top_p", "seed": "seed", "stop": "stop",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "ignore_eos": "ignore_eos", "logprobs": "logprobs", "top_logprobs": "logprobs",
    "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
}

#: A token id in a prompt (the published schema says ``>= 0``; the validator names the field).
TokenId = Annotated[int, Field(json_schema_extra={"minimum": 0})]


def _message_schema(schema: dict[str, Any]) -> None:
    """The published schema of :class:`ChatMessage`: what its validator accepts, so that a
    message valid by the schema is accepted (``content`` required and not null except on an
    assistant's ``tool_calls``; ``tool_calls`` only on assistant messages; ``tool_call_id``
    required on tool messages)."""
    schema["allOf"] = [
        {"if": {"properties": {"role": {"const": "assistant"}}, "required": ["tool_calls"]},
         "then": {"properties": {"tool_calls": {"type": "array", "minItems": 1}}},
         "else": {"required": ["content"],
                  "properties": {"content": {"not": {"type": "null"}},
                                 "tool_calls": {"type": "null"}}}},
        {"if": {"properties": {"role": {"const": "tool"}}},
         "then": {"required": ["tool_call_id"],
                  "properties": {"tool_call_id": {"type": "string", "minLength": 1}}}},
    ]


class _Request(BaseModel):
    # strict: JSON types only ("5" is not an int, true is not 1); unknown fields ignored.
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a final chunk with ``usage``; with it,
    ``continuous_usage_stats`` (vLLM's extension) puts the running ``usage`` in every chunk."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str = Field(min_length=1)
    max_tokens: MaxTokens | None = None
    temperature: Annotated[Temperature, Field(le=2.0)] = 1.0
    top_p: TopP = 1.0
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: Annotated[N, Field(le=MAX_N)] = 1
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = Field(  # not supported: only {} or null
        default=None, json_schema_extra={"maxProperties": 0})
    user: str | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # vLLM's extension: generate past EOS (and the model's other end-of-text ids) up to
    # max_tokens; explicit stop strings still apply. Benchmarks send it for exact lengths.
    ignore_eos: StrictBool = False
    # vLLM's extra sampling parameters (not in OpenAI's API): top-k, min-p and the
    # multiplicative repetition penalty, with the engine's ranges
    top_k: TopK = -1
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return list(non_empty_stops(tuple(stops)))

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> None:
        if v:
            raise ValueError("logit_bias is not supported")

    @model_validator(mode="after")
    def _stream_options(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the running ``usage`` (vLLM's
        ``continuous_usage_stats``, honoured with ``include_usage`` as vLLM does)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``.

    ``prompt`` is a string, a list of token ids, or a batch of either; every prompt gets
    ``n`` choices, indexed ``prompt_index × n + j``. ``logprobs`` (0–5) asks for that many
    top alternatives per sampled token.
    """

    prompt: (str | Annotated[list[TokenId], Field(min_length=1)]
              | Annotated[list[str], Field(min_length=1)]
              | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                          Field(min_length=1)])
    max_tokens: MaxTokens | None = 16
    logprobs: Annotated[Logprobs, Field(le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: bool = Field(default=False, json_schema_extra={"enum": [False]})  # not supported
    suffix: str | None = Field(default=None, json_schema_extra={"maxLength": 0})
    best_of: Annotated[int, Field(ge=1)] | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            for p in v:
                if isinstance(p, list) and not p:
                    raise ValueError("prompt token lists must not be empty")
                if isinstance(p, int) and p < 0:
                    raise ValueError("token ids must be >= 0")
                if isinstance(p, list) and any(t < 0 for t in p):
                    raise ValueError("token ids must be >= 0")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list (one entry per prompt: text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextContentPart(_Request):
    """A text part of a chat message's content list."""

    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    """``tool_calls[].function`` of an assistant message: name and JSON-text arguments."""

    name: str = Field(min_length=1)
    arguments: str


class MessageToolCall(_Request):
    """One ``tool_calls`` entry of an assistant message in the history."""

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    """One chat message. Content is a string or a list of text parts.

    ``content`` is required for every role, as OpenAI requires it, except an assistant
    message with ``tool_calls`` (``null`` or absent there); a ``tool`` message names the call
    it answers in ``tool_call_id``.
    """

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=_message_schema)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required (null only for an assistant's tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only on assistant messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: required on tool messages")
        return self

    def text(self) -> str:
        """The message's content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template reads it (Hugging Face's message dicts)."""
        d: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


class FunctionDef(_Request):
    """``tools[].function``: name, description and the JSON Schema of the arguments."""

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self) -> FunctionDef:
        """``parameters`` must be a valid JSON Schema (checked against the metaschema its
        ``$schema`` names, draft 2020-12 by default), whatever ``tool_choice`` says."""
        if self.parameters is not None:
            meta = self.parameters.get("$schema")
            if meta is not None and not isinstance(meta, str):
                raise ValueError(f"parameters: the tool `{self.name}` has an invalid JSON "
                                 f"schema: `$schema` must be a URI string, got {meta!r}")
            try:
                jsonschema.validators.validator_for(
                    self.parameters, jsonschema.Draft202012Validator).check_schema(
                        self.parameters)
            except jsonschema.SchemaError as e:
                where = "/".join(str(p) for p in e.absolute_path) or "(root)"
                raise ValueError(f"parameters: the tool `{self.name}` has an invalid JSON "
                                 f"schema at {where}: {e.message}") from None
        return self


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str = Field(min_length=1)


class NamedToolChoice(_Request):
    """``tool_choice: {"type": "function", "function": {"name": …}}``."""

    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Request):
    name: str = Field(default="response", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class ResponseFormat(_Request):
    """``response_format``: ``text``, ``json_object`` or ``json_schema`` (with its schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: required with type json_schema")
        return self


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``.

    ``logprobs`` (bool) returns the sampled token's logprob, ``top_logprobs`` (0–20) that
    many alternatives; ``max_completion_tokens`` is the newer name of ``max_tokens`` and wins
    when both are set. ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` as OpenAI's
    (``required`` and a named function are enforced by a grammar, ``auto`` is parsed from
    the output); ``response_format`` ``json_object`` / ``json_schema`` are enforced by a
    grammar (:mod:`k3serve.structured`).
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False  # OpenAI's switch; the number is top_logprobs
    top_logprobs: Logprobs | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        forced = self.tool_choice == "required" or isinstance(self.tool_choice,
                                                               NamedToolChoice)
        if forced and not self.tools:
            raise ValueError("tool_choice: 'required' or a named function needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or ()]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice: no tool named "
                                 f"{self.tool_choice.function.name!r} in tools")
        if self.tools:
            names = [t.function.name for t in self.tools]
            if len(set(names)) != len(names):
                raise ValueError("tools: function names must be unique")
        if (self.response_format is not None and self.response_format.type != "text"
                and self.tools and self.tool_choice != "none"):
            raise ValueError("response_format: a JSON format together with tools is not "
                             "supported (set tool_choice to 'none' or drop response_format)")
        return self

    @property
    def tools_active(self) -> bool:
        """Whether the output is parsed for tool calls (tools given, tool_choice not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens`` if set, else ``max_tokens`` (None: up to the context)."""
        return self.max_completion_tokens or self.max_tokens
