"""One k3-tiny instance over several processes (gloo, CPU): TP 2, EP 2 (planner placement with
redundant copies from the model's own expert load counters) and EP 4 give the same greedy tokens
as one process, logits within fp32 tolerance (must-show 1 of issue 16)."""

from __future__ import annotations

import pytest
import torch

from deploy import experts as planner
from k3serve.parallel import counters
from k3serve.parallel.runner import InstanceSpec, RankRunner
from tests.parallel.helpers import greedy_generate, spawn_instance

PROMPTS = [
    [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100],
    [256, 100, 101, 102, 32, 102, 105, 98, 40, 110, 41, 58],
    [256, 84, 104, 101],
]
NEW = 6


@pytest.fixture(scope="module")
def reference():
    r = RankRunner(InstanceSpec())
    counters.reset_expert_load(r.model)
    toks, logits = greedy_generate(r, PROMPTS, NEW)
    load = counters.expert_load_array(r.model)
    return toks, logits, load


@pytest.mark.parametrize(
    "tp,ep,planned", [(2, 1, False), (1, 2, True), (1, 4, False)], ids=["TP2", "EP2-plan", "EP4"]
)
def test_same_tokens_as_one_process(tp: int, ep: int, planned: bool, reference) -> None:
    ref_toks, ref_logits, load = reference
    plan = None
    if planned:  # 8 experts + 2 copies of the hottest ones, 5 slots on each of 2 ranks
        plan = planner.plan(list(load), ep, 2).to_dict()
        assert plan["slots_per_rank"] == 5
    with spawn_instance(InstanceSpec(tp=tp, ep=ep, plan=plan)) as inst:
        toks, logits = inst.generate(PROMPTS, NEW)
        inst_load = inst.expert_load()
    assert toks == ref_toks
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # the counters see the same routing on the instance (rank 0 routes every token)
    assert [list(v) for v in inst_load.values()] == [list(v) for v in load]


def test_per_rank_cache_shapes() -> None:
    spec = InstanceSpec(tp=2)
    r = RankRunner(spec, rank=1)
    cfg = r.cfg
    h = cfg.kda_num_heads // 2
    assert r.pools.kda_state.shape[2:] == (h, cfg.kda_head_dim, cfg.kda_head_dim)
    assert r.pools.conv_state.shape[-1] == 3 * h * cfg.kda_head_dim
    assert r.pools.mla_latent.shape[-1] == cfg.mla_latent_dim  # latents replicated
    mix = r.model.model.layers[0].self_attn
    assert mix.num_heads == h and mix.q_proj.weight.shape[0] == h * cfg.kda_head_dim


def test_bad_parallel_spec_names_the_field() -> None:
    with pytest.raises(ValueError, match="ep"):
        InstanceSpec(tp=2, ep=3)
    with pytest.raises(ValueError, match="tp"):
        InstanceSpec(tp=0)
    with pytest.raises(ValueError, match="kda_num_heads"):
        RankRunner(InstanceSpec(tp=3))
