"""Held-out bits per byte of a checkpoint, per file, beside ``xz -9e`` on the same files.

Scoring (each file from a fresh start, independently of every other file):

* the file's bytes ``x_1 … x_n`` are the token ids; the model sees ``<|bos|> x_1 … x_n``
  and the cost of byte ``x_i`` is ``−log2 p(x_i | <|bos|>, x_1 … x_{i−1})`` (so the first byte
  is conditioned on bos alone; nothing is charged for the end of the file);
* a file longer than one window is scored in overlapping windows of ``window`` tokens taken
  every ``stride`` tokens, all starting from zero state (``forward_train``): the first window
  scores all its positions, each later one only the bytes the previous windows did not score,
  so every byte is charged exactly once and sees at least ``window − stride`` bytes of context.
  Each window's probabilities depend only on earlier bytes of the same file, so the sum is a
  real code length (an arithmetic coder driven by the same windows achieves it to within a
  few bytes);
* file bits per byte = ``Σ bits / n``; the figure over a set is size-weighted
  (``Σ bits / Σ n``), the same weighting as :mod:`xz_baseline`.

Windows of all files are batched (padded at the end with ``<|pad|>`` to the longest window of
the batch: the model is causal, so padding after a position cannot change it).

The model computes in float32 from the checkpoint's weights (TF32 off), so the figure is that
of the shipped bf16 checkpoint as the CPU runs it. The README figure was computed on the H200
with ``K3SERVE_KERNELS=torch`` (the CPU's kernels; ``scripts/device_train.sh``); the committed
sample's figures agree with the CPU's to 3 decimals.

Usage::

    python scripts/eval_bpb.py --model k3serve/assets/k3-tiny            # held-out list
    python scripts/eval_bpb.py --model DIR --dir tests/data/heldout_sample --device cpu
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import xz_baseline

from k3serve.model.checkpoint import load_model as load_checkpoint_model
from k3serve.model.model import K3ForCausalLM

DEFAULT_WINDOW = 1024
DEFAULT_STRIDE = 768
WEIGHTS_FILE = "model.safetensors"


def load_model(folder: str | Path, device: str | torch.device = "cpu") -> K3ForCausalLM:
    """A float32 :class:`K3ForCausalLM` from a checkpoint folder, in eval mode: the project's
    one loader, :func:`k3serve.model.checkpoint.load_model` (published K3 names, strict).

    Raises:
        FileNotFoundError: the folder holds no safetensors.
        ValueError: the folder has no config; ``CheckpointError`` (a ValueError) listing
            missing / unexpected / mis-shaped tensors.
    """
    return load_checkpoint_model(Path(folder), device, torch.float32).model  # type: ignore[return-value]


def make_windows(n_bytes: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """Windows over the token sequence ``[bos] + bytes`` (length ``n_bytes + 1``).

    Returns:
        ``[(start, first_target, end)]``: the window feeds tokens ``[start, end)`` and charges
        the targets ``first_target .. end-1`` (token indices; target ``j`` is byte ``j``,
        predicted from the logits at position ``j - 1``). Targets ``1..n_bytes`` are covered
        exactly once, in order.

    Raises:
        ValueError: ``stride`` not in ``[1, window - 1]`` (a window needs ≥ 1 token of context).
    """
    if not 1 <= stride < window:
        raise ValueError(f"stride must lie in [1, window-1={window - 1}], got {stride}")
    total = n_bytes + 1
    out: list[tuple[int, int, int]] = []
    start, done = 0, 0  # done: last target charged so far
    while done < n_bytes:
        end = min(start + window, total)
        out.append((start, done + 1, end))
        done = end - 1
        start += stride
    return out


@torch.no_grad()
def score_files(
    model: K3ForCausalLM,
    files: dict[str, bytes],
    window: int = DEFAULT_WINDOW,
    stride: int = DEFAULT_STRIDE,
    batch_size: int = 16,
    bos_id: int | None = None,
    pad_id: int | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """Total bits of each file under ``model`` (module docstring).

    Args:
        model: a causal LM with ``forward_train([B, T]) -> [B, T, V]``, byte vocabulary.
        files: name → raw bytes.
        window, stride: window length and step, in tokens.
        batch_size: windows per forward.
        bos_id, pad_id: default ``model.cfg``'s.
        progress: show a tqdm bar.

    Returns:
        name → total bits (divide by ``len(bytes)`` for bits per byte).
    """
    cfg = model.cfg
    bos = cfg.bos_token_id if bos_id is None else bos_id
    pad = cfg.pad_token_id if pad_id is None else pad_id
    if bos is None or pad is None:
        raise ValueError("score_files: the model config names no bos/pad token")
    device = next(model.parameters()).device
    jobs = []  # (name, tokens [window] (padded), first_target_local, n_targets)
    for name, data in files.items():
        toks = torch.tensor([bos, *data], dtype=torch.long)
        for start, first, end in make_windows(len(data), window, stride):
            jobs.append((name, toks[start:end], first - start, end - first))
    bits = {name: 0.0 for name in files}
    it = range(0, len(jobs), batch_size)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="scoring", unit="batch")
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for b0 in it:
            chunk = jobs[b0 : b0 + batch_size]
            width = max(len(j[1]) for j in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            for row, j in enumerate(chunk):
                ids[row, : len(j[1])] = j[1]
            ids = ids.to(device)
            logp = F.log_softmax(model.forward_train(ids).float(), dim=-1)  # [B, W, V]
            for row, (name, w, first, n) in enumerate(chunk):
                pos = torch.arange(first - 1, first - 1 + n, device=device)
                tgt = ids[row, first : first + n]
                bits[name] += float(-logp[row, pos, tgt].sum()) / math.log(2)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return bits


def report(model_bits: dict[str, float], files: dict[str, bytes]) -> dict[str, object]:
    """Per-file and size-weighted bits/byte of the model and of ``xz -9e``, as a dict."""
    xz_per, xz_mean = xz_baseline.xz_bits_per_byte(files)
    rows = []
    for name, data in files.items():
        rows.append({"file": name, "bytes": len(data),
                     "model_bpb": model_bits[name] / len(data), "xz_bpb": xz_per[name]})
    total = sum(len(d) for d in files.values())
    return {
        "files": rows,
        "num_files": len(files),
        "num_bytes": total,
        "model_bpb": sum(model_bits.values()) / total,
        "xz_bpb": xz_mean,
    }


def print_table(rep: dict[str, object], out=sys.stdout) -> None:
    """The per-file table and the size-weighted means."""
    print(f"{'file':<40} {'bytes':>8} {'model':>7} {'xz -9e':>7}", file=out)
    for r in rep["files"]:  # type: ignore[union-attr]
        print(f"{r['file']:<40} {r['bytes']:>8} {r['model_bpb']:>7.3f} {r['xz_bpb']:>7.3f}", file=out)
    print(f"{'size-weighted (' + str(rep['num_files']) + ' files)':<40} {rep['num_bytes']:>8} "
          f"{rep['model_bpb']:>7.3f} {rep['xz_bpb']:>7.3f}   bits/byte", file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "k3serve" / "assets" / "k3-tiny")
    ap.add_argument("--dir", type=Path, default=None, help="score every file here instead")
    ap.add_argument("--stdlib", type=Path, default=None, help="stdlib folder for the held-out list")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    ap.add_argument("--stride", type=int, default=DEFAULT_STRIDE)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = ap.parse_args(argv)

    files = xz_baseline.load_eval_files(args.dir, args.stdlib)
    model = load_model(args.model, args.device)
    t0 = time.time()
    bits = score_files(model, files, args.window, args.stride, args.batch_size, progress=True)
    rep = report(bits, files)
    rep.update(window=args.window, stride=args.stride, seconds=time.time() - t0,
               model=str(args.model), python=sys.version.split()[0])
    print_table(rep)
    if args.json:
        args.json.write_text(json.dumps(rep, indent=2))
    return 0 if rep["model_bpb"] < rep["xz_bpb"] else 1


if __name__ == "__main__":
    sys.exit(main())
