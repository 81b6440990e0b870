"""Giving the router's heap back to the OS after a large request body.

A request body of up to ``max_body_bytes`` (4 MiB by default; more is refused with 413
before it is read whole) is held three times while it is parsed: the bytes, the parsed JSON
and the validated model. glibc's allocator keeps freed memory of its arenas for reuse, so
after large bodies the router's resident size stays at its high-water mark. After a body of
at least :data:`TRIM_AFTER_BYTES`, :func:`trim` asks glibc to return the free pages of every
arena (``malloc_trim(0)``, a few milliseconds); elsewhere (no glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

#: Bodies of at least this many bytes are followed by :func:`trim`.
TRIM_AFTER_BYTES = 1 << 20


@functools.cache
def _malloc_trim() -> Any:  # a ctypes function or None
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def trim(body_bytes: int) -> bool:
    """Return the allocator's free memory to the OS when ``body_bytes`` ≥
    :data:`TRIM_AFTER_BYTES`. Returns whether ``malloc_trim`` ran."""
    if body_bytes < TRIM_AFTER_BYTES:
        return False
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
