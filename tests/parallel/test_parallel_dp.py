"""tp 2 × dp 2 attention groups with ep 4 (``k3serve.parallel.groups``): four rank processes
(gloo, CPU) give the single-process forward's greedy tokens and logits (float32), with both
groups busy (slots 0, 2 on group 0, slot 1 on group 1), with one group idle in every forward, and
rank 0's transfer layout holds each slot's full-head state as one process has it."""

from __future__ import annotations

import pytest
import torch

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.parallel.layout import attention_groups
from k3serve.parallel.runner import InstanceSpec, RankRunner
from tests.parallel.helpers import engine_rounds, greedy_generate, spawn_instance

PROMPTS = [
    [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100],
    [256, 100, 101, 102, 32, 102, 105, 98, 40, 110, 41, 58, 32, 114, 101, 116, 117, 114, 110],
    [256, 84, 104, 101],
]
NEW = 5
SPEC = InstanceSpec(tp=2, ep=4, num_snapshots=8)
A = [256, *range(40, 79)]  # 40 tokens: a snapshot at 32
ROUNDS = [
    [(A, 1)],
    [(A + [99, 98, 97, 96, 95, 94, 93, 92], 1), ([256, *range(120, 139)], 1)],  # a prefix hit
    [([256, *range(150, 167)], 2)],  # n = 2: a fork
]


@pytest.fixture(scope="module")
def reference():
    r = RankRunner(InstanceSpec())
    toks, logits = greedy_generate(r, PROMPTS, NEW)
    idx = list(range(len(PROMPTS)))
    state = (r.pools.kda_state[:, idx].clone(), r.pools.conv_state[:, idx].clone())
    one = greedy_generate(RankRunner(InstanceSpec()), PROMPTS[1:2], NEW)[0]
    return toks, logits, state, one


@pytest.fixture(scope="module")
def instance():
    with spawn_instance(SPEC) as inst:
        yield inst


def test_groups_of_the_spec() -> None:
    assert (SPEC.world, SPEC.dp) == (4, 2)
    assert attention_groups(8, 16) == 2 and attention_groups(2, 2) == 1
    assert attention_groups(1, 4) == 1 and attention_groups(4, 1) == 1
    with pytest.raises(ValueError, match="ep: 6 is not a multiple of tp 4"):
        InstanceSpec(tp=4, ep=6)


def test_same_tokens_and_logits_as_one_process(instance, reference) -> None:
    ref_toks, ref_logits, _, _ = reference
    toks, logits = instance.generate(PROMPTS, NEW)
    assert toks == ref_toks
    for a, b in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_transfer_layout_gathers_each_slot_from_its_group(instance, reference) -> None:
    _, _, (kda, conv), _ = reference
    instance.generate(PROMPTS, NEW)
    g_kda, g_conv = instance.gathered_state(range(len(PROMPTS)))
    torch.testing.assert_close(g_kda, kda, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(g_conv, conv, rtol=1e-4, atol=1e-5)


def test_an_idle_group_joins_the_expert_exchange(instance, reference) -> None:
    # one prompt in slot 0: group 1 has no sequence in any forward
    toks, _ = instance.generate(PROMPTS[1:2], NEW)
    assert toks == reference[3]


def test_an_engine_over_the_groups_answers_as_over_one_process(instance) -> None:
    r = RankRunner(InstanceSpec(num_snapshots=8))
    ec = EngineConfig(block_size=16, num_pages=64, num_slots=8, num_snapshots=8)
    want = engine_rounds(LLMEngine(r.model, r.cfg, None, ec, runner=r), ROUNDS, NEW)
    assert want[1][0][1] == 32  # the second round's first request hit A's 32 cached tokens
    assert len(want[2][0][0]) == 2
    assert instance.engine_rounds(ROUNDS, NEW) == want
