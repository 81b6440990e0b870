"""Held-out bits per byte: the scoring code, the data split, and the embedded checkpoint vs xz.

The last test is the one the README's figure rests on: the committed ``k3-tiny`` checkpoint
must compress the committed held-out sample (files it never trained on) below ``xz -9e``.
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import eval_bpb
import stdlib_data
import xz_baseline

from k3serve.config import PRESETS

ASSET = REPO / "k3serve" / "assets" / "k3-tiny"
SAMPLE = REPO / "tests" / "data" / "heldout_sample"


# ---------------------------------------------------------------------------- windows
@pytest.mark.parametrize("window,stride", [(4, 1), (4, 3), (8, 5), (1024, 768), (16, 8)])
@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 100, 2500])
def test_windows_charge_every_byte_once_with_context(n: int, window: int, stride: int) -> None:
    wins = eval_bpb.make_windows(n, window, stride)
    targets = [t for _, first, end in wins for t in range(first, end)]
    assert targets == list(range(1, n + 1))  # each byte once, in order
    for i, (start, first, end) in enumerate(wins):
        assert 0 <= start < first <= end <= n + 1 and end - start <= window
        if i:  # later windows keep at least window - stride tokens of context
            assert first - start >= window - stride or start == 0


def test_windows_reject_bad_stride() -> None:
    for stride in (0, 8, 9):
        with pytest.raises(ValueError, match="stride"):
            eval_bpb.make_windows(10, 8, stride)


# ---------------------------------------------------------------------------- scoring
@pytest.fixture(scope="module")
def random_model():
    from k3serve.model.model import K3ForCausalLM

    torch.manual_seed(0)
    return K3ForCausalLM(PRESETS["k3-tiny"]).eval()


def test_score_matches_direct_log_probs_and_is_batch_invariant(random_model) -> None:
    files = {"a": b"def f(x):\n    return x\n", "b": "é = 'ü'  # 🐍\n".encode(), "c": b"x"}
    bits = eval_bpb.score_files(random_model, files, window=64, stride=32, batch_size=2)
    for name, data in files.items():
        ids = torch.tensor([[256, *data]])
        with torch.no_grad():
            logp = F.log_softmax(random_model.forward_train(ids).float(), -1)[0]
        direct = -sum(float(logp[i, data[i]]) for i in range(len(data))) / math.log(2)
        assert bits[name] == pytest.approx(direct, rel=1e-5)
    # Batching and padding (files of different lengths in one forward) change nothing.
    alone = {n: eval_bpb.score_files(random_model, {n: d}, window=64, stride=32, batch_size=1)[n]
             for n, d in files.items()}
    for n in files:
        assert bits[n] == pytest.approx(alone[n], rel=1e-5)
    # An untrained model is near uniform over 272 ids: ~8.09 bits per byte.
    total = sum(bits.values()) / sum(len(d) for d in files.values())
    assert 7.0 < total < 9.5


def test_windowed_scoring_only_loses_context(random_model) -> None:
    data = bytes(range(32, 127)) * 2  # 190 bytes
    full = eval_bpb.score_files(random_model, {"f": data}, window=256, stride=128)["f"]
    win = eval_bpb.score_files(random_model, {"f": data}, window=64, stride=48)["f"]
    # Same first window; later bytes conditioned on less context: different, same scale.
    assert win != pytest.approx(full, rel=1e-9)
    assert win == pytest.approx(full, rel=0.2)


# ---------------------------------------------------------------------------- data split
def test_heldout_list_is_fixed_and_disjoint_from_training() -> None:
    held = stdlib_data.load_heldout_list()
    assert len(held) == 40 and len(set(held)) == 40 and held == sorted(held)
    for rel in held:
        assert not rel.startswith(stdlib_data.NEVER_HELD_OUT), rel
        assert not set(rel.split("/")[:-1]) & stdlib_data.EXCLUDED_DIRS, rel
    root = stdlib_data.stdlib_root()
    files = stdlib_data.list_stdlib_files(root)
    assert files == sorted(files) and len(files) > 300
    assert all(p.endswith(".py") for p in files)
    assert not any(set(p.split("/")[:-1]) & stdlib_data.EXCLUDED_DIRS for p in files)
    train = stdlib_data.training_files(root)
    assert not set(train) & set(held)
    assert set(held) <= set(files), f"held-out files missing here: {sorted(set(held) - set(files))}"
    assert len(train) == len(files) - len(held)


def test_sample_is_a_copy_of_heldout_files() -> None:
    held = set(stdlib_data.load_heldout_list())
    names = sorted(p.name for p in SAMPLE.iterdir())
    assert 3 <= len(names) <= 5
    assert sum(p.stat().st_size for p in SAMPLE.iterdir()) <= 100_000
    by_name = {stdlib_data.sample_name(r): r for r in held}
    root = stdlib_data.stdlib_root()
    for name in names:
        assert name in by_name, f"{name} is not a held-out file"
        local = root / by_name[name]
        if local.exists():
            assert (SAMPLE / name).read_bytes() == local.read_bytes()


def test_xz_baseline_matches_the_xz_program() -> None:
    files = xz_baseline.load_eval_files(SAMPLE)
    per, mean = xz_baseline.xz_bits_per_byte(files)
    assert 2.0 < mean < 4.0  # small source files: xz has no context to exploit
    assert min(per.values()) <= mean <= max(per.values())
    if shutil.which("xz") is None:
        pytest.skip("no xz program to compare with")
    for name in files:
        assert xz_baseline.xz_cli_size(SAMPLE / name) == xz_baseline.xz_size(files[name])


# ---------------------------------------------------------------------------- the checkpoint
@pytest.mark.skipif(not (ASSET / "k3serve_config.json").exists(),
                    reason="embedded checkpoint k3serve/assets/k3-tiny not present")
def test_embedded_checkpoint_beats_xz_on_heldout_sample() -> None:
    weights = ASSET / eval_bpb.WEIGHTS_FILE
    assert weights.stat().st_size <= 16 * 2**20
    model = eval_bpb.load_model(ASSET, "cpu")
    cfg = model.cfg
    assert cfg.vocab_size == 272 and cfg.attn_res_block_layers and cfg.moe_latent_size
    assert cfg.mla_layers and cfg.kda_gate_lower_bound == -5.0 and cfg.hidden_act == "situ"
    files = xz_baseline.load_eval_files(SAMPLE)
    bits = eval_bpb.score_files(model, files)
    rep = eval_bpb.report(bits, files)
    eval_bpb.print_table(rep)
    assert rep["model_bpb"] < rep["xz_bpb"], rep
    for row in rep["files"]:
        assert row["model_bpb"] < row["xz_bpb"], row
