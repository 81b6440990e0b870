"""The files of a safetensors checkpoint: which files (a folder, an index, a list), the tensor
headers they hold, and a content identity of a checkpoint (what prefix-cache events and the
workers' fingerprints name it by).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "k3serve_config.json"
SHARD_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
"""File names :func:`k3serve.model.checkpoint_save.save_checkpoint` writes (and replaces)."""


def checkpoint_files(
    folder_or_files: str | os.PathLike | Sequence[str | os.PathLike],
) -> list[Path]:
    """Resolve the safetensors files of a checkpoint.

    Args:
        folder_or_files: a folder (its ``model.safetensors.index.json`` if present, else every
            ``*.safetensors`` in it), an index file, one ``.safetensors`` file, or a list of
            ``.safetensors`` files.

    Returns:
        The files, sorted, deduplicated.

    Raises:
        FileNotFoundError: the path does not exist, a folder has no safetensors, or a shard the
            index names is absent (all absent shards are named).
    """
    if isinstance(folder_or_files, (str, os.PathLike)):
        p = Path(folder_or_files)
        if p.is_dir():
            if (p / INDEX_FILE).exists():
                return _index_files(p / INDEX_FILE)
            files = sorted(p.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"checkpoint: no *.safetensors file in {p}")
            return files
        if p.is_file():
            return _index_files(p) if p.name.endswith(".index.json") else [p]
        raise FileNotFoundError(f"checkpoint: {p} does not exist")
    files = sorted({Path(f) for f in folder_or_files})
    absent = [str(f) for f in files if not f.is_file()]
    if absent or not files:
        raise FileNotFoundError(f"checkpoint: missing file(s) {absent or '(none given)'}")
    return files


def _index_files(index: Path) -> list[Path]:
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    files = sorted({index.parent / v for v in weight_map.values()})
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise FileNotFoundError(f"checkpoint: {index} names shard(s) that are absent: {absent}")
    return files


def read_headers(
    files: Sequence[Path],
) -> tuple[dict[str, tuple[Path, tuple[int, ...], str]], list[str]]:
    """Names, shapes and dtypes of every tensor in ``files``, from the headers only.

    Returns:
        ``({name: (file, shape, safetensors dtype)}, [descriptions of names found twice])``.
    """
    headers: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    dups: list[str] = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sl = f.get_slice(name)
                if name in headers:
                    dups.append(f"{name}: stored twice ({headers[name][0].name}, {path.name})")
                    continue
                headers[name] = (path, tuple(sl.get_shape()), sl.get_dtype())
    return headers, dups


# ---------------------------------------------------------------------- identity
#: Bytes hashed at each end of every tensor by :func:`checkpoint_identity`.
IDENTITY_SAMPLE_BYTES = 64


def checkpoint_identity(folder_or_files: str | os.PathLike | Sequence[str | os.PathLike]) -> str:
    """A cheap, deterministic identity of a checkpoint's weights (part of the layout
    fingerprint, ``k3serve.cache.specs.layout_fingerprint``), so that two checkpoints of the
    same shape never share block hashes or exchange cache.

    BLAKE2b-128 over the model config of the folder (``k3serve_config.json`` and/or
    ``config.json``, as canonical JSON: formatting does not matter) and, per safetensors file
    (in :func:`checkpoint_files` order, by file name): its raw header (names, dtypes, shapes,
    offsets, ``__metadata__``) and the first and last :data:`IDENTITY_SAMPLE_BYTES` bytes of
    every tensor's data. No paths, sizes alone or mtimes: copies of a checkpoint agree on any
    machine. It reads ~128 bytes per tensor, not the weights; two checkpoints that differ only
    inside tensors, away from both ends of every one, would collide (a fine-tune changes far
    more than that).

    Args:
        folder_or_files: as :func:`checkpoint_files`.

    Returns:
        ``"ckpt:"`` + 32 lowercase hex characters.

    Raises:
        FileNotFoundError: as :func:`checkpoint_files`.
        ValueError: a file that is not safetensors (truncated or malformed header).
    """
    import mmap

    files = checkpoint_files(folder_or_files)
    h = hashlib.blake2b(digest_size=16)
    h.update(b"k3serve-weights-1")
    folder = Path(folder_or_files) if isinstance(folder_or_files, (str, os.PathLike)) else None
    if folder is not None and folder.is_dir():
        for name in (CONFIG_FILE, "config.json"):
            if (folder / name).is_file():
                with open(folder / name) as f:
                    canon = json.dumps(json.load(f), sort_keys=True, separators=(",", ":"))
                h.update(f"{name}\0{canon}\0".encode())
    k = IDENTITY_SAMPLE_BYTES
    for path in files:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw_n = f.read(8)
            n = int.from_bytes(raw_n, "little") if len(raw_n) == 8 else -1
            if not 0 < n <= size - 8:
                raise ValueError(f"checkpoint: {path.name} is not a safetensors file")
            header = f.read(n)
            try:
                entries = json.loads(header)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise ValueError(f"checkpoint: {path.name} has a malformed header") from None
            h.update(f"{path.name}\0".encode() + raw_n + header)
            spans = sorted(
                tuple(v["data_offsets"])
                for key, v in entries.items()
                if key != "__metadata__" and isinstance(v, dict)
            )
            if not spans or size == 8 + n:
                continue
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                base = 8 + n
                for start, end in spans:
                    a, b = base + start, min(base + end, size)
                    h.update(m[a : min(a + k, b)] + m[max(a, b - k) : b])
    return "ckpt:" + h.hexdigest()


def random_init_identity(seed: int) -> str:
    """The weights identity of a randomly initialised model: its init seed (the same seed
    gives the same weights on every machine: the model is initialised on the CPU)."""
    return f"random-init:seed={int(seed)}"




__all__ = [
    "CONFIG_FILE",
    "IDENTITY_SAMPLE_BYTES",
    "INDEX_FILE",
    "SHARD_RE",
    "SINGLE_FILE",
    "checkpoint_files",
    "checkpoint_identity",
    "random_init_identity",
    "read_headers",
]
