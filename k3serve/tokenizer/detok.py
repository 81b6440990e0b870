"""Incremental detokenization with stop-token, stop-string and length handling.

Pure Python (no torch). One :class:`IncrementalDetokenizer` per choice of a request turns the
stream of generated token ids into a stream of text pieces whose concatenation is the final
output text, and says when the choice is finished and why.

Two things must not leak into a streamed piece:

* **Partial UTF-8.** A byte-level tokenizer can split one character over several tokens;
  decoding a prefix of them gives U+FFFD. As in vLLM's ``detokenize_incrementally``, we decode
  the window ``ids[prefix_offset:]`` and the already-emitted part ``ids[prefix_offset:
  read_offset]`` and emit the difference only when it does not end in U+FFFD; otherwise the
  tokens wait for the next one. At finish, whatever is left is flushed as decoded (an
  unfinished character becomes U+FFFD), so the full text equals ``decode(output ids)``.
* **The start of a stop string.** Text that could still grow into a stop string is held back
  (only the longest suffix that is a proper prefix of some stop string — not a fixed
  ``max_len - 1`` window). When a stop string completes, the text is cut before it (after it
  with ``include_stop_str_in_output``) and the choice finishes with reason ``"stop"``.

Token-level stops (EOS unless ``ignore_eos``, ``stop_token_ids``) finish with ``"stop"``; their
text is left out unless ``include_stop_str_in_output`` (vLLM v1). Reaching ``max_tokens``
finishes with ``"length"``. The stop token is still counted in :attr:`token_ids`.

A token stream that ends without any of these (the producer aborted, hit a limit this
detokenizer does not know, or went away) is closed with :meth:`IncrementalDetokenizer.finish`,
which releases the held-back text.

Text windows (``|`` = offsets into the decodable id list, ``^`` = offsets into the text)::

    ids   : [ ........ | prefix_offset ... | read_offset ... new ids ]
    text  : [ emitted ............ ^ emitted_len  held back ^ len(text) ]
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

from k3serve.sampling import SamplingParams

_REPLACEMENT = "\ufffd"


class TokenDecoder(Protocol):
    """What the detokenizer needs from a tokenizer.

    ``decode`` may also take a ``skip_special_tokens`` keyword (as ``k3serve.tokenizer``'s
    tokenizers do); when it does, the detokenizer passes ``params.skip_special_tokens``.
    """

    def decode(self, ids: Sequence[int]) -> str:
        """Decodes ``ids`` into text; invalid or incomplete UTF-8 becomes U+FFFD."""
        ...


@functools.lru_cache(maxsize=64)
def _takes_skip_kw(decode_func: Any) -> bool:
    """Whether a ``decode`` function (the unbound one of a tokenizer's class) takes the
    ``skip_special_tokens`` keyword; cached, since ``inspect.signature`` costs tens of µs
    and a router builds a detokenizer per choice."""
    try:
        return "skip_special_tokens" in inspect.signature(decode_func).parameters
    except (TypeError, ValueError):  # builtins / C extensions without a signature
        return False


def _bind_decode(tokenizer: TokenDecoder, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` with ``skip_special_tokens`` bound when it takes that keyword."""
    decode = tokenizer.decode
    func = getattr(decode, "__func__", None)  # a bound method: its class's function
    try:
        takes_kw = _takes_skip_kw(func) if func is not None else _takes_skip_kw(decode)
    except TypeError:  # an unhashable callable: not cached
        takes_kw = _takes_skip_kw.__wrapped__(decode)
    if takes_kw:
        return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
    return tokenizer.decode


class DetokOutput(NamedTuple):
    """Result of feeding token(s) to the detokenizer.

    Attributes:
        new_text: Text to append to the output stream (may be empty).
        finished: True once the choice is done; no more tokens may be fed.
        finish_reason: ``"stop"`` or ``"length"`` when finished, else ``None``.
    """

    new_text: str
    finished: bool
    finish_reason: str | None


class IncrementalDetokenizer:
    """Streams the text of one choice and detects its end.

    Args:
        tokenizer: Anything with ``decode(ids) -> str`` (:class:`TokenDecoder`).
        params: The request's sampling parameters (stop, stop_token_ids, ignore_eos,
            max_tokens, include_stop_str_in_output, skip_special_tokens are read).
        eos_token_id: The model's EOS id, or ``None``.
        special_token_ids: Ids dropped from the text when ``params.skip_special_tokens``
            (needed only for a ``decode`` without a ``skip_special_tokens`` keyword).
        max_tokens: Optional extra cap on generated tokens (e.g. what is left of the model's
            length); the effective limit is the smaller of this and ``params.max_tokens``.

    Mutates its own state on :meth:`step` / :meth:`update`; not thread-safe.
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        params: SamplingParams,
        *,
        eos_token_id: int | None = None,
        special_token_ids: Collection[int] = (),
        max_tokens: int | None = None,
    ) -> None:
        self._decode = _bind_decode(tokenizer, params.skip_special_tokens)
        self._params = params
        self._stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if eos_token_id is None or params.ignore_eos else {eos_token_id}
        )
        self._skip = frozenset(special_token_ids) if params.skip_special_tokens else frozenset()
        limits = [m for m in (params.max_tokens, max_tokens) if m is not None]
        self._max_tokens = min(limits) if limits else None
        self._stops = params.stop
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._include_stop = params.include_stop_str_in_output

        self._token_ids: list[int] = []  # every generated id, stop tokens included
        self._ids: list[int] = []  # ids that reach decode()
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""  # decoded, clean text (emitted + held back)
        self._emitted = 0  # len of the text already returned
        self._checked = 0  # len of the text already searched for stop strings
        #: Per fed token, the length of :attr:`text` right after it (the text each token
        #: released is ``text[ends[k-1]:ends[k]]``; a finish's flush goes to the last token).
        self.text_ends: list[int] = []
        self.finish_reason: str | None = None
        #: The matched stop string, the stop token id, or ``None``.
        self.stop_reason: str | int | None = None

    # ------------------------------------------------------------------ state
    @property
    def finished(self) -> bool:
        """True once a stop or the length limit was reached."""
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """All text returned so far (the final output once finished)."""
        return self._text[: self._emitted]

    @property
    def token_ids(self) -> list[int]:
        """Every token fed so far (a copy), including a final stop token."""
        return list(self._token_ids)

    @property
    def num_tokens(self) -> int:
        """How many tokens were fed so far (``len(token_ids)``, without the copy)."""
        return len(self._token_ids)

    # ------------------------------------------------------------------ feeding
    def step(self, token_id: int) -> DetokOutput:
        """Feeds one generated token.

        Args:
            token_id: The token just sampled.

        Returns:
            The text that became safe to stream, and whether/why the choice finished.

        Raises:
            RuntimeError: If the choice already finished.
        """
        # (the stop-string steps are skipped outright for a request without stop strings:
        # ``_find_stop`` and ``_held_back`` find nothing then; the router runs this per token)
        if self.finish_reason is not None:
            raise RuntimeError("IncrementalDetokenizer.step: choice already finished")
        all_ids = self._token_ids
        all_ids.append(token_id)
        stop_token = token_id in self._stop_ids
        if token_id not in self._skip and (not stop_token or self._include_stop):
            ids = self._ids
            ids.append(token_id)
            # the newly decodable text (ids held back while it ends in U+FFFD), inline: per token
            decode, p = self._decode, self._prefix_offset
            prefix = decode(ids[p : self._read_offset])
            full = decode(ids[p:])
            if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
                self._text += full[len(prefix) :]
                self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        at_length = self._max_tokens is not None and len(all_ids) >= self._max_tokens
        if stop_token or at_length:
            self._flush_partial()

        stops = self._stops
        hit = self._find_stop() if stops else None
        if hit is not None:
            start, end, s = hit
            self._text = self._text[: end if self._include_stop else start]
            self._finish("stop", s)
        elif stop_token:
            self._finish("stop", token_id)
        elif at_length:
            self._finish("length", None)
        text = self._text
        n = self._checked = len(text)

        reason = self.finish_reason
        if reason is None and stops and not self._include_stop:
            n -= self._held_back()
        emitted = self._emitted
        if n > emitted:
            self._emitted = n
            self.text_ends.append(n)
            return DetokOutput(text[emitted:n], reason is not None, reason)
        self.text_ends.append(emitted)
        return DetokOutput("", reason is not None, reason)

    def update(self, token_ids: Iterable[int]) -> DetokOutput:
        """Feeds several tokens in order (e.g. token #1 plus the decode worker's first batch):
        the same text, finish and :attr:`token_ids` as :meth:`step` on each in turn.

        Tokens after the one that finishes the choice are ignored (:attr:`num_tokens` tells
        how many were consumed).

        Without stop strings, the leading run of tokens that cannot finish the choice (no stop
        token, no skipped special, below the length limit) is decoded at once: one window
        decode for the run instead of one per token (:meth:`_extend`; the router relays the
        tokens a decode worker sent together this way). What the run completes is the text
        the per-token steps emit over it: both append ``decode(window + run)`` minus
        ``decode(window)``; only the split of that text among the run's tokens is not
        computed. A run whose text ends in an unfinished character is stepped token by token.

        Returns:
            The concatenated new text and the state after the last token consumed.

        Raises:
            RuntimeError: If the choice already finished before the first token.
        """
        if self.finished:
            raise RuntimeError("IncrementalDetokenizer.update: choice already finished")
        ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        pieces: list[str] = []
        start = 0
        if not self._stops and len(ids) > 1:
            end = len(ids)
            if self._max_tokens is not None:  # the token that reaches the limit is stepped
                end = min(end, self._max_tokens - len(self._token_ids) - 1)
            stop, skip = self._stop_ids, self._skip
            run = 0
            while run < end and ids[run] not in stop and ids[run] not in skip:
                run += 1
            if run > 1:
                text = self._extend(ids[:run])
                if text is not None:
                    pieces.append(text)
                    start = run
        for t in ids[start:] if start else ids:
            out = self.step(t)
            pieces.append(out.new_text)
            if out.finished:
                break
        return DetokOutput("".join(pieces), self.finished, self.finish_reason)

    def _extend(self, run: list[int]) -> str | None:
        """Feeds ``run`` (tokens none of which finishes the choice; no stop strings) with one
        window decode; returns the text it releases, or ``None`` (nothing fed) when the
        window's text would end in U+FFFD or not grow (the caller steps it per token)."""
        ids = self._ids
        n0 = len(ids)
        ids += run
        decode, p = self._decode, self._prefix_offset
        try:
            prefix = decode(ids[p : self._read_offset])
            full = decode(ids[p:])
        except BaseException:  # e.g. an id outside the vocabulary: nothing fed
            del ids[n0:]
            raise
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            del ids[n0:]
            return None
        self._token_ids += run
        self._text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        text = self._text
        emitted, self._emitted = self._emitted, len(text)
        self._checked = len(text)
        self.text_ends += [emitted] * (len(run) - 1) + [len(text)]  # to the run's last token
        return text[emitted:]

    def finish(self, reason: str = "abort") -> DetokOutput:
        """Ends the choice where the token stream stopped, releasing the held-back text.

        For a stream that ended without a stop or the length limit seen here (an aborted
        request, a producer's own limit). The held-back text is flushed: undecoded ids as
        decoded (an unfinished character becomes U+FFFD), and a suffix that was held back as
        the possible start of a stop string (it never completed one). Should the flushed text
        complete a stop string after all, the text is cut there and the reason is ``"stop"``.
        Idempotent: a finished choice returns no text and keeps its reason.

        Args:
            reason: The finish reason to record (e.g. ``"abort"`` for an error end,
                ``"length"`` for a producer's length limit).

        Returns:
            The released text, ``finished=True`` and the recorded reason.
        """
        if self.finished:
            return DetokOutput("", True, self.finish_reason)
        self._flush_partial()
        hit = self._find_stop()
        if hit is not None:
            start, end, s = hit
            self._text = self._text[: end if self._include_stop else start]
            self._finish("stop", s)
        else:
            self._finish(reason, None)
        self._checked = len(self._text)
        new_text = self._text[self._emitted :]
        self._emitted = len(self._text)
        if self.text_ends:
            self.text_ends[-1] = self._emitted
        return DetokOutput(new_text, True, self.finish_reason)

    # ------------------------------------------------------------------ internals
    def _finish(self, reason: str, stop_reason: str | int | None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def _flush_partial(self) -> None:
        """At finish: appends whatever is still undecoded, U+FFFD included."""
        if self._read_offset < len(self._ids):
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            self._text += full[len(prefix) :]
            self._prefix_offset = self._read_offset = len(self._ids)

    def _find_stop(self) -> tuple[int, int, str] | None:
        """The stop string that completes first in the unchecked text: (start, end, string)."""
        if not self._stops or len(self._text) == self._checked:
            return None
        lo = max(0, self._checked - self._max_stop + 1)
        best: tuple[int, int, str] | None = None
        for s in self._stops:
            i = self._text.find(s, lo)
            if i >= 0 and (best is None or (i + len(s), i) < (best[1], best[0])):
                best = (i, i + len(s), s)
        return best

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        if self._include_stop or not self._stops:
            return 0
        pending = len(self._text) - self._emitted
        for k in range(min(self._max_stop - 1, pending), 0, -1):
            tail = self._text[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self._stops):
                return k
        return 0
