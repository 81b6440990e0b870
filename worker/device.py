"""Where a worker runs and the engine sizes that fit it.

A worker started without ``--device`` runs on CUDA when ``torch.cuda.is_available()``, else on
the CPU. Flags the user did not give are filled from the device:

=========================  ==================================  ==================
field                      CUDA                                CPU
=========================  ==================================  ==================
max_num_batched_tokens     8,192 (≥ 70 GiB card), else 2,048   512
max_num_seqs               256                                 ``None`` (= slots)
num_slots                  ``max_num_seqs``                    32
gpu_memory_utilization     0.9 / ``workers_per_gpu``           ``None``
=========================  ==================================  ==================

The CUDA figures are vLLM's API-server defaults (``EngineArgs.get_batch_defaults``: 8,192
batched tokens on a card of ≥ 70 GiB that is not an A100, 2,048 below; 256 running
sequences, vLLM's figure for every card before it raised large cards to 1,024 — kept at 256
here so that the decode graphs captured at start stay few) and its ``gpu_memory_utilization``
of 0.9. With a memory share the engine sizes its page pool from what the card has left after
the weights (:func:`k3serve.engine.engine.size_pools_from_memory`), so an explicit
``--num-pages`` without ``--gpu-memory-utilization`` keeps the explicit sizes.

``gpu_memory_utilization`` is this worker's own share of the card's total memory, counted
against what this process holds; when the launcher places ``N`` workers on one GPU it passes
``--workers-per-gpu N`` and each worker's default share is ``0.9 / N`` (:func:`default_share`).
"""

from __future__ import annotations

from typing import NamedTuple

#: the card's share all workers on it may hold together (vLLM's ``gpu_memory_utilization``)
CARD_SHARE = 0.9
#: a card with at least this much memory gets the large batched-token budget (vLLM's rule)
LARGE_CARD_BYTES = 70 << 30
CUDA_MAX_NUM_SEQS = 256
CUDA_BATCHED_TOKENS_LARGE = 8192
CUDA_BATCHED_TOKENS_SMALL = 2048
CPU_MAX_NUM_BATCHED_TOKENS = 512
CPU_NUM_SLOTS = 32


class DeviceProbe(NamedTuple):
    """What :func:`probe` saw: CUDA present, the card's total memory (bytes) and name."""

    cuda: bool
    total_bytes: int = 0
    name: str = ""


class Sizes(NamedTuple):
    """The engine sizes of one worker (``None``: the engine's own rule)."""

    device: str
    max_num_batched_tokens: int
    max_num_seqs: int | None
    num_slots: int
    gpu_memory_utilization: float | None


def probe(device: str | None = None) -> DeviceProbe:
    """Look at the machine: is CUDA available, and the total memory and name of ``device``
    (default ``cuda:0``). Initializes CUDA in this process when present."""
    import torch

    if not torch.cuda.is_available():
        return DeviceProbe(False)
    dev = torch.device(device if device and device.startswith("cuda") else "cuda")
    props = torch.cuda.get_device_properties(dev)
    return DeviceProbe(True, int(props.total_memory), str(props.name))


def default_share(workers_per_gpu: int) -> float:
    """This worker's default share of the card when ``workers_per_gpu`` workers share it.

    Raises:
        ValueError: ``workers_per_gpu`` < 1.
    """
    if workers_per_gpu < 1:
        raise ValueError(f"workers_per_gpu: must be ≥ 1, got {workers_per_gpu}")
    return round(CARD_SHARE / workers_per_gpu, 4)


def resolve_sizes(
    device: str | None,
    seen: DeviceProbe,
    *,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    num_slots: int | None = None,
    num_pages_given: bool = False,
    gpu_memory_utilization: float | None = None,
    workers_per_gpu: int = 1,
) -> Sizes:
    """The device and engine sizes of a worker: what the user gave, the rest from the device
    (the table in the module docstring).

    Args:
        device: ``--device`` (``None``: ``cuda`` when ``seen.cuda``, else ``cpu``).
        seen: the machine (:func:`probe`; tests pass made-up figures).
        max_num_batched_tokens, max_num_seqs, num_slots, gpu_memory_utilization: the flags
            (``None``: not given).
        num_pages_given: ``--num-pages`` was given (CUDA: explicit pools, no memory share
            unless ``--gpu-memory-utilization`` is given too).
        workers_per_gpu: workers the launcher placed on this card.

    Raises:
        ValueError: ``device`` is CUDA and ``seen.cuda`` is False (naming ``device``), or
            ``workers_per_gpu`` < 1.
    """
    dev = device or ("cuda" if seen.cuda else "cpu")
    if dev.startswith("cuda") and not seen.cuda:
        raise ValueError(f"device: {dev!r} asked for, but torch sees no CUDA device")
    if not dev.startswith("cuda"):
        return Sizes(dev, _given(max_num_batched_tokens, CPU_MAX_NUM_BATCHED_TOKENS),
                     max_num_seqs, _given(num_slots, CPU_NUM_SLOTS), gpu_memory_utilization)
    large = seen.total_bytes >= LARGE_CARD_BYTES and "a100" not in seen.name.lower()
    tokens = _given(max_num_batched_tokens,
                    CUDA_BATCHED_TOKENS_LARGE if large else CUDA_BATCHED_TOKENS_SMALL)
    seqs = _given(max_num_seqs, CUDA_MAX_NUM_SEQS)
    share = gpu_memory_utilization
    if share is None and not num_pages_given:
        share = default_share(workers_per_gpu)
    return Sizes(dev, tokens, seqs, _given(num_slots, seqs), share)


def _given(value: int | None, default: int) -> int:
    return default if value is None else value


__all__ = ["CARD_SHARE", "DeviceProbe", "Sizes", "default_share", "probe", "resolve_sizes"]
