"""Train the embedded ``k3-tiny`` checkpoint on the Python standard library's own ``.py`` files.

Data (:mod:`stdlib_data`): every stdlib file of the machine's Python except the committed
held-out list and a small validation set, each prefixed with ``<|bos|>`` and concatenated into
one byte stream. The validation set (``--val-files``, default 24) is taken from the training
files deterministically (2–30 KB files with the smallest ``sha256("val:" + path)``) and removed
from training; every ``--val-every`` seconds its bits per byte are measured (the windows of
:mod:`eval_bpb`) and the weights with the best validation figure are the ones saved. The
held-out files are never looked at during training. A batch is
``B`` windows of ``T + 1`` tokens: with probability ``--file-start-frac`` a window starts at a
random file's ``<|bos|>`` (so the model learns how files begin, as evaluation starts every file
fresh), otherwise at a uniformly random offset. Loss: next-token cross-entropy on every position.

Model: ``K3ForCausalLM(k3-tiny)`` with every K3 feature on (KDA + gated MLA, latent MoE with
SiTU-GLU, Block AttnRes), float32 master weights, ``forward_train`` under bf16 autocast on CUDA
(float32 on CPU).

Optimisation: AdamW (β = 0.9, 0.95; weight decay on matrices only), linear warmup then a cosine
decay to ``--min-lr-frac`` of the peak, driven by elapsed time over the ``--minutes`` budget
(the step count is not known in advance); gradient clipping. The MoE routers get DeepSeek-V3's
auxiliary-loss-free balancing (arXiv 2412.19437 §2.1.2): after each step every layer's
``e_score_correction_bias`` moves by ``--bias-update-rate`` towards under-loaded experts
(``b_e += γ · sign(mean load − load_e)``); it is frozen at serving time, as K3's bias is.

Output (``--out``): ``k3serve_config.json`` + ``model.safetensors`` in bf16 with the published
K3 tensor names (``k3serve.model.checkpoint_save.save_checkpoint``; tensors K3 keeps in float32 stay
float32), plus ``training.json`` (steps, tokens, time, loss and validation curves, data sizes).
Should that module fail to import or to save, the state dict is written under our module names
(same dtypes), which :func:`eval_bpb.load_model` also reads, so a one-shot GPU run never
ends without weights.

Usage::

    python scripts/train_tiny.py --device cuda --minutes 6.5 --out k3serve/assets/k3-tiny
    python scripts/train_tiny.py --device cpu --minutes 0.3 --batch-size 2 --seq-len 128 --out /tmp/t
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import eval_bpb
import stdlib_data

from k3serve.config import PRESETS, ModelConfig
from k3serve.model.model import K3ForCausalLM
from k3serve.model.moe import Router

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "k3serve_config.json"
MAX_CHECKPOINT_BYTES = 16 * 2**20


# ---------------------------------------------------------------------------- data
class ByteStream:
    """All training files as one ``int16`` token stream, ``<|bos|>`` before each file
    (empty files, e.g. many ``__init__.py``, are skipped).

    Args:
        files: raw bytes of each file, in order.
        bos: the bos id.
    """

    def __init__(self, files: list[bytes], bos: int) -> None:
        parts, starts, pos = [], [], 0
        for data in files:
            if not data:
                continue
            starts.append(pos)
            parts.append(torch.tensor([bos], dtype=torch.int16))
            parts.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16))
            pos += len(data) + 1
        self.tokens = torch.cat(parts)
        self.file_starts = torch.tensor(starts, dtype=torch.long)
        self.num_files = len(starts)

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def batch(self, gen: torch.Generator, batch_size: int, seq_len: int,
              file_start_frac: float) -> torch.Tensor:
        """``[B, T + 1]`` int64 windows (module docstring). Needs ``len(self) > T + 1``."""
        span = seq_len + 1
        hi = len(self) - span
        starts = torch.randint(0, hi + 1, (batch_size,), generator=gen)
        at_file = torch.rand(batch_size, generator=gen) < file_start_frac
        if at_file.any():
            pick = torch.randint(0, self.num_files, (int(at_file.sum()),), generator=gen)
            starts[at_file] = self.file_starts[pick].clamp(max=hi)
        idx = starts[:, None] + torch.arange(span)[None, :]
        return self.tokens[idx].long()


# ---------------------------------------------------------------------------- model helpers
class RouterLoad:
    """Counts tokens per expert in every MoE router (forward hooks) for bias balancing."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.counts = [torch.zeros(r.cfg.n_routed_experts) for r in self.routers]
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(mod: Router, args, out) -> None:
            idx = out[1]
            c = torch.bincount(idx.reshape(-1), minlength=mod.cfg.n_routed_experts)
            if self.counts[i].device != c.device:
                self.counts[i] = self.counts[i].to(c.device)
            self.counts[i] += c.float()
        return hook

    @torch.no_grad()
    def update_biases(self, rate: float) -> float:
        """``b_e += rate · sign(mean − load_e)`` per router; resets the counts.

        Returns:
            The worst max/mean load ratio over the routers since the last update.
        """
        worst = 0.0
        for r, c in zip(self.routers, self.counts):
            mean = c.mean()
            if mean > 0:
                worst = max(worst, float(c.max() / mean))
                r.e_score_correction_bias += rate * torch.sign(mean - c).to(r.e_score_correction_bias)
            c.zero_()
        return worst


def choose_val_files(rels: list[str], sizes: dict[str, int], n: int) -> list[str]:
    """``n`` validation files: 2–30 KB, smallest ``sha256("val:" + path)`` (module docstring)."""
    import hashlib

    cands = [r for r in rels if 2000 <= sizes[r] <= 30000]
    cands.sort(key=lambda r: hashlib.sha256(("val:" + r).encode()).hexdigest())
    return sorted(cands[:n])


@torch.no_grad()
def val_bpb(model: K3ForCausalLM, files: dict[str, bytes], amp: bool) -> float:
    """Size-weighted bits per byte of ``files`` (eval_bpb windows), model left in train mode."""
    model.eval()
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            bits = eval_bpb.score_files(model, files, batch_size=32)
    finally:
        model.train()
    return sum(bits.values()) / sum(len(d) for d in files.values())


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay on trainable tensors with ≥ 2 dims, none on the rest."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, progress: float, peak: float, warmup: int, min_frac: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from ``peak`` to ``min_frac · peak``
    as ``progress`` (elapsed / budget) goes 0 → 1."""
    warm = min(1.0, (step + 1) / max(1, warmup))
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))
    return peak * warm * (min_frac + (1.0 - min_frac) * cos)


def checkpoint_state(model: K3ForCausalLM, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """State dict cast as ``K3ForCausalLM(cfg, dtype)`` stores it (float32-only tensors kept),
    contiguous, on CPU."""
    with torch.device("meta"):
        ref = K3ForCausalLM(model.cfg, dtype=dtype).state_dict()
    out = {}
    for k, v in model.state_dict().items():
        out[k] = v.detach().to("cpu", ref[k].dtype).contiguous()
    return out


def save_tiny_checkpoint(model: K3ForCausalLM, out_dir: Path, meta: dict) -> Path:
    """Write the checkpoint folder (module docstring). Returns the weights file.

    Raises:
        ValueError: the weights exceed 16 MiB.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        from k3serve.model.checkpoint_save import save_checkpoint  # type: ignore[attr-defined]
    except ImportError:
        save_checkpoint = None
    weights = out_dir / WEIGHTS_FILE
    saved = False
    if save_checkpoint is not None:
        try:
            save_checkpoint(model, out_dir, model.cfg, dtype=torch.bfloat16)
            saved = weights.exists() and (out_dir / CONFIG_FILE).exists()
        except Exception as e:  # noqa: BLE001 - a one-shot GPU run must still leave weights
            print(f"save_checkpoint failed ({e!r}); writing our state-dict names directly",
                  file=sys.stderr)
    if not saved:
        from safetensors.torch import save_file

        sd = checkpoint_state(model)
        save_file(sd, str(weights), metadata={"format": "pt", "model": model.cfg.name})
        (out_dir / CONFIG_FILE).write_text(
            json.dumps(model.cfg.replace(dtype="bfloat16").to_dict(), indent=2) + "\n")
    (out_dir / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    size = weights.stat().st_size
    if size > MAX_CHECKPOINT_BYTES:
        raise ValueError(f"checkpoint {weights} is {size} bytes > 16 MiB")
    return weights


# ---------------------------------------------------------------------------- training
def train(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    cfg: ModelConfig = PRESETS[args.preset]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    rels = stdlib_data.training_files(args.stdlib)
    heldout = set(stdlib_data.load_heldout_list())
    if heldout & set(rels):
        raise RuntimeError("held-out files in the training set")
    blobs = dict(zip(rels, stdlib_data.read_files(args.stdlib, rels)))
    val_rels = choose_val_files(rels, {r: len(b) for r, b in blobs.items()}, args.val_files)
    val = {r: blobs.pop(r) for r in val_rels}
    rels = list(blobs)
    stream = ByteStream(list(blobs.values()), cfg.bos_token_id)
    print(f"data: {len(rels)} stdlib files, {len(stream):,} tokens; validation {len(val)} files, "
          f"{sum(map(len, val.values())):,} bytes; held out {len(heldout)} files (never read) "
          f"from {args.stdlib or stdlib_data.stdlib_root()}", flush=True)

    model = K3ForCausalLM(cfg, dtype=torch.float32).to(device)
    model.train()
    print(f"model: {cfg.name}, {model.num_params():,} parameters, device {device}", flush=True)
    loads = RouterLoad(model)
    use_fused = device.type == "cuda"
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr,
                            betas=(0.9, 0.95), eps=1e-8, fused=use_fused)
    gen = torch.Generator().manual_seed(args.seed)
    amp = device.type == "cuda"
    budget = args.minutes * 60.0
    B, T, accum = args.batch_size, args.seq_len, 1

    from tqdm import tqdm

    bar = tqdm(total=round(budget), unit="s", desc="train", dynamic_ncols=True,
               mininterval=2.0, file=sys.stdout)
    t0 = time.time()
    step, tokens, ema, losses, skipped = 0, 0, None, [], 0
    last_tick, last_val = 0.0, 0.0
    best: dict = {"bpb": math.inf, "step": 0, "state": None}
    vals: list[dict] = []

    def validate() -> None:
        if not val:
            return
        v = val_bpb(model, val, amp)
        for c in loads.counts:  # validation tokens must not steer the router biases
            c.zero_()
        vals.append({"step": step, "seconds": round(time.time() - t0, 1), "val_bpb": round(v, 4)})
        tqdm.write(f"step {step}: validation {v:.4f} bits/byte")
        if v < best["bpb"]:
            best.update(bpb=v, step=step,
                        state={k: t.detach().to("cpu", copy=True) for k, t in model.state_dict().items()})

    while True:
        elapsed = time.time() - t0
        if elapsed >= budget or (args.max_steps and step >= args.max_steps):
            break
        if step and elapsed - last_val >= args.val_every:
            last_val = elapsed
            validate()
        lr = lr_at(step, elapsed / budget, args.lr, args.warmup_steps, args.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        try:
            opt.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for _ in range(accum):
                batch = stream.batch(gen, B // accum, T, args.file_start_frac).to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                    logits = model.forward_train(batch[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                       batch[:, 1:].reshape(-1))
                (loss / accum).backward()
                loss_sum += float(loss.detach()) / accum
        except torch.cuda.OutOfMemoryError:
            if B // accum <= 1:
                raise
            accum *= 2
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            print(f"out of memory: micro-batch {B // accum} × {accum} accumulation", flush=True)
            continue
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip))
        if not (math.isfinite(loss_sum) and math.isfinite(gnorm)):
            # A bad batch must not end a one-shot run: skip the update; give up after many.
            skipped += 1
            loads.update_biases(0.0)
            tqdm.write(f"step {step}: non-finite loss {loss_sum} / grad norm {gnorm}: update skipped")
            if skipped > args.max_skipped:
                tqdm.write("too many non-finite steps: stopping early")
                break
            continue
        opt.step()
        imbalance = loads.update_biases(args.bias_update_rate)
        step += 1
        tokens += B * T
        ema = loss_sum if ema is None else 0.98 * ema + 0.02 * loss_sum
        if step % args.log_every == 0 or step == 1:
            losses.append({"step": step, "seconds": round(time.time() - t0, 1), "loss": round(loss_sum, 4),
                           "bpb_ema": round(ema / math.log(2), 4), "lr": lr, "grad_norm": round(gnorm, 3),
                           "moe_max_over_mean": round(imbalance, 3)})
        now = time.time() - t0
        bar.update(max(0, min(round(budget), round(now)) - bar.n))
        if now - last_tick >= 2.0 or step == 1:
            last_tick = now
            bar.set_postfix(step=step, bpb=f"{ema / math.log(2):.3f}", lr=f"{lr:.2e}",
                            tok_s=f"{tokens / max(now, 1e-9):,.0f}", moe=f"{imbalance:.2f}", refresh=False)
    bar.close()
    seconds = time.time() - t0
    validate()
    if best["state"] is not None and best["step"] != step:
        print(f"restoring the best validation weights (step {best['step']}, "
              f"{best['bpb']:.4f} bits/byte)", flush=True)
        model.load_state_dict(best["state"])
    final_bpb = None if ema is None else ema / math.log(2)
    meta = {
        "preset": cfg.name,
        "num_params": model.num_params(),
        "steps": step,
        "tokens": tokens,
        "seconds": round(seconds, 1),
        "batch_size": B,
        "seq_len": T,
        "micro_batches": accum,
        "peak_lr": args.lr,
        "train_bpb_ema": None if final_bpb is None else round(final_bpb, 4),
        "skipped_steps": skipped,
        "val_files": len(val),
        "val_bytes": sum(map(len, val.values())),
        "best_val_bpb": None if not vals else round(best["bpb"], 4),
        "best_val_step": best["step"],
        "val_log": vals,
        "train_files": len(rels),
        "train_tokens_per_epoch": len(stream),
        "epochs": round(tokens / len(stream), 2),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "max_cuda_memory_gib": (round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
                                if device.type == "cuda" else None),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "seed": args.seed,
        "log": losses,
    }
    print(f"trained {step} steps, {tokens:,} tokens ({meta['epochs']} epochs) in {seconds:.0f} s; "
          f"train bits/byte (EMA) {final_bpb}", flush=True)
    weights = save_tiny_checkpoint(model, Path(args.out), meta)
    print(f"wrote {weights} ({weights.stat().st_size / 2**20:.2f} MiB)", flush=True)
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--minutes", type=float, default=6.5, help="training time budget")
    ap.add_argument("--max-steps", type=int, default=0, help="stop earlier after this many steps (0: no limit)")
    ap.add_argument("--out", type=Path, default=REPO / "k3serve" / "assets" / "k3-tiny")
    ap.add_argument("--preset", default="k3-tiny", choices=sorted(PRESETS))
    ap.add_argument("--stdlib", type=Path, default=None, help="stdlib folder (default: this Python's)")
    ap.add_argument("--batch-size", type=int, default=64,
                    help="sequences per step (halved into micro-batches on CUDA out-of-memory)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--bias-update-rate", type=float, default=2e-3)
    ap.add_argument("--file-start-frac", type=float, default=0.2)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--val-files", type=int, default=24, help="validation files (0: none)")
    ap.add_argument("--val-every", type=float, default=60.0, help="seconds between validations")
    ap.add_argument("--max-skipped", type=int, default=20, help="non-finite steps tolerated")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    # Training and validation run the plain-torch kernels (the reference path, the one the CPU
    # runs): the chunked-KDA Triton kernel is forward-only, and under bf16 autocast the
    # no-grad validation would hand it q/k in float32 with v in bf16, which it rejects.
    os.environ.setdefault("K3SERVE_KERNELS", "torch")
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
