"""Cost of grammar masking per decode step (k3-tiny, batch 32, CPU).

Two measurements:

1. **Mask alone**: 32 llguidance matchers (a Kimi tool-call grammar with a JSON-Schema
   argument object, and a ``response_format`` JSON Schema) walked along valid outputs; per
   step, the engine's work for the batch: 32 packed bitmasks (Rust), unpacked to a bool
   ``[32, V]`` (torch), applied to the logits (``masked_fill``), and 32 ``consume`` calls.
   The plain-torch reference (one parser check per token id) is timed beside it.
2. **Engine step**: ``k3serve.LLM`` (k3-tiny) generating batch 32 greedy with and without a
   grammar; the mean wall time of a decode step for each and the difference.

Usage::

    PYTHONPATH=. .venv/bin/python benchmarks/grammar_mask.py [--batch 32] [--steps 48]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from k3serve.process import output_file, positive_int
from k3serve.structured import GrammarVocab, json_schema_grammar, tool_call_grammar
from k3serve.structured.mask import apply_mask, grammar_mask, reference_mask
from k3serve.tokenizer import ByteTokenizer

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
             "maxItems": 4},
    "opts": {"type": "object", "properties": {"hourly": {"type": "boolean"}}}},
    "required": ["city", "unit"], "additionalProperties": False}
ARGS = '{"city":"Paris","unit":"celsius","days":[1,2,3],"opts":{"hourly":true}}'
TOOL_TEXT = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
             f"<|tool_call_argument_begin|>{ARGS}<|tool_call_end|><|tool_calls_section_end|>")


def mask_alone(batch: int, steps: int) -> dict:
    tok = ByteTokenizer()
    vocab = GrammarVocab(tok)
    t0 = time.perf_counter()
    grammars = [tool_call_grammar([{"name": "get_weather", "parameters": SCHEMA}]),
                json_schema_grammar(SCHEMA)]
    texts = [tok.encode(TOOL_TEXT, parse_special=True), tok.encode(ARGS)]
    matchers = [vocab.matcher(grammars[i % 2]) for i in range(batch)]
    build = (time.perf_counter() - t0) / batch
    logits = torch.randn(batch, tok.vocab_size)
    per_step, ref_step = [], []
    n = min(steps, min(len(t) for t in texts))
    for k in range(n):
        t0 = time.perf_counter()
        allowed = grammar_mask(matchers, tok.vocab_size)
        apply_mask(logits, allowed)
        for i, m in enumerate(matchers):
            m.consume(texts[i % 2][k])
        per_step.append(time.perf_counter() - t0)
        if k % 8 == 0:
            t0 = time.perf_counter()
            reference_mask(matchers[:4], tok.vocab_size)
            ref_step.append((time.perf_counter() - t0) * batch / 4)
    med = statistics.median(per_step) * 1e3
    print(f"mask alone, batch {batch}, V={tok.vocab_size}: matcher build {build * 1e3:.2f} ms "
          f"each; per step (bitmask + unpack + apply + consume) median {med:.3f} ms, "
          f"p90 {sorted(per_step)[int(0.9 * len(per_step))] * 1e3:.3f} ms over {n} steps; "
          f"plain-torch reference mask {statistics.median(ref_step) * 1e3:.1f} ms/step")
    return {"batch": batch, "vocab_size": tok.vocab_size, "steps": n,
            "matcher_build_ms": build * 1e3, "mask_step_median_ms": med,
            "mask_step_p90_ms": sorted(per_step)[int(0.9 * len(per_step))] * 1e3,
            "reference_mask_step_ms": statistics.median(ref_step) * 1e3}


def engine_steps(batch: int, steps: int) -> dict:
    from k3serve import LLM
    from k3serve.sampling import SamplingParams

    tok = ByteTokenizer()
    llm = LLM("k3-tiny", block_size=16, num_pages=1024, num_slots=batch + 4)
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"weather {i}"}])
               for i in range(batch)]
    grammar = json_schema_grammar(SCHEMA)

    def run(g: str | None) -> float:
        p = SamplingParams(max_tokens=steps, temperature=0.0, grammar=g, ignore_eos=g is None)
        eng = llm.engine
        for i, ids in enumerate(prompts):
            eng.add_request(f"{g is not None}-{i}-{time.time_ns()}", ids, p)
        times = []
        while eng.has_unfinished_requests():
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[2:]) * 1e3  # decode steps (after the prefill)

    run(None)  # warm-up
    free, masked = run(None), run(grammar)
    print(f"engine, k3-tiny batch {batch}: decode step median {free:.2f} ms unconstrained, "
          f"{masked:.2f} ms with a JSON-Schema grammar on every row "
          f"(+{masked - free:.2f} ms, {100 * (masked - free) / free:.1f} %)")
    return {"batch": batch, "decode_step_median_ms": free, "decode_step_grammar_median_ms": masked}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=positive_int, default=32, help="sequences per step")
    ap.add_argument("--steps", type=positive_int, default=48, help="decode steps timed")
    ap.add_argument("--json", type=output_file, default=None, help="write the result here")
    a = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result = {"mask_alone": mask_alone(a.batch, a.steps), "engine": engine_steps(a.batch, a.steps)}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
