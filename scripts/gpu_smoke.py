"""One-GPU smoke run of the serving engine on ``k3-mini`` (random weights, bf16, Triton kernels).

Measures, in one process (no disaggregation): TTFT of one prompt (``max_tokens=1``) and the
mean inter-token latency of 32 more greedy tokens, for each prompt length given. Prints one
line per length. Not part of the test suite (needs CUDA).

Run: ``PYTHONPATH=. python scripts/gpu_smoke.py --lengths 8192 32768``.
"""

from __future__ import annotations

import argparse
import time

import torch

from k3serve import LLM, SamplingParams


class _IdsOnly:
    """k3-mini has no tokenizer of its own: token ids in, no text out."""

    vocab_size = 32768
    eos_token_id = 2
    bos_token_id = 1
    special_token_ids = ()

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        raise ValueError("prompts are token ids here")

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    _sync()
    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                ignore_eos=True))[0]
    _sync()
    return time.perf_counter() - t0, list(out.token_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="k3-mini")
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192])
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.device != "cpu":  # build the random weights on the GPU (a CPU init of 4 B params is slow)
        torch.set_default_device(args.device)
    longest = max(args.lengths) + args.decode_tokens + 64
    llm = LLM(args.model, load_weights=False, dtype=torch.bfloat16 if args.device != "cpu" else torch.float32,
              device=args.device,
              tokenizer=_IdsOnly() if args.model == "k3-mini" else None,
              enable_prefix_caching=False, num_slots=4, num_snapshots=2,
              num_pages=2 * (longest // 64 + 1), max_num_batched_tokens=max(args.lengths),
              max_model_len=longest)
    torch.set_default_device("cpu")
    where = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    print(f"init {time.perf_counter() - t0:.1f} s on {where}", flush=True)
    vocab = llm.engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    warm = min(256, min(args.lengths))
    _timed(llm, torch.randint(3, vocab, (warm,), generator=gen).tolist(), 4)  # warm-up, compile
    print(f"{'prompt':>8} {'TTFT s':>8} {'ITL ms':>8} {'tokens':>6}", flush=True)
    for n in args.lengths:
        prompt = torch.randint(3, vocab, (n,), generator=gen).tolist()
        ttft, _ = _timed(llm, prompt, 1)
        total, toks = _timed(llm, prompt, 1 + args.decode_tokens)
        itl = (total - ttft) / args.decode_tokens
        print(f"{n:8d} {ttft:8.3f} {itl * 1e3:8.2f} {len(toks):6d}", flush=True)


if __name__ == "__main__":
    main()
