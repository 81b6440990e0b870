"""Expert placement planner (deploy/experts.py): invariants, the committed Zipf-like
load figures of issue 16 (must-show 4), the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from deploy import experts as planner
from k3serve.parallel.expert_plan import LayerPlan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COUNTS = os.path.join(ROOT, "tests", "data", "expert_load_zipf_896x12.json")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_equal_slots_and_fractions() -> None:
    rng = np.random.default_rng(0)
    c = rng.zipf(1.5, 96).astype(float)
    p = planner.plan_layer(c, 8, 8)
    assert p.slots.shape == (8, 13)
    p.validate(96)  # every expert present, copies on distinct ranks, fractions sum to 1
    reps = np.bincount(p.slots.reshape(-1), minlength=96)
    assert reps.sum() == 104 and reps.min() == 1
    # the hottest expert got the most copies
    assert reps[int(np.argmax(c))] == reps.max() > 1
    # loads computed by hand agree
    loads = np.zeros(8)
    for r in range(8):
        for s in range(13):
            loads[r] += p.fractions[r, s] * c[p.slots[r, s]]
    np.testing.assert_allclose(p.loads(c), loads)
    assert abs(loads.sum() - c.sum()) < 1e-6 * c.sum()


def test_waterfill_split_is_min_max() -> None:
    # one expert of 10 tokens on 3 ranks whose other loads are 0, 2, 9: level 6 → [6, 4, 0]
    a = planner._waterfill(np.array([0.0, 2.0, 9.0]), 10.0)
    np.testing.assert_allclose(a, [6.0, 4.0, 0.0])


def test_bad_input_names_the_field() -> None:
    with pytest.raises(ValueError, match="redundant"):
        planner.plan_layer(np.ones(10), 4, 1)
    with pytest.raises(ValueError, match="counts"):
        planner.plan_layer(np.array([1.0, -1.0]), 2, 0)
    with pytest.raises(ValueError, match="ranks"):
        planner.plan_layer(np.ones(4), 0, 0)
    p = planner.plan_layer(np.arange(8.0), 4, 0)
    bad = LayerPlan(p.slots.copy(), p.fractions * 0.5)
    with pytest.raises(ValueError, match="fractions"):
        bad.validate(8)


def test_replan_respects_move_budget() -> None:
    rng = np.random.default_rng(3)
    c = rng.zipf(1.3, 64).astype(float)
    prev = planner.plan_layer(c, 8, 8)
    new = c[rng.permutation(64)]
    for m in (0, 1, 5):
        p, used = planner.replan_layer(new, prev, m)
        pairs_old = {(r, int(e)) for r in range(8) for e in prev.slots[r]}
        added = sum((r, int(e)) not in pairs_old for r in range(8) for e in p.slots[r])
        assert used == added <= m
        assert p.slots.shape == prev.slots.shape
    assert planner.replan_layer(new, prev, 5)[0].max_over_mean(new) < planner.balance_fractions(
        prev, new).max_over_mean(new)


def test_zipf_figures_of_issue_16() -> None:
    """Must-show 4 on the committed load (896 experts × 12 layers, 64 ranks)."""
    import expert_placement

    counts = planner.load_counts(COUNTS)
    assert len(counts) == 12 and all(len(c) == 896 for c in counts)
    r = expert_placement.run(counts, ranks=64, redundant=64, max_moves=32)
    assert max(r["r_fresh"]) <= 1.02  # R = 64, every layer
    for ours, lpt in zip(r["r0"], r["lpt"]):  # R = 0: never worse than LPT
        assert ours <= lpt + 1e-12
    assert max(r["shift_before"]) > 1.2  # the shift really unbalances the old plan
    assert max(r["shift_after"]) <= 1.10 and max(r["moves"]) <= 32


def test_cli_plan_and_replan(tmp_path) -> None:
    counts = tmp_path / "c.json"
    rng = np.random.default_rng(1)
    c = (rng.zipf(1.4, 32) * 10).tolist()
    counts.write_text(json.dumps([c, c[::-1]]))
    out = tmp_path / "p.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "cli", "experts", "plan", "--counts", str(counts),
           "--ranks", "4", "--redundant", "4"]
    res = subprocess.run(cmd + ["--json", str(out)], env=env, capture_output=True, text=True,
                         check=True)
    assert "before" in res.stdout and "after" in res.stdout
    plan = json.loads(out.read_text())
    assert len(plan["max_over_mean_after"]) == 2 and len(plan["layers"]) == 2
    assert np.array(plan["layers"][0]["slots"]).shape == (4, 9)
    assert all(a <= b + 1e-9 for a, b in zip(plan["max_over_mean_after"],
                                              plan["max_over_mean_before"]))
    out2 = tmp_path / "p2.json"
    counts.write_text(json.dumps([c[::-1], c]))
    subprocess.run(cmd + ["--previous", str(out), "--max-moves", "2", "--json", str(out2)],
                   env=env, capture_output=True, text=True, check=True)
    assert max(json.loads(out2.read_text())["moves"]) <= 2
    bad = subprocess.run(cmd[:-1] + ["3"], check=False, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "redundant" in bad.stderr
