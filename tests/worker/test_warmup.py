"""Start-up warm-up (k3serve/engine/warmup.py): the shapes it runs, and that it leaves no
trace a request can see (greedy outputs and cache events equal a fresh engine's)."""

from __future__ import annotations

from k3serve import LLM, SamplingParams
from k3serve.engine.warmup import warm_up, warmup_shapes


def test_shapes_cover_the_step_classes() -> None:
    shapes = warmup_shapes(512, (1, 2, 4, 8), 4096)
    sizes = [sum(n for n, _ in b) for b in shapes]
    assert max(sizes) == 512 and all(s <= 512 for s in sizes)
    assert [(512, 0)] in shapes and [(512, 512)] in shapes  # first and later chunks
    assert any(len(b) > 1 and b[0] == (1, 40) and b[-1][0] > 1 for b in shapes)  # mixed
    for k in (1, 2, 4, 8):
        assert [(1, 40)] * k in shapes  # every decode bucket
    assert all(n + c <= 600 for b in warmup_shapes(512, (1,), 600) for n, c in b)


def test_cpu_skips_with_a_reason() -> None:
    llm = LLM("k3-tiny", num_pages=64, num_slots=4, max_num_batched_tokens=128)
    rep = warm_up(llm.engine)
    assert rep.num_forwards == 0 and "cpu" in rep.skipped


def test_warm_up_leaves_no_trace() -> None:
    kw = {"num_pages": 64, "num_slots": 4, "max_num_batched_tokens": 128}
    prompts = [list(range(5, 90)), list(range(200, 230))]
    sp = SamplingParams(temperature=0, max_tokens=8)
    fresh = LLM("k3-tiny", **kw)
    want = [o.token_ids for o in fresh.generate(prompts, sp)]
    warmed = LLM("k3-tiny", **kw)
    rep = warm_up(warmed.engine, force=True)
    assert rep.num_forwards >= 5 and not rep.skipped
    assert warmed.engine.cache_events()["events"] == []
    assert warmed.engine.cm.usage().pages_used == 0
    got = warmed.generate(prompts, sp)
    assert [o.token_ids for o in got] == want
    assert [o.num_cached_tokens for o in got] == [0, 0]
