"""Grammar masks as logits masks (torch), with the plain-torch reference beside the fast path.

Fast path: the grammar engine's packed bitmask (``Matcher.bitmask``, computed in Rust) unpacked
with tensor ops into a bool ``[N, V]``. Reference: one parser check per token id
(``Matcher.allows``), no bitmask at all; tests compare the two on every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3serve.structured import Matcher

_BITS = torch.arange(8, dtype=torch.uint8)


def unpack_bitmask(masks: Sequence[bytes], vocab_size: int) -> torch.Tensor:
    """Packed bitmasks → allowed-token bool mask.

    Args:
        masks: N bitmasks, each ≥ ⌈V / 8⌉ bytes; bit ``v % 8`` of byte ``v // 8`` is token v.
        vocab_size: V.

    Returns:
        Bool ``[N, V]`` on the CPU (True: allowed).
    """
    nbytes = (vocab_size + 7) // 8
    buf = torch.frombuffer(bytearray(b"".join(m[:nbytes] for m in masks)), dtype=torch.uint8)
    bits = (buf.view(len(masks), nbytes, 1) >> _BITS) & 1
    return bits.view(len(masks), nbytes * 8)[:, :vocab_size].bool()


def grammar_mask(matchers: Sequence[Matcher], vocab_size: int) -> torch.Tensor:
    """Allowed next tokens of each matcher, bool ``[N, V]`` (fast path)."""
    return unpack_bitmask([m.bitmask() for m in matchers], vocab_size)


def reference_mask(matchers: Sequence[Matcher], vocab_size: int) -> torch.Tensor:
    """The same as :func:`grammar_mask`, one parser check per (row, token id): O(N·V)."""
    out = torch.zeros(len(matchers), vocab_size, dtype=torch.bool)
    for r, m in enumerate(matchers):
        for v in range(vocab_size):
            out[r, v] = m.allows(v)
    return out


def apply_mask(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits`` with disallowed entries at ``-inf``.

    Args:
        logits: float ``[N, V]`` (not modified).
        allowed: bool ``[N, V]`` (any device; moved to ``logits``' device).

    Returns:
        Float ``[N, V]``, a new tensor.

    Raises:
        ValueError: shapes differ, or a row allows no token.
    """
    if allowed.shape != logits.shape:
        raise ValueError(f"apply_mask: allowed {tuple(allowed.shape)} != logits "
                         f"{tuple(logits.shape)}")
    if not bool(allowed.any(dim=-1).all()):
        raise ValueError("apply_mask: a row allows no token")
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))
