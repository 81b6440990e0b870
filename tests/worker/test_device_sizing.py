"""Device detection and the engine sizes a worker gets from it (worker/device.py), with
made-up cards: no GPU needed."""

from __future__ import annotations

import pytest
import torch

from deploy.launcher import gpu_args
from k3serve.config import PRESETS
from k3serve.engine.memory import pool_bytes, size_pools_from_memory
from worker.config import parse_config
from worker.device import DeviceProbe, default_share, resolve_sizes

GIB = 1 << 30
H200 = DeviceProbe(True, int(139.8 * GIB), "NVIDIA H200")
A100 = DeviceProbe(True, 80 * GIB, "NVIDIA A100-SXM4-80GB")
L4 = DeviceProbe(True, 24 * GIB, "NVIDIA L4")
NO_GPU = DeviceProbe(False)


def test_no_flags_on_a_large_card_is_the_fast_configuration() -> None:
    c = parse_config("decode", [], seen=H200)
    assert c.device == "cuda" and c.torch_dtype_name == "bfloat16"
    assert (c.max_num_batched_tokens, c.max_num_seqs, c.num_slots) == (8192, 256, 256)
    assert c.gpu_memory_utilization == 0.9


def test_small_cards_and_a100_get_the_small_token_budget() -> None:
    for card in (A100, L4):
        assert parse_config("prefill", [], seen=card).max_num_batched_tokens == 2048


def test_cpu_keeps_the_small_sizes() -> None:
    for argv, seen in (([], NO_GPU), (["--device", "cpu"], H200)):
        c = parse_config("decode", argv, seen=seen)
        assert c.device == "cpu" and c.torch_dtype_name == "float32"
        assert (c.max_num_batched_tokens, c.max_num_seqs, c.num_slots, c.num_pages) == (
            512, None, 32, 1024)
        assert c.gpu_memory_utilization is None


def test_given_flags_win() -> None:
    c = parse_config("decode", ["--max-num-batched-tokens", "4096", "--max-num-seqs", "64",
                                "--num-slots", "80", "--gpu-memory-utilization", "0.4"],
                     seen=H200)  # fmt: skip
    assert (c.max_num_batched_tokens, c.max_num_seqs, c.num_slots) == (4096, 64, 80)
    assert c.gpu_memory_utilization == 0.4
    # explicit pages without a share: the explicit pools, no memory sizing
    c = parse_config("decode", ["--num-pages", "4096"], seen=H200)
    assert c.num_pages == 4096 and c.gpu_memory_utilization is None


def test_workers_per_gpu_splits_the_default_share() -> None:
    assert default_share(1) == 0.9 and default_share(2) == 0.45 and default_share(3) == 0.3
    c = parse_config("prefill", ["--workers-per-gpu", "2"], seen=H200)
    assert c.gpu_memory_utilization == 0.45
    # a share the user gives is this worker's own, whatever the split
    c = parse_config("prefill", ["--workers-per-gpu", "2", "--gpu-memory-utilization", "0.4"],
                     seen=H200)
    assert c.gpu_memory_utilization == 0.4
    with pytest.raises(SystemExit, match="workers-per-gpu"):
        parse_config("prefill", ["--workers-per-gpu", "0"], seen=H200)
    with pytest.raises(ValueError, match="workers_per_gpu"):
        default_share(0)


def test_cuda_asked_for_without_cuda_is_refused() -> None:
    with pytest.raises(SystemExit, match="device"):
        parse_config("decode", ["--device", "cuda"], seen=NO_GPU)
    with pytest.raises(ValueError, match="device"):
        resolve_sizes("cuda:0", NO_GPU)


def test_launcher_device_args() -> None:
    assert gpu_args("cpu", 2) == ["--device", "cpu"]
    assert gpu_args(None, 2) == ["--workers-per-gpu", "2"]
    assert gpu_args("cuda", 1) == ["--device", "cuda", "--workers-per-gpu", "1"]


def test_two_workers_share_one_card() -> None:
    """The reported failure, with its figures: 0.4 of a 139.8 GiB card on each of two workers,
    the second starting after the first took 55.64 GiB. Counted against the whole card it is
    refused; counted against what the second process holds (its weights) it fits, and the two
    shares together stay within the card."""
    cfg = PRESETS["k3-mini"]
    total = int(139.8 * GIB)
    weights = 2 * GIB
    first = int(55.64 * GIB)
    free = total - first - weights  # what the card has left once the second loaded its weights
    reserve = GIB
    with pytest.raises(ValueError, match="GiB held"):
        size_pools_from_memory(cfg, total, free, 0.4, reserve, 64, 256, 32, torch.bfloat16, 1)
    pages = size_pools_from_memory(cfg, total, free, 0.4, reserve, 64, 256, 32, torch.bfloat16, 1,
                                   held_bytes=weights)  # fmt: skip
    slot_b, snap_b, page_b = pool_bytes(cfg, 64, torch.bfloat16)
    budget = int(0.4 * total) - weights - reserve
    assert pages == (budget - 257 * slot_b - 32 * snap_b - page_b) // page_b
    used = weights + reserve + 257 * slot_b + 32 * snap_b + (pages + 1) * page_b
    assert used <= 0.4 * total


def test_share_is_capped_by_what_is_free() -> None:
    """Another process that took more than its part leaves less than the share: the pools
    take what is free, not more."""
    cfg = PRESETS["k3-mini"]
    total, held, free = 100 * GIB, 2 * GIB, 10 * GIB
    pages = size_pools_from_memory(cfg, total, free, 0.45, 0, 64, 8, 4, torch.bfloat16, 0,
                                   held_bytes=held)  # fmt: skip
    slot_b, snap_b, page_b = pool_bytes(cfg, 64, torch.bfloat16)
    assert pages == (free - 8 * slot_b - 4 * snap_b) // page_b
