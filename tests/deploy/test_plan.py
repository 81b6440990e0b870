"""deploy/plan.py and `k3serve plan`: the K3 figures equal DESIGN's numbers (written here as
literals, not recomputed), configs that cannot fit are refused with the instance and the
shortfall named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.config import load_deploy_config, parse_deploy_config
from deploy.plan import PlanError, make_plan

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "deploy" / "configs"


def _doc(**pool_changes) -> dict:
    """supernode-64.yaml as a dict, with ``pools.decode`` fields changed."""
    import yaml

    doc = yaml.safe_load((CONFIGS / "supernode-64.yaml").read_text())
    doc["pools"]["decode"].update(pool_changes)
    return doc


def test_k3_figures_equal_design():
    plan = make_plan(load_deploy_config(CONFIGS / "supernode-64.yaml"))
    # DESIGN §7: ~1.6 TB with MXFP4 experts (0.53 B/param) + bf16 rest; ~5.6 TB all bf16
    assert 1.55e12 <= plan.weights_total <= 1.60e12
    assert 5.5e12 <= plan.weights_total_bf16 <= 5.6e12
    # DESIGN §2: 69 layers × 96 heads × 128² × 4 B = 434 110 464 B recurrent (≈ 414 MiB)
    # + 69 × 3 × (3 × 96 × 128) × 2 B = 15 261 696 B conv (14.6 MiB) → ≈ 429 MiB
    assert plan.kda_state_bytes_per_seq == 449_372_160
    # DESIGN §2: 24 layers × 576 × 2 B = 27 KiB per token
    assert plan.mla_latent_bytes_per_token == 27_648
    # one 8 × 141 GB node holds 1.128 TB < 1.6 TB: every K3 instance spans two whole nodes
    assert all(i.nodes == 2 and i.ranks == 16 and i.ranks_per_node == 8 for i in plan.instances)
    assert [i.name for i in plan.instances] == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    i = plan.instances[0]
    # experts 2.7227e12 params × 17/32 B / 16 ranks ≈ 90.4 GB + the rest at bf16 / 8 and the
    # replicated router gates: ≈ 105.6 GB per rank of 126.9 GB usable (141 GB × 0.9)
    assert 104e9 < i.weights_per_rank < 107e9
    assert i.usable_per_rank == 126_900_000_000
    assert i.kda_slot_bytes_per_rank == 449_372_160 // 8  # heads split over tp = 8
    # MLA latents are replicated under head TP: every rank stores the full 27 KiB per token
    left = i.cache_per_rank - (16 + 64) * (449_372_160 // 8)
    assert i.mla_tokens_per_rank == left // 27_648
    assert i.mla_tokens_per_rank > 262_144


def test_local_cpu_plan_sizes_the_tiny_workers():
    plan = make_plan(load_deploy_config(CONFIGS / "local-cpu.yaml"))
    assert [i.name for i in plan.instances] == ["prefill-0", "prefill-1", "decode-0"]
    assert all(i.ranks == 1 and i.num_pages >= 16_384 // 64 for i in plan.instances)


def test_k3_on_one_node_is_refused_naming_the_weights_shortfall():
    with pytest.raises(PlanError, match=r"decode-0: weights need .* per rank \(tp 8, ep 8\) "
                                        r"but 126.9 GB are usable; short by"):
        make_plan(parse_deploy_config(_doc(ep=8), "one-node"))


def test_too_big_a_minimum_cache_is_refused_naming_the_shortfall():
    with pytest.raises(PlanError, match=r"decode-0: minimum cache .* short by [0-9.]+ GB"):
        make_plan(parse_deploy_config(_doc(num_slots=512), "many-slots"))


def test_more_instances_than_accelerators_is_refused():
    with pytest.raises(PlanError, match=r"need 80 accelerators, the cluster has 64; short by 16"):
        make_plan(parse_deploy_config(_doc(instances=3), "too-many"))


@pytest.mark.parametrize("change,field", [
    ({"tp": 3}, "pools.decode.ep"),  # ep 16 not a multiple of tp 3
    ({"placement": "diagonal"}, "pools.decode.placement"),
    ({"instances": 0}, "pools.decode.instances"),
    ({"colour": "red"}, "pools.decode"),
])
def test_bad_fields_are_named(change, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        parse_deploy_config(_doc(**change))


def test_cli_plan_prints_and_writes_json_and_refuses(tmp_path):
    out = tmp_path / "plan.json"
    env = {"PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "cli", "plan", "--config",
                        str(CONFIGS / "supernode-64.yaml"), "--json", str(out)],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=60,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert "prefill-0" in r.stdout and "1,559.9 GB" in r.stdout
    assert json.loads(out.read_text())["kda_state_bytes_per_seq"] == 449_372_160
    import yaml

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_doc(ep=8)))
    r = subprocess.run([sys.executable, "-m", "cli", "plan", "--config", str(bad)],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=60,
                       check=False)
    assert r.returncode == 1 and "refused: decode-0: weights need" in r.stderr
