"""k3-mini served disaggregated on one GPU through the HTTP API.

What it does, in one process that drives the others:

1. Writes a k3-mini checkpoint folder (``--folder``): the random init of
   ``benchmarks/gpu_e2e.py`` (seed 0, router spread, experts on the MXFP4 grid, stored packed)
   and a byte-level BPE tokenizer trained here on the repository's own Python sources with the
   ``tokenizers`` package (no hub download), padded with added tokens to the model's 32768 ids
   so that every id the model can emit decodes; ChatML markers are single ids.
2. Offline engine (``k3serve.LLM`` on that folder, the workers' engine defaults): greedy
   (temperature 0) answer to one chat conversation, rendered with the folder's tokenizer exactly
   as the router renders it.
3. ``deploy.launcher.start_stack(model=folder, device="cuda", 1 prefill + 1 decode)``: router
   and two worker processes on the same GPU; the cache moves between the two processes' GPU
   pools through Mooncake TE (tcp). The same conversation through ``/v1/chat/completions``
   (greedy, ``logprobs``): text and per-token strings must equal the offline engine's.
4. TTFT / ITL: ``--requests`` streamed chat completions, one at a time, distinct prompts of
   ~``--prompt-tokens`` tokens, ``--max-tokens`` each. TTFT = request sent → first chunk with
   text; ITL = median gap between later text chunks (one token each). Transfer GB/s: the prefill
   worker's ``k3serve:kv_transfer_bytes_total`` over its ``k3serve:kv_transfer_seconds`` sum
   (admission → every write confirmed) from ``/metrics``.

Writes ``OUT/gpu_serve.json`` and ``OUT/serve.md`` (``--out OUT``, default the current folder) and prints a summary last. Exits 0
without CUDA (says so).

Usage: ``python benchmarks/gpu_serve.py [--out DIR] [--folder DIR] [--requests 8]``
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import itertools
import json
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
QUESTION = "Write a Python function that returns the n-th Fibonacci number."


def log(*a) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def corpus() -> list[str]:
    texts = []
    for p in sorted(ROOT.glob("*/**/*.py")):
        if {".devcarry", ".venv"} & set(p.relative_to(ROOT).parts):
            continue
        try:
            texts.append(p.read_text())
        except (OSError, UnicodeError):
            pass
    return texts


def write_tokenizer(folder: Path, vocab: int) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    n = tok.get_vocab_size()
    if n < vocab:  # ids the model can emit must decode: plain added tokens fill the rest
        tok.add_tokens([AddedToken(f"<|fill{i}|>", normalized=False) for i in range(vocab - n)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>"}))
    log(f"tokenizer: BPE {n} learned ids, padded to {tok.get_vocab_size()}")


def write_checkpoint(folder: Path) -> None:
    import torch
    from gpu_e2e import build

    from k3serve.model.checkpoint_save import save_checkpoint

    folder.mkdir(parents=True, exist_ok=True)
    model, cfg, _ = build(on_gpu=True)
    # the router registers workers whose model name equals its --model (here the folder path)
    cfg = dataclasses.replace(cfg, name=str(folder))
    files = save_checkpoint(model, folder, cfg)
    log("checkpoint:", [f"{f.name} {f.stat().st_size / 1e9:.2f} GB" for f in files])
    write_tokenizer(folder, cfg.vocab_size)
    del model
    torch.cuda.empty_cache()


def messages(i: int, filler: str, prompt_tokens: int) -> list[dict]:
    if i < 0:
        return [{"role": "user", "content": QUESTION}]
    # distinct prompts (no prefix hits between requests): a numbered header first
    n_chars = prompt_tokens * 3
    start = (i * 7919) % max(1, len(filler) - n_chars)
    return [{"role": "system", "content": f"Request {i}. Summarise the code below."},
            {"role": "user", "content": filler[start:start + n_chars]}]


def offline(folder: Path, msgs: list[dict], max_tokens: int) -> dict:
    import torch

    from k3serve import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(str(folder), device="cuda", dtype=torch.bfloat16)
    log(f"offline engine up in {time.time() - t0:.1f} s")
    ids = list(llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.time()
    out = llm.generate([ids], sp)[0]
    dt = time.time() - t0
    toks = [llm.tokenizer.decode([t]) for t in out.token_ids]
    tbytes = [list(llm.tokenizer.decode_bytes([t], skip_special_tokens=False))
              for t in out.token_ids]
    res = {"prompt_tokens": len(ids), "token_ids": list(out.token_ids), "text": out.text,
           "tokens": toks, "token_bytes": tbytes, "finish_reason": out.finish_reason, "seconds_first_call": dt}
    del llm
    torch.cuda.empty_cache()
    return res


def metric(text: str, name: str) -> float:
    tot = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            head = line.split(" ")[0]
            if head == name or head.startswith(name + "{"):
                tot += float(line.rsplit(" ", 1)[1])
    return tot


def served(folder: Path, out: Path, log_dir: str, msgs: list[dict], max_tokens: int, n_req: int,
           prompt_tokens: int, gen_tokens: int) -> dict:
    import httpx

    from deploy.launcher import start_stack
    from k3serve.protocol import CLUSTER_TOKEN_HEADER

    t0 = time.time()
    stack = start_stack(model=str(folder), num_prefill=1, num_decode=1, device="cuda",
                        ready_timeout=420.0, log_dir=log_dir,
                        extra_worker_args=["--log-level", "info"])  # per-transfer timings
    res: dict = {"startup_s": time.time() - t0}
    log(f"stack up in {res['startup_s']:.1f} s at {stack.url}")
    try:
        c = httpx.Client(base_url=stack.url, timeout=300.0)
        model = c.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": msgs, "temperature": 0, "max_tokens": max_tokens,
                "logprobs": True}
        r = c.post("/v1/chat/completions", json=body)  # first: compiles / captures on workers
        r = c.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        j = r.json()
        ch = j["choices"][0]
        res["chat"] = {"text": ch["message"]["content"], "finish_reason": ch["finish_reason"],
                       "tokens": [t["token"] for t in (ch.get("logprobs") or {}).get("content", [])],
                       "token_bytes": [t.get("bytes") for t in
                                       (ch.get("logprobs") or {}).get("content", [])],
                       "usage": j.get("usage")}
        filler = "\n".join(corpus())
        ttft, itl, e2e = [], [], []
        for i in range(n_req):
            b = {"model": model, "messages": messages(i, filler, prompt_tokens), "stream": True,
                 "temperature": 0, "max_tokens": gen_tokens}
            t_send = time.perf_counter()
            stamps = []
            with c.stream("POST", "/v1/chat/completions", json=b) as s:
                s.raise_for_status()
                for line in s.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    d = json.loads(line[6:])
                    if d.get("choices") and (d["choices"][0].get("delta") or {}).get("content"):
                        stamps.append(time.perf_counter())
            if not stamps:
                continue
            ttft.append(stamps[0] - t_send)
            gaps = [b_ - a_ for a_, b_ in itertools.pairwise(stamps)]
            if gaps:
                itl.append(statistics.median(gaps))
            e2e.append(stamps[-1] - t_send)
            log(f"req {i}: ttft {ttft[-1] * 1e3:.1f} ms, {len(stamps)} chunks, "
                f"itl {itl[-1] * 1e3 if gaps else float('nan'):.2f} ms")
        res["stream"] = {"requests": len(ttft), "prompt_tokens_approx": prompt_tokens,
                         "max_tokens": gen_tokens,
                         "ttft_ms_median": statistics.median(ttft) * 1e3 if ttft else None,
                         "ttft_ms_all": [t * 1e3 for t in ttft],
                         "itl_ms_median": statistics.median(itl) * 1e3 if itl else None,
                         "itl_ms_all": [t * 1e3 for t in itl]}
        hdr = {CLUSTER_TOKEN_HEADER: stack.cluster_token}
        mets = {}
        for url in stack.worker_urls:
            try:
                mets[url] = httpx.get(f"{url}/metrics", headers=hdr, timeout=10).text
            except httpx.HTTPError as e:
                mets[url] = f"# error {e!r}"
        tr = []
        for url, text in mets.items():
            nb = metric(text, "k3serve:kv_transfer_bytes_total")
            secs = metric(text, "k3serve:kv_transfer_seconds_sum")
            cnt = metric(text, "k3serve:kv_transfer_seconds_count")
            fb = metric(text, "k3serve:kv_transfer_fallbacks_total")
            tr.append({"worker": url, "bytes": nb, "seconds_sum": secs, "count": cnt,
                       "fallbacks": fb, "gb_per_s": nb / secs / 1e9 if secs else None})
        res["transfer"] = tr
        (out / "metrics.txt").write_text("\n\n".join(f"## {u}\n{t}" for u, t in mets.items()))
    finally:
        stack.stop()
    res["transfers_logged"] = transfer_log(Path(log_dir))
    return res


_TRANSFER = re.compile(r"transfer (\w+) in ([\d.]+) s \((\d+) tokens, (\d+) runs, (\d+) B\): (\{.*\})")


def transfer_log(log_dir: Path) -> list[dict]:
    """The prefill worker's per-transfer info lines (``prefill/worker.py`` ``_count_transfer``):
    state, seconds from admission, tokens, runs, bytes and the sender's stage times
    (``t_paired``, ``t_first_write``, ``t_written``, ``t_done``, seconds from admission)."""
    out = []
    for f in sorted(log_dir.glob("*")):
        if not f.is_file():
            continue
        for line in f.read_text(errors="replace").splitlines():
            m = _TRANSFER.search(line)
            if m:
                st = ast.literal_eval(m.group(6))
                out.append({"state": m.group(1), "seconds": float(m.group(2)),
                            "tokens": int(m.group(3)), "runs": int(m.group(4)),
                            "bytes": int(m.group(5)), **st})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--folder", default="/tmp/k3-mini-ckpt")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--log-dir", default="/tmp/k3serve-logs", help="the stack's process logs")
    ap.add_argument("--max-tokens", type=int, default=32, help="the equality check's answer")
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="streamed prompts, approx")
    ap.add_argument("--gen-tokens", type=int, default=64, help="streamed answers")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_serve: no CUDA device here; nothing to measure (run it on the H200).")
        return 0
    import triton

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = Path(args.folder)
    if not (folder / "tokenizer.json").exists():
        write_checkpoint(folder)
    msgs = messages(-1, "", 0)
    off = offline(folder, msgs, args.max_tokens)
    log("offline:", repr(off["text"][:200]), off["finish_reason"], f"{off['seconds_first_call']:.2f} s (first call)")
    res = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "offline": off}
    try:
        import importlib.metadata as md

        res["mooncake"] = next((f"{n} {md.version(n)}" for n in (
            "mooncake-transfer-engine-cuda13", "mooncake-transfer-engine",
            "mooncake-transfer-engine-non-cuda") if _has(md, n)), "carried (unpacked)")
    except Exception:  # noqa: BLE001
        res["mooncake"] = "unknown"
    try:
        res.update(served(folder, out, args.log_dir, msgs, args.max_tokens, args.requests,
                          args.prompt_tokens, args.gen_tokens))
    finally:
        (out / "gpu_serve.json").write_text(json.dumps(res, indent=1))
    chat = res.get("chat", {})
    same_text = chat.get("text") == off["text"]
    same_toks = chat.get("token_bytes") == off["token_bytes"]  # strings differ for partial UTF-8
    res["equal"] = {"text": same_text, "token_bytes": same_toks,
                    "token_strings": chat.get("tokens") == off["tokens"]}
    (out / "gpu_serve.json").write_text(json.dumps(res, indent=1))
    st = res.get("stream", {})
    lines = [(f"k3-mini served 1 prefill + 1 decode on {res['device']} ({res['date']}, torch "
             f"{res['torch']}, triton {res['triton']}, {res['mooncake']})"),
             (f"greedy chat answer equal to offline: text={same_text} tokens={same_toks} "
             f"({len(off['tokens'])} tokens, API {len(chat.get('tokens', []))})"),
             (f"TTFT median {st.get('ttft_ms_median')} ms, ITL median {st.get('itl_ms_median')} ms "
             f"over {st.get('requests')} requests (~{args.prompt_tokens}-token prompts)")]
    for t in res.get("transfer", []):
        lines.append(f"transfer {t['worker']}: {t['bytes'] / 1e6:.1f} MB in {t['count']:.0f} "
                     f"transfers, {t['seconds_sum']:.3f} s → {t['gb_per_s']} GB/s, "
                     f"fallbacks {t['fallbacks']:.0f}")
    ok = [t for t in res.get("transfers_logged", []) if t["state"] == "SUCCESS"
          and "t_written" in t and "t_first_write" in t]  # fmt: skip
    if ok:
        w = statistics.median(t["t_written"] - t["t_first_write"] for t in ok)
        tot_b = sum(t["bytes"] for t in ok)
        tot_w = sum(t["t_written"] - t["t_first_write"] for t in ok)
        tot_a = sum(t["seconds"] for t in ok)
        res["transfer_phases"] = {
            "transfers": len(ok), "bytes": tot_b, "admission_to_done_s": tot_a,
            "first_write_to_written_s": tot_w,
            "paired_s_median": statistics.median(t.get("t_paired", 0.0) for t in ok),
            "first_write_s_median": statistics.median(t["t_first_write"] for t in ok),
            "written_s_median": statistics.median(t["t_written"] for t in ok),
            "done_s_median": statistics.median(t.get("t_done", t["seconds"]) for t in ok),
            "gb_per_s_admission_to_done": tot_b / tot_a / 1e9 if tot_a else None,
            "gb_per_s_write_phase": tot_b / tot_w / 1e9 if tot_w else None}
        (out / "gpu_serve.json").write_text(json.dumps(res, indent=1))
        lines.append(f"transfer phases (medians, s from admission): {res['transfer_phases']}")
        lines.append(f"prefill log: {len(ok)} transfers, median {statistics.median(t['bytes'] for t in ok) / 1e6:.1f} MB, "
                     f"first write → all written median {w * 1e3:.1f} ms, admission → done median "
                     f"{statistics.median(t['seconds'] for t in ok) * 1e3:.0f} ms")  # fmt: skip
    (out / "serve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0


def _has(md, name: str) -> bool:
    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
