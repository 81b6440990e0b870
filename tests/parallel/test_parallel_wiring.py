"""Worker wiring of issue 16: ``--tp/--ep/--expert-plan`` flags, the instance spec they build,
and the TP-2 transfer layout (``gather_slots``) holding exactly a TP-1 process's states."""

from __future__ import annotations

import json

import pytest
import torch

from deploy import experts as planner
from k3serve.parallel.runner import COLLECTIVE_TIMEOUT_S, InstanceSpec, RankRunner
from tests.parallel.helpers import greedy_generate, spawn_instance
from worker.config import parse_config
from worker.loop import instance_spec

PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 84, 104, 101, 32, 99, 97, 116, 32, 115]]


def test_flags_build_the_instance_spec(tmp_path) -> None:
    c = parse_config("decode", ["--tp", "2", "--num-slots", "4", "--num-pages", "9",
                                "--device", "cpu"])
    assert (c.tp, c.ep, c.expert_plan) == (2, 1, None)
    s = instance_spec(c)
    assert (s.tp, s.ep, s.num_slots, s.num_pages, s.device, s.dtype) == (2, 1, 4, 9, "cpu",
                                                                         "float32")
    plan = planner.plan([[5, 1, 1, 1, 1, 1, 1, 9]], 2, 2).to_dict()
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(plan))
    s = instance_spec(parse_config("prefill", ["--ep", "2", "--expert-plan", str(f)]))
    assert s.ep == 2 and s.plan == plan
    with pytest.raises(ValueError, match="expert_plan: .* 2 ranks, --ep is 4"):
        instance_spec(parse_config("prefill", ["--ep", "4", "--expert-plan", str(f)]))
    with pytest.raises(SystemExit, match="--ep: 3 is not a multiple of --tp 2"):
        parse_config("prefill", ["--tp", "2", "--ep", "3"])
    s = instance_spec(parse_config("prefill", ["--tp", "2", "--ep", "4"]))
    assert (s.tp, s.ep, s.dp, s.world) == (2, 4, 2, 4)
    with pytest.raises(SystemExit, match="--expert-plan"):
        parse_config("prefill", ["--expert-plan", str(f)])
    with pytest.raises(SystemExit, match="--tp"):
        parse_config("prefill", ["--tp", "0"])
    assert s.collective_timeout_s == COLLECTIVE_TIMEOUT_S  # the runner's default
    s = instance_spec(parse_config("decode", ["--ep", "2", "--collective-timeout", "4.5"]))
    assert s.collective_timeout_s == 4.5
    for bad in ("0", "-1"):
        with pytest.raises(SystemExit, match="--collective-timeout: must be > 0"):
            parse_config("decode", ["--ep", "2", "--collective-timeout", bad])


def test_tp2_transfer_layout_holds_the_tp1_states() -> None:
    """What a TP-2 prefill instance sends (rank 0's gathered staging) equals the KDA / conv
    states one process computes for the same prompts: the wire layout is TP-1's."""
    ref = RankRunner(InstanceSpec())
    greedy_generate(ref, PROMPTS, 2)
    with spawn_instance(InstanceSpec(tp=2)) as inst:
        inst.generate(PROMPTS, 2)
        kda, conv = inst.gathered_state([0, 1])
    torch.testing.assert_close(kda, ref.pools.kda_state[:, [0, 1]], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(conv, ref.pools.conv_state[:, [0, 1]], rtol=1e-4, atol=1e-5)
