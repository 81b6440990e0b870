"""Chained block hashes of a prompt — the one definition the router and every worker share.

DESIGN.md §3: each *full* block ``i`` of ``block_size`` tokens has

    h_{-1} = BLAKE2b-128(utf8(salt))
    h_i    = BLAKE2b-128(h_{i-1} ‖ int32_le(token ids of block i))

with ``salt = make_salt(layout_fingerprint, cache_salt)``. Hashes travel as lowercase hex
(32 characters). BLAKE2b with a 16-byte digest comes from :mod:`hashlib`: caches are shared
between tenants, so a collision must be infeasible to craft (no xxhash, no Python ``hash``).

Block layout for ``block_size = 4`` and a prompt of 10 tokens::

    tokens  t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
    hashes  h0          | h1          | (partial: no hash)

This module imports nothing but the standard library (the router imports it; no torch).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DIGEST_SIZE = 16
"""Bytes per hash (BLAKE2b-128); hex strings are twice as long."""

_MAX_TOKEN_ID = 2**31 - 1


def make_salt(fingerprint: str, cache_salt: str | None = None) -> str:
    """The hash salt: the layout fingerprint, plus the request's ``cache_salt`` when it has one.

    Args:
        fingerprint: the worker's layout fingerprint (``GET /internal/info``;
            :func:`k3serve.cache.specs.layout_fingerprint`). Non-empty, no ``"|"``.
        cache_salt: optional per-request tenant salt (OpenAI-style ``cache_salt``); ``None``
            shares the cache with every request that has no salt.

    Returns:
        ``fingerprint`` or ``f"{fingerprint}|{cache_salt}"`` (unambiguous: the fingerprint has
        no ``"|"``).

    Raises:
        ValueError: ``fingerprint`` empty, not a str or containing ``"|"``; ``cache_salt`` not a
            str or empty.
    """
    if not isinstance(fingerprint, str) or not fingerprint or "|" in fingerprint:
        raise ValueError(f"fingerprint: must be a non-empty str without '|', got {fingerprint!r}")
    if cache_salt is None:
        return fingerprint
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError(f"cache_salt: must be a non-empty str or None, got {cache_salt!r}")
    return f"{fingerprint}|{cache_salt}"


def root_hash(salt: str) -> str:
    """``h_{-1}``: the chain's start for ``salt`` (lowercase hex, 32 characters).

    Raises:
        ValueError: ``salt`` is not a str.
    """
    if not isinstance(salt, str):
        raise ValueError(f"salt: must be a str, got {type(salt).__name__}")
    return hashlib.blake2b(salt.encode("utf-8"), digest_size=DIGEST_SIZE).hexdigest()


def _encode(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes (4 bytes per token).

    Raises:
        ValueError: an id outside ``[0, 2**31)`` or not an integer.
    """
    try:
        if token_ids and (min(token_ids) < 0 or max(token_ids) > _MAX_TOKEN_ID):
            raise ValueError
        return struct.pack(f"<{len(token_ids)}i", *token_ids)
    except (ValueError, TypeError, struct.error):
        raise ValueError(
            f"token_ids: every id must be an int in [0, 2**31), got {list(token_ids)[:8]}..."
        )


def _parent_bytes(parent: str) -> bytes:
    """``h_{i-1}`` from its hex form. Raises ValueError (naming ``parent``) when malformed."""
    try:
        prev = bytes.fromhex(parent)
    except (ValueError, TypeError):
        raise ValueError(f"parent: not a hex hash: {parent!r}") from None
    if len(prev) != DIGEST_SIZE:
        raise ValueError(f"parent: expected {DIGEST_SIZE} bytes of hex, got {len(prev)}")
    return prev


def hash_block(parent: str, token_ids: Sequence[int]) -> str:
    """One chain step ``h_i = H(h_{i-1} ‖ tokens)``; ``parent`` is ``h_{i-1}`` in hex.

    Use :func:`root_hash` for the first block's parent. Extends a chain one block at a time
    (a decoding sequence whose block just filled up).

    Raises:
        ValueError: ``parent`` is not a 32-character hex string; a bad token id.
    """
    return hashlib.blake2b(_parent_bytes(parent) + _encode(token_ids),
                           digest_size=DIGEST_SIZE).hexdigest()


def block_hashes(
    token_ids: Sequence[int], block_size: int, salt: str, parent: str | None = None
) -> list[str]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block has none).

    Args:
        token_ids: ``[L]`` token ids (ints in ``[0, 2**31)``; lists, tuples, numpy arrays).
        block_size: tokens per block ``B`` (≥ 1; must equal the worker's block size).
        salt: from :func:`make_salt`. Ignored when ``parent`` is given.
        parent: continue an existing chain after the block whose hash this is (hex);
            ``None`` starts from ``root_hash(salt)``.

    Returns:
        ``⌊L / B⌋`` lowercase hex strings; entry ``i`` identifies tokens ``[0, (i+1)·B)``
        under ``salt``. Equal prefixes under equal salts give equal hashes in every process
        and on every machine.

    Raises:
        ValueError: ``block_size`` < 1, ``salt`` not a str, bad token ids, bad ``parent``.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: must be an int ≥ 1, got {block_size!r}")
    if parent is None:
        prev = bytes.fromhex(root_hash(salt))
    else:
        prev = _parent_bytes(parent)
    ids = token_ids if isinstance(token_ids, (list, tuple)) else list(token_ids)
    out: list[str] = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        h = hashlib.blake2b(
            prev + _encode(ids[start : start + block_size]), digest_size=DIGEST_SIZE
        )
        prev = h.digest()
        out.append(h.hexdigest())
    return out


__all__ = ["DIGEST_SIZE", "block_hashes", "hash_block", "make_salt", "root_hash"]
