"""Giving memory back after large request bodies: :class:`MemoryTrimmer`.

A large body (up to ``--max-body-bytes``) becomes, for as long as its request runs, its bytes,
the parsed JSON (Python strings, lists) and the prompts' token ids: tens of MiB for a body of a
few MiB. CPython frees them, but glibc's allocator keeps the freed heap in the process (its
dynamic mmap threshold moves big blocks onto the heap after the first large free), so the
router's RSS would stay at the high-water mark of its largest bodies.

The trimmer is told the size of every body read (:meth:`MemoryTrimmer.note`); once bodies of
``min_bytes`` or more were read since the last trim and ``every_s`` passed, it calls glibc's
``malloc_trim(0)``, which returns the free heap pages to the kernel. The router's process also
fixes the mmap threshold (:func:`fix_mmap_threshold`, from ``router.__main__``), so that
allocations of 1 MiB or more are always their own mappings, unmapped as soon as they are
freed. Not on glibc (macOS, musl): both do nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time

log = logging.getLogger("k3serve.router")

#: ``mallopt`` parameter number of the mmap threshold (glibc's malloc.h).
M_MMAP_THRESHOLD = -3


def _libc() -> ctypes.CDLL | None:
    """glibc, when this process runs on it (``malloc_trim`` is glibc's)."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim  # noqa: B018 - present on glibc only
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


class MemoryTrimmer:
    """Return the heap freed by large bodies to the kernel (module docstring).

    Args:
        min_bytes: A body of this many bytes or more calls for a trim.
        every_s: Least seconds between two trims.
    """

    def __init__(self, min_bytes: int = 256 << 10, every_s: float = 1.0) -> None:
        self.min_bytes, self.every_s = min_bytes, every_s
        self.libc = _libc()
        self.pending = False  # a large body was read since the last trim
        self.trims = 0
        self.last = 0.0

    def note(self, size: int) -> None:
        """A body of ``size`` bytes was read."""
        if size >= self.min_bytes:
            self.pending = True

    def trim(self) -> bool:
        """``malloc_trim(0)`` now if a large body was read since the last one and ``every_s``
        passed; returns whether it ran."""
        now = time.monotonic()
        if not self.pending or self.libc is None or now - self.last < self.every_s:
            return False
        self.pending, self.last = False, now
        self.libc.malloc_trim(0)
        self.trims += 1
        return True

    async def run(self) -> None:
        """Trim when due, every ``every_s`` seconds, until cancelled."""
        while True:
            await asyncio.sleep(self.every_s)
            self.trim()


def fix_mmap_threshold(nbytes: int = 1 << 20) -> bool:
    """``mallopt(M_MMAP_THRESHOLD, nbytes)`` for this process (glibc): allocations of
    ``nbytes`` or more are mappings of their own, returned to the kernel when freed (the
    threshold no longer grows after a large free). Returns whether it was set."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, nbytes) == 1)


__all__ = ["MemoryTrimmer", "fix_mmap_threshold"]
