"""Request preprocessing: tokenize (text, token ids, chat template), check lengths, hash the
prompt's blocks, and make the per-choice sampling parameters of ``n > 1`` requests.

Step 1 of the request lifecycle (:mod:`k3serve.protocol`): everything the router knows
before it asks any worker. Torch-free: the tokenizer, sampling and hashing modules are
imported lazily and never load the model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError

from router.errors import APIError
from router.schemas import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from k3serve.sampling import SamplingParams
    from router.workers import Worker

R = TypeVar("R", CompletionRequest, ChatCompletionRequest)

#: Seed of choice j > 0 of a request with base seed s: (s · GOLDEN + j) mod 2^63.
GOLDEN = 0x9E3779B97F4A7C15


def parse_request(raw: bytes, model: type[R], served_model: str,
                  max_prompts: int | None = None) -> R:
    """Parse and validate a public request body.

    Args:
        raw: The HTTP body.
        model: ``CompletionRequest`` or ``ChatCompletionRequest``.
        served_model: The model this router serves (``model`` must name it).
        max_prompts: Most prompts of a batch ``prompt`` (checked before the schema, so a huge
            batch costs no validation); ``None``: no cap.

    Raises:
        APIError: 400 for JSON the parser rejects (also nesting past the recursion limit, an
            integer past Python's digit limit, ``NaN`` / ``Infinity``), a non-object, a lone
            UTF-16 surrogate, a schema error (the field named), more than ``max_prompts``
            prompts (``too_many_prompts``); 404 ``model_not_found`` for another model (as
            OpenAI and vLLM answer).
    """
    try:
        data = json.loads(raw, parse_float=_number, parse_constant=_not_a_number)
    except (ValueError, RecursionError) as e:
        # ValueError: JSONDecodeError, bad UTF-8, an int past Python's digit limit;
        # RecursionError: nesting deeper than the parser's recursion limit
        raise APIError(400, f"request body is not valid JSON: {e}",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    batch = data.get("prompt")
    if (max_prompts is not None and isinstance(batch, list) and len(batch) > max_prompts
            and not all(isinstance(x, int) for x in batch)):
        raise APIError(400, f"prompt: {len(batch)} prompts in one request; at most "
                       f"{max_prompts}", param="prompt", code="too_many_prompts")
    bad = _lone_surrogate_field(data)
    if bad is not None:  # "\ud800": valid JSON, but no tokenizer or body can encode it
        raise APIError(400, f"{bad}: a string holds an unpaired UTF-16 surrogate escape",
                       param=bad, code="invalid_value")
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        raise APIError.invalid(e.errors()) from None
    if req.model != served_model:
        raise APIError(404, f"The model `{req.model}` does not exist; this server serves "
                       f"`{served_model}`.", param="model", code="model_not_found")
    return req


def _not_a_number(text: str) -> float:
    """``NaN`` / ``Infinity`` / ``-Infinity``: Python's parser takes them, JSON (RFC 8259 §6)
    does not, and no sampling field means anything by them."""
    raise ValueError(f"{text} is not a JSON number (RFC 8259 §6)")


def _number(text: str) -> int | float:
    """A JSON number with a fraction or exponent: an ``int`` when its value is integral
    (``2.0``, ``1e3``: JSON Schema's integers, so integer fields take them), else a float."""
    f = float(text)
    return int(f) if f.is_integer() and abs(f) < 2**63 else f


_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _lone_surrogate_field(data: dict[str, Any]) -> str | None:
    """The top-level field of a parsed JSON body holding a string with an unpaired
    surrogate (``json.loads`` decodes ``"\\ud800"`` to one), else ``None``. Iterative:
    the body may nest as deep as the parser allowed."""
    for key, value in data.items():
        if isinstance(key, str) and _SURROGATE.search(key):
            return "body"
        stack = [value]
        while stack:
            v = stack.pop()
            if isinstance(v, str):
                if _SURROGATE.search(v):
                    return key
            elif isinstance(v, dict):
                stack.extend(v.keys())
                stack.extend(v.values())
            elif isinstance(v, list):
                stack.extend(v)
    return None



@dataclass
class PromptJob:
    """One prompt of a request and the choices generated for it.

    Attributes:
        prompt_index: Position of the prompt in the request (choices are indexed
            ``prompt_index × n + j``).
        token_ids: The prompt, token ids [L].
        max_new: Tokens per choice (the user's ``max_tokens``, else what the model length
            leaves).
        cached_tokens: Choice 0's actual reuse (``usage.prompt_tokens_details``).
        prefill / decode: Choice 0's workers, known at its token #1.
    """

    prompt_index: int
    token_ids: list[int]
    max_new: int
    cached_tokens: int = 0
    prefill: Worker | None = None
    decode: Worker | None = None


class Preprocessor:
    """Turns a validated OpenAI request into :class:`PromptJob` s and sampling parameters.

    Args:
        tokenizer: The model's tokenizer (``k3serve.tokenizer.get_tokenizer``).
        add_bos: Prepend BOS to text prompts of ``/v1/completions``.
    """

    def __init__(self, tokenizer, add_bos: bool) -> None:
        self.tokenizer = tokenizer
        self.add_bos = add_bos
        self._grammar_vocab = None  # k3serve.structured.GrammarVocab, built on first use

    def grammar(self, req: ChatCompletionRequest) -> str | None:
        """The request's structured-output grammar (llguidance Lark text), or ``None``.

        ``tool_choice`` ``required`` → a Kimi tool-call section over all tools, a named
        function → over that one (one call unless ``parallel_tool_calls``);
        ``response_format`` ``json_schema`` / ``json_object`` → one JSON value.

        Raises:
            APIError: 400 when the grammar engine rejects the schema (the field named).
        """
        from k3serve.structured import (
            GrammarError,
            json_object_grammar,
            json_schema_grammar,
            tool_call_grammar,
        )
        from router.schemas import NamedToolChoice

        param, grammar = None, None
        try:
            if req.tools and (req.tool_choice == "required"
                              or isinstance(req.tool_choice, NamedToolChoice)):
                param = "tools"
                fns = [t.function.model_dump() for t in req.tools]
                if isinstance(req.tool_choice, NamedToolChoice):
                    fns = [f for f in fns if f["name"] == req.tool_choice.function.name]
                grammar = tool_call_grammar(fns, parallel=req.parallel_tool_calls)
            elif req.response_format is not None and req.response_format.type == "json_object":
                param, grammar = "response_format", json_object_grammar()
            elif req.response_format is not None and req.response_format.type == "json_schema":
                param = "response_format"
                grammar = json_schema_grammar(req.response_format.json_schema.schema_)  # type: ignore[union-attr]
            if grammar is not None:
                if self._grammar_vocab is None:
                    from k3serve.structured import GrammarVocab

                    self._grammar_vocab = GrammarVocab(self.tokenizer)
                self._grammar_vocab.validate(grammar)
        except GrammarError as e:
            raise APIError(400, f"{param}: {e}", param=param, code="invalid_value") from None
        return grammar

    def job(self, index: int, ids: list[int], max_tokens: int | None, limit: int,
            param: str = "prompt") -> PromptJob:
        """One prompt's job after the checks.

        Args:
            index: Prompt index.
            ids: Token ids [L].
            max_tokens: Requested new tokens (``None``: up to the model length).
            limit: Longest prompt + output, tokens.
            param: The request field named in errors.

        Raises:
            APIError: empty prompt, token id outside the vocabulary, over-long request.
        """
        vocab = self.tokenizer.vocab_size
        if not ids:
            raise APIError(400, "the prompt is empty", param=param, code="invalid_value")
        if max(ids) >= vocab:
            raise APIError(400, f"token id {max(ids)} is outside the vocabulary [0, {vocab})",
                           param=param, code="invalid_value")
        if len(ids) + (max_tokens or 1) > limit:
            raise APIError(
                400, f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(ids) + (max_tokens or 0)} tokens ({len(ids)} in the prompt, "
                f"{max_tokens or 0} for the completion).", param=param,
                code="context_length_exceeded")
        return PromptJob(index, ids, max_tokens if max_tokens else limit - len(ids))

    def completion_jobs(self, req: CompletionRequest, limit: int) -> list[PromptJob]:
        """Tokenize the prompts of a completions request.

        Raises:
            APIError: empty or over-long prompt, token id outside the vocabulary.
        """
        jobs = []
        for i, p in enumerate(req.prompts()):
            ids = (self.tokenizer.encode(p, add_bos=self.add_bos) if isinstance(p, str)
                   else list(p))
            jobs.append(self.job(i, ids, req.max_tokens, limit))
        return jobs

    def chat_jobs(self, req: ChatCompletionRequest, limit: int) -> list[PromptJob]:
        """Render and tokenize the conversation of a chat request.

        Raises:
            APIError: a template error, an over-long prompt.
        """
        msgs = [m.template_dict() for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            ids = list(self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                          tokenize=True, tools=tools))
        except ValueError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from None
        self.grammar(req)  # a schema the grammar engine rejects: 400 before any worker
        return [self.job(0, ids, req.max_new_tokens, limit, "messages")]

    def sampling(self, req: CompletionRequest | ChatCompletionRequest, max_new: int,
                 choice: int, base_seed: int) -> SamplingParams:
        """The ``SamplingParams`` of one choice (n = 1; its own seed).

        Choice 0 uses the request's seed (a fresh one if unset), so ``n = 1`` reproduces
        with the same seed; choice j > 0 uses a seed derived from it (:data:`GOLDEN`), so
        choices differ.
        """
        from k3serve.sampling import SamplingParams

        grammar, skip_special = None, True
        if isinstance(req, ChatCompletionRequest):
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            grammar = self.grammar(req)
            skip_special = not req.tools_active  # the tool-call markers are special tokens
        else:
            logprobs = req.logprobs
        seed = base_seed if choice == 0 else (base_seed * GOLDEN + choice) % (1 << 63)
        return SamplingParams(
            n=1, max_tokens=max_new, temperature=req.temperature, top_p=req.top_p,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
            seed=seed, stop=tuple(req.stop or ()),
            # ignore_eos: the model's end-of-text ids (EOS, end of message) stop nothing
            stop_token_ids=() if req.ignore_eos else tuple(self.tokenizer.stop_token_ids),
            ignore_eos=req.ignore_eos, logprobs=logprobs,
            grammar=grammar, skip_special_tokens=skip_special)


def prompt_hashes(ids: list[int], block_size: int, fingerprint: str,
                  cache_salt: str | None) -> list[str]:
    """Chained hashes of the prompt's full blocks, salted as the workers salt theirs.

    Args:
        ids: Prompt token ids [L].
        block_size: Tokens per block (B).
        fingerprint: The workers' layout fingerprint (the salt base).
        cache_salt: The request's tenant salt (``None``: none).

    Returns:
        ``⌊L / B⌋`` hex hashes (``k3serve.cache.hashing.block_hashes``).
    """
    from k3serve.cache.hashing import block_hashes, make_salt

    return block_hashes(ids, block_size, make_salt(fingerprint, cache_salt))
