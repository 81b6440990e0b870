"""Engine on a micro K3 config (random init): batching equals one request alone, prefix caching
changes nothing but speed, multi-turn snapshot hits, no leaks under aborts, bad input names the
field, the worker API (prefill handle → decode engine) and the KV connector seam.

The micro model keeps every K3 feature (KDA, gated MLA, latent MoE, AttnRes) at toy widths so
a forward costs milliseconds; block size 4 so that short prompts span many blocks.
"""

from __future__ import annotations

import random

import pytest
import torch

from k3serve.cache.allocator import CacheFullError
from k3serve.cache.events import EventIndex
from k3serve.cache.pools import KVPools
from k3serve.config import PRESETS
from k3serve.engine.config import EngineConfig
from k3serve.engine.connector import DisaggConnector, KVConnector
from k3serve.engine.engine import LLMEngine
from k3serve.engine.llm import LLM, load_model
from k3serve.engine.runner import RunBatch
from k3serve.engine.sampler import SamplingRow, sample
from k3serve.engine.scheduler import Scheduler
from k3serve.engine.sequence import SeqStatus
from k3serve.model.batch import make_batch
from k3serve.sampling import SamplingParams

torch.set_num_threads(1)

MICRO = PRESETS["k3-tiny"].replace(
    name="micro",
    hidden_size=32,
    num_layers=4,
    mla_layers=(1, 3),
    kda_num_heads=2,
    kda_head_dim=16,
    kda_gate_rank=8,
    mla_num_heads=2,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    dense_intermediate_size=64,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    moe_latent_size=16,
    attn_res_block_layers=2,
    max_position_embeddings=256,
)
B = 4
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def tiny_llm(**kw) -> LLM:
    base = {
        "block_size": B,
        "num_pages": 96,
        "num_slots": 16,
        "num_snapshots": 16,
        "max_num_batched_tokens": 16,
    }
    base.update(kw)
    return LLM(MICRO, **base)


@pytest.fixture(scope="module")
def model():
    return load_model(MICRO)[0]


@torch.inference_mode()
def alone(model, prompt, max_tokens, params=None, choice=0, seed=0, with_logits=False):
    """Reference: one request through the model by hand — whole-prompt prefill, then decode
    steps, fresh pools, no engine, no scheduler, no cache manager.

    Returns:
        the generated tokens (and, ``with_logits``, the ``[V]`` logits of each)."""
    pools = KVPools(MICRO, num_slots=1, num_pages=64, block_size=B)
    params = params or SamplingParams(max_tokens=max_tokens, **GREEDY)
    toks = list(prompt)
    table = list(range(64))
    logits = model(torch.tensor(toks), make_batch([len(toks)], [0], [0], [table], B), pools)
    out, lgs = [], []
    for _ in range(max_tokens):
        row = SamplingRow(params, seed, len(toks), choice, list(out))
        t = sample(logits, [row])[0].token_id
        out.append(t)
        lgs.append(logits[0])
        toks.append(t)
        logits = model(torch.tensor([t]), make_batch([1], [len(toks) - 1], [0], [table], B), pools)
    return (out, lgs) if with_logits else out


def _close(a, b, tol=1e-4):
    return len(a) == len(b) and all((x - y).abs().max().item() <= tol for x, y in zip(a, b))


def _prompts(rng, n, lo, hi, vocab=256):
    return [[rng.randrange(vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


# ====================================================== batched engine = each request alone
def test_batched_engine_equals_alone(model):
    rng = random.Random(0)
    prompts = _prompts(rng, 16, 1, 41)
    lens = [rng.randrange(2, 10) for _ in prompts]
    llm = tiny_llm(num_slots=16, max_num_batched_tokens=12, record_logits=True)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=m, **GREEDY) for m in lens])
    for p, m, o in zip(prompts, lens, outs):
        toks, lgs = alone(model, p, m, with_logits=True)
        assert o.token_ids == toks, (len(p), m)
        assert _close(o.logits[0], lgs)
        assert o.finish_reason == "length"
    st = llm.engine.stats
    assert st.num_mixed_steps > 0  # prefill chunks interleaved with decodes
    assert st.num_steps > sum(len(p) for p in prompts) // 12  # prefills were chunked
    llm.engine.cm.check()


def test_n_choices_fork_match_alone(model):
    """n > 1: the prompt is computed once, the state forked; each choice equals choice c alone."""
    prompt = list(range(30, 47))  # 17 tokens: a partial last block is copied
    sp = SamplingParams(n=3, temperature=0.8, max_tokens=6, seed=7, ignore_eos=True)
    llm = tiny_llm(record_logits=True)
    out = llm.generate([prompt, list(range(5, 25))], [sp, SamplingParams(max_tokens=3, **GREEDY)])[
        0
    ]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        toks, lgs = alone(model, prompt, 6, sp, choice=c.index, seed=7, with_logits=True)
        assert c.token_ids == toks
        assert _close(out.logits[c.index], lgs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # choices differ
    assert llm.engine.stats.prompt_tokens_computed == 17 + 20  # the prompt once, not 3 times
    llm.engine.cm.check()


def test_stop_token_logprobs_and_text(model):
    prompt = list(range(70, 85))
    ref = alone(model, prompt, 6)
    llm = tiny_llm()
    stop_at = next(i for i, t in enumerate(ref) if t not in ref[:i])  # first occurrence
    sp = SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[ref[stop_at]], logprobs=3)
    o = llm.generate([prompt], sp)[0]
    assert o.token_ids == ref[: stop_at + 1] and o.finish_reason == "stop"
    assert o.outputs[0].stop_reason == ref[stop_at]
    c = o.outputs[0]
    assert len(c.logprobs) == len(c.top_logprobs) == len(c.token_ids)
    assert all(len(t) == 3 and t[0][1] >= t[1][1] >= t[2][1] for t in c.top_logprobs)
    assert all(lp <= 0 for lp in c.logprobs)
    # text is the byte tokenizer's decoding of the tokens (the stop token left out)
    assert c.text == llm.tokenizer.decode(ref[:stop_at])


# ================================================ prefix caching changes nothing but speed
def _both(calls, **kw):
    """Run the same generate calls with and without prefix caching; compare tokens and logits."""
    on = tiny_llm(record_logits=True, **kw)
    off = tiny_llm(record_logits=True, enable_prefix_caching=False)
    cached = []
    for prompts, snaps, m in calls:
        sp = SamplingParams(max_tokens=m, **GREEDY)
        a = on.generate(prompts, sp, snapshot_at=snaps)
        b = off.generate(prompts, sp, snapshot_at=snaps)
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            assert y.num_cached_tokens == 0
            for la, lb in zip(x.logits[0], y.logits[0]):
                assert (la - lb).abs().max().item() <= 1e-4
        cached.append([x.num_cached_tokens for x in a])
    return on, cached


def test_prefix_caching_changes_nothing_but_speed():
    rng = random.Random(1)
    P = _prompts(rng, 1, 14, 15)[0]  # 14 tokens: p0 = 12
    Q = P[:10] + [1, 2, 3, 4, 5]  # blocks 0, 1 shared with P; no snapshot at 8
    S = _prompts(rng, 1, 14, 15)[0]
    S2 = S[:10] + [9, 9, 9, 9, 9]
    flood = _prompts(rng, 8, 18, 24)  # ≈ 4× the cache: evicts blocks and snapshots
    on, cached = _both(
        [
            ([P], [4], 3),  # cold; snapshots at 4 (asked) and 12 (p0)
            ([P], None, 3),  # hit at the snapshot boundary ⌊13/4⌋·4
            ([Q], None, 3),  # MLA blocks to 8, snapshot only at 4: falls back to 4
            ([S], None, 3),
            ([S2], None, 3),  # blocks to 8, no snapshot below 8: falls back to none
            ([[7, 8, 9]], None, 4),  # shorter than a block
            ([[7, 8, 9]], None, 4),
            (flood[:4], None, 3),
            (flood[4:], None, 3),
            ([P], None, 3),  # after eviction
        ],
        num_pages=24,
        num_snapshots=3,
        num_slots=4,
    )
    assert cached[:7] == [[0], [12], [4], [0], [0], [0], [0]]
    assert cached[9] == [0]
    cm = on.engine.cm
    assert cm.pages.num_evictions > 0 and cm.snapshots.num_evictions > 0


def test_prefix_caching_random_workload_with_eviction():
    rng = random.Random(2)
    stems = _prompts(rng, 4, 6, 20)
    calls = []
    for _ in range(6):
        ps = [list(rng.choice(stems)) + _prompts(rng, 1, 1, 10)[0] for _ in range(4)]
        calls.append((ps, [[rng.randrange(24)] for _ in ps], rng.randrange(2, 6)))
    on, cached = _both(calls, num_pages=20, num_snapshots=4, num_slots=4)
    assert sum(map(sum, cached)) > 0
    cm = on.engine.cm
    assert cm.pages.num_evictions > 0 and cm.snapshots.num_evictions > 0
    cm.check()
    # the router's view: the engine's cache events replayed into an empty index give its state
    idx = EventIndex()
    idx.load_state({"epoch": on.engine.cache_events()["epoch"], "last_seq": 0})
    assert idx.apply(on.engine.cache_events(0))
    st = on.engine.cache_state()
    assert idx.content() == (frozenset(st["blocks"]), frozenset(st["snapshots"]))
    assert st["blocks"] and st["snapshots"]


# ====================================================== multi-turn: end-of-request snapshots
def test_multi_turn_hits_end_of_request_snapshot():
    llm = tiny_llm()
    p1 = list(range(40, 53))  # 13 tokens
    o1 = llm.generate([p1], SamplingParams(max_tokens=6, **GREEDY))[0]
    assert o1.num_cached_tokens == 0 and len(o1.token_ids) == 6
    turn2 = p1 + o1.token_ids + [60, 61, 62, 63, 64]
    o2 = llm.generate([turn2], SamplingParams(max_tokens=3, **GREEDY))[0]
    # prompt + answer − the last sampled token, rounded down to a block: ⌊(13 + 6 − 1)/4⌋·4
    assert o2.num_cached_tokens == (13 + 6 - 1) // B * B == 16
    # a shared system prompt with a snapshot asked for at its end: the next user hits it
    system = list(range(100, 112))  # 12 tokens
    llm.generate(
        [system + [1, 2, 3, 4, 5, 6, 7]], SamplingParams(max_tokens=2, **GREEDY), snapshot_at=[12]
    )
    o3 = llm.generate([system + [9, 8, 7, 6, 5]], SamplingParams(max_tokens=2, **GREEDY))[0]
    assert o3.num_cached_tokens == 12
    # control: the same without snapshot_at does not hit inside the system prompt
    other = list(range(150, 162))
    llm.generate([other + [1, 2, 3, 4, 5, 6, 7]], SamplingParams(max_tokens=2, **GREEDY))
    assert (
        llm.generate([other + [9, 8, 7, 6, 5]], SamplingParams(max_tokens=2, **GREEDY))[
            0
        ].num_cached_tokens
        == 0
    )


# ====================================== no leaked page / slot / snapshot after 1000 requests
def test_no_leaks_after_1000_random_requests_with_aborts():
    rng = random.Random(3)
    llm = tiny_llm(num_pages=24, num_slots=10, num_snapshots=6, max_num_batched_tokens=24)
    eng = llm.engine
    stems = _prompts(rng, 5, 2, 12)
    aborted = {"waiting": 0, "prefill": 0, "decode": 0}
    added = 0
    while added < 1000 or eng.has_unfinished_requests():
        while added < 1000 and len(eng.requests) < 24:
            p = list(rng.choice(stems)) + _prompts(rng, 1, 1, 12)[0]
            sp = SamplingParams(
                max_tokens=rng.randrange(1, 5),
                n=rng.choice([1, 1, 1, 2]),
                temperature=rng.choice([0.0, 1.0]),
                seed=added,
            )
            eng.add_request(f"r{added}", p, sp, snapshot_at=[rng.randrange(20)])
            added += 1
        for rid, req in list(eng.requests.items()):
            if rng.random() < 0.04:
                s = req.seqs[0]
                kind = (
                    "waiting"
                    if s.status.value == "waiting"
                    else ("prefill" if s.is_prefill else "decode")
                )
                assert eng.abort_request(rid)
                aborted[kind] += 1
        eng.step()
        if eng.stats.num_steps % 200 == 0:
            eng.cm.check()
    cm = eng.cm
    cm.check()
    u = cm.usage()
    assert (u.pages_used, u.slots_used, u.snapshots_used) == (0, 0, 0)
    assert all(cm.pages.ref_count(i) == 0 for i in range(cm.pages.num_ids))
    assert all(cm.snapshots.ref_count(i) == 0 for i in range(cm.snapshots.num_ids))
    assert (
        cm.seq_ids() == []
        and eng.requests == {}
        and not eng.scheduler.waiting
        and not eng.scheduler.running
    )
    assert min(aborted.values()) > 0, aborted
    assert eng.scheduler.num_preemptions > 0 and cm.stats.hit_tokens > 0
    assert cm.pages.num_evictions > 0


# ==================================================== bad input: a ValueError naming the field
def test_bad_input_raises_value_error_naming_the_field():
    llm = tiny_llm(num_pages=16)  # 64 tokens of cache → max_model_len 64
    eng = llm.engine
    assert eng.max_model_len == 64
    cases = [
        (lambda: llm.generate([[1] * 64]), "prompt_token_ids"),
        (lambda: llm.generate([[1, 2, 300]]), "prompt_token_ids"),
        (lambda: llm.generate([[]]), "prompt_token_ids"),
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(max_tokens=-3), "max_tokens"),
        (lambda: SamplingParams(temperature=-1.0), "temperature"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_k=0), "top_k"),
        (lambda: llm.generate([[1, 2]], SamplingParams(stop_token_ids=[999])), "stop_token_ids"),
        (lambda: llm.generate([[1, 2]], cache_salt=""), "cache_salt"),
        (lambda: llm.generate([[1, 2]], snapshot_at=[-4]), "snapshot_at"),
        (lambda: DisaggConnector.of(eng).add_prefill_request("x", [1, 2], SamplingParams(n=2)),
         "SamplingParams.n"),
        (lambda: LLM(MICRO, block_sise=4), "block_sise"),
    ]
    for fn, field in cases:
        with pytest.raises(ValueError, match=field):
            fn()
    assert eng.requests == {} and eng.cm.seq_ids() == []  # nothing half-queued


def test_requests_that_do_not_fit_wait_or_are_preempted(model):
    """6 requests of up to 40 tokens each on a 48-token cache: they queue and preempt each
    other (recompute), never crash, and still give the tokens they give alone."""
    rng = random.Random(4)
    prompts = _prompts(rng, 6, 20, 30)
    llm = tiny_llm(num_pages=12, num_slots=4, num_snapshots=2, max_num_batched_tokens=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, **GREEDY))
    assert llm.engine.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert o.token_ids == alone(model, p, 10)
    assert llm.engine.cm.usage().pages_used == 0


# ====================================================================== worker API
def test_prefill_handle_to_decode_engine_gives_same_tokens(model):
    cfg = EngineConfig(
        block_size=B, num_pages=64, num_slots=4, num_snapshots=4, max_num_batched_tokens=8
    )
    P = LLMEngine(model, MICRO, None, cfg)
    D = LLMEngine(model, MICRO, None, EngineConfig(**{**cfg.__dict__, "record_logits": True}))
    Pk, Dk = DisaggConnector.of(P), DisaggConnector.of(D)
    prompt = list(range(60, 79))  # 19 tokens
    sp = SamplingParams(max_tokens=8, **GREEDY)
    expect, expect_logits = alone(model, prompt, 8, with_logits=True)
    for rnd in range(2):  # the second round hits P's prefix cache
        rid = f"req{rnd}"
        admitted: list = []
        layers: list = []
        Pk.add_prefill_request(
            rid,
            prompt,
            sp,
            on_admit=admitted.append,
            layer_hook=lambda layer, upto, rec=layers: rec.append((layer, upto)),
        )
        handle = None
        while handle is None or handle.first_token is None:
            for out in P.step():
                handle = out.handle
        assert admitted and admitted[0].slot == handle.slot and admitted[0].pages == handle.pages
        assert handle.num_tokens == 19 and len(handle.pages) == 5
        assert handle.num_cached_tokens == (0 if rnd == 0 else 16)
        assert {l for l, u in layers if u == 19} == set(
            range(MICRO.num_layers)
        )  # every layer final
        dh = Dk.reserve(rid, prompt)
        assert dh.num_tokens == 19 and len(dh.pages) == 5
        with torch.no_grad():  # the transfer, by hand
            D.pools.kda_state[:, dh.slot] = P.pools.kda_state[:, handle.slot]
            D.pools.conv_state[:, dh.slot] = P.pools.conv_state[:, handle.slot]
            for sp_, dp in zip(handle.pages, dh.pages):
                D.pools.mla_latent[:, dp] = P.pools.mla_latent[:, sp_]
        Pk.release(rid)
        ft = handle.first_token
        assert ft.position == 19
        assert (
            Dk.admit(rid, [ft.token_id], sp.with_seed(ft.seed), output_logprobs=[ft.logprob])
            is None
        )
        final = None
        while final is None:
            final = next((o for o in D.step() if o.finished), None)
        assert final.token_ids == expect
        assert _close(final.logits[0], expect_logits[1:])  # tokens #2.. sampled on D
        assert P.cm.usage().pages_used == 0 and D.cm.usage().pages_used == 0
    # D indexed the prompt blocks it received (decode workers are indexed too)
    assert len(D.cache_state()["blocks"]) >= 4
    # a reservation can be aborted; a full decode worker says so
    Dk.reserve("x", prompt)
    assert D.abort_request("x") and D.cm.usage().slots_used == 0
    small = LLMEngine(model, MICRO, None, EngineConfig(block_size=B, num_pages=4, num_slots=1))
    sk = DisaggConnector.of(small)
    assert sk.can_reserve(4 * B) and not sk.can_reserve(4 * B + 1)  # 4 pages, 1 slot
    sk.reserve("a", [1, 2, 3])
    assert not sk.can_reserve(1)  # the one slot is taken
    with pytest.raises(CacheFullError):
        sk.reserve("b", [1, 2, 3])
    with pytest.raises(ValueError, match="output_token_ids"):
        sk.admit("a", [5, 6], SamplingParams())


def test_llm_loads_a_checkpoint_folder(tmp_path):
    from k3serve.model.checkpoint_save import save_checkpoint

    net, cfg, folder = load_model(MICRO, seed=3)
    assert folder is None
    save_checkpoint(net, str(tmp_path), cfg)
    sp = SamplingParams(max_tokens=5, **GREEDY)
    a = LLM(str(tmp_path), block_size=B, num_pages=32).generate([[1, 2, 3, 4, 5]], sp)[0]
    b = LLM(MICRO, seed=3, block_size=B, num_pages=32).generate([[1, 2, 3, 4, 5]], sp)[0]
    c = LLM(MICRO, seed=4, block_size=B, num_pages=32).generate([[1, 2, 3, 4, 5]], sp)[0]
    assert a.token_ids == b.token_ids != c.token_ids
    with pytest.raises(ValueError, match="model"):
        LLM("no-such-model")


# ====================================================================== the KV connector seam
class _Recorder(KVConnector):
    """A neutral connector that records every call the engine and the scheduler make."""

    def __init__(self):
        self.calls: list[tuple] = []

    def admit_tokens(self, seq, num_new, num_to_target):
        self.calls.append(("admit_tokens", seq.request.request_id, num_new, num_to_target))
        return num_new

    def preemptible(self, seq):
        self.calls.append(("preemptible", seq.request.request_id))
        return True

    def on_admit(self, seqs):
        self.calls.append(("on_admit", tuple(s.request.request_id for s in seqs)))

    def layer_hook(self, group):
        rows = tuple((s.seq.request.request_id, s.num_new) for s in group)
        self.calls.append(("layer_hook", rows))
        return lambda layer: self.calls.append(("layer", layer))

    def on_sampled(self, seq, result):
        self.calls.append(("on_sampled", seq.request.request_id, result.token_id))
        return False

    def has_request(self, request_id):
        self.calls.append(("has_request", request_id))
        return False

    def on_abort(self, request_id):
        self.calls.append(("on_abort", request_id))
        return False


def test_fake_connector_sees_the_step_in_order(model):
    """schedule (admit_tokens) → on_admit → per forward layer_hook then every layer in order →
    on_sampled per token; a neutral connector changes no token."""
    rec = _Recorder()
    cfg = EngineConfig(block_size=B, num_pages=32, num_slots=2, max_num_batched_tokens=4)
    eng = LLMEngine(model, MICRO, None, cfg, connector=rec)
    assert eng.connector is rec and eng.scheduler.hook is rec
    prompt = list(range(50, 60))  # 10 tokens: chunks of 4, 4, 2
    eng.add_request("a", prompt, SamplingParams(max_tokens=2, **GREEDY))
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
    toks = alone(model, prompt, 2)
    assert outs["a"].token_ids == toks
    layers = [("layer", layer) for layer in range(MICRO.num_layers)]
    assert rec.calls == [
        ("has_request", "a"),
        ("admit_tokens", "a", 4, 10),
        ("on_admit", ("a",)),
        ("layer_hook", (("a", 4),)), *layers,
        ("layer_hook", (("a", 4),)), *layers,
        ("layer_hook", (("a", 2),)), *layers,
        ("on_sampled", "a", toks[0]),
        ("layer_hook", (("a", 1),)), *layers,  # the decode of token #1
        ("on_sampled", "a", toks[1]),
    ]  # fmt: skip
    rec.calls.clear()
    assert not eng.abort_request("a") and rec.calls == [("on_abort", "a")]
    eng.cm.check()


def test_connector_scheduler_hook_pins_a_request(model):
    """The scheduler's hook: a request the connector keeps gets pages for its whole prompt at
    admission and is skipped when a victim is chosen (the newest sequence otherwise) — what
    the disaggregation connector builds prefill-only requests on."""

    class Keep(_Recorder):
        def admit_tokens(self, seq, num_new, num_to_target):
            super().admit_tokens(seq, num_new, num_to_target)
            return num_to_target if seq.request.request_id == "keep" else num_new

        def preemptible(self, seq):
            super().preemptible(seq)
            return seq.request.request_id != "keep"

    rec = Keep()
    cfg = EngineConfig(block_size=B, num_pages=10, num_slots=3, max_num_batched_tokens=16)
    eng = LLMEngine(model, MICRO, None, cfg, connector=rec)
    prompts = {"o0": [*range(100, 114)], "o1": [*range(130, 144)], "keep": [*range(10, 22)]}
    for rid, p in prompts.items():  # "keep" is the newest: the natural victim
        eng.add_request(rid, p, SamplingParams(max_tokens=6, **GREEDY))
    outs, kept_pages = {}, None
    for _ in range(200):
        for o in eng.step():
            outs[o.request_id] = o
        if kept_pages is None and "keep" in eng.requests:
            seq = eng.requests["keep"].seqs[0]
            if seq.status is SeqStatus.RUNNING:
                kept_pages = len(eng.cm.block_table(seq.seq_id))
                assert seq.num_computed < 12  # admitted part-way through its prompt …
        if kept_pages is not None and "keep" in eng.requests:  # once admitted, never preempted
            assert eng.requests["keep"].seqs[0].status is not SeqStatus.WAITING
        if not eng.has_unfinished_requests():
            break
    assert kept_pages == 3  # … with pages for all 12 tokens
    assert ("preemptible", "keep") in rec.calls and eng.scheduler.num_preemptions > 0
    for rid, p in prompts.items():
        assert outs[rid].token_ids == alone(model, p, 6), rid
    assert eng.cm.usage().pages_used == 0
    eng.cm.check()


def test_engine_without_a_connector_never_calls_one(model, monkeypatch):
    """An offline engine (n > 1 forks, preemption, aborts) runs with ``connector is None``: no
    connector is built and no connector method runs; the first disaggregation call attaches
    the DisaggConnector, and an engine with another connector refuses that API."""
    from k3serve.engine import connector as conn

    def boom(*a, **k):
        raise AssertionError("a connector method ran")

    for name in ("admit_tokens", "preemptible", "on_admit", "layer_hook", "on_forward_failed",
                 "on_sampled", "has_request", "on_abort", "__init__"):  # fmt: skip
        monkeypatch.setattr(conn.KVConnector, name, boom)
        if name in vars(conn.DisaggConnector):
            monkeypatch.setattr(conn.DisaggConnector, name, boom)
    llm = tiny_llm(num_pages=12, num_slots=4, num_snapshots=2, max_num_batched_tokens=16)
    eng = llm.engine
    rng = random.Random(5)
    prompts = _prompts(rng, 6, 20, 30)
    sp = [SamplingParams(max_tokens=6, n=1 + i % 2, seed=i, ignore_eos=True) for i in range(6)]
    eng.add_request("gone", [1, 2, 3], SamplingParams(max_tokens=3))
    assert eng.abort_request("gone") and eng.connector is None
    outs = llm.generate(prompts, sp)
    assert all(len(o.outputs) == s.n for o, s in zip(outs, sp))
    assert eng.scheduler.num_preemptions > 0
    assert eng.connector is None and eng.scheduler.hook is None
    monkeypatch.undo()
    conn.DisaggConnector.of(eng).reserve("r", [1, 2, 3])
    assert isinstance(eng.connector, conn.DisaggConnector) and eng.connector.num_reserved == 1
    assert eng.scheduler.hook is eng.connector and conn.DisaggConnector.of(eng) is eng.connector
    other = LLMEngine(llm.engine.runner.model, MICRO, None, EngineConfig(block_size=B),
                      connector=_Recorder())  # fmt: skip
    with pytest.raises(TypeError, match="_Recorder"):
        conn.DisaggConnector.of(other)
    with pytest.raises(ValueError, match="connector"):
        other.attach(_Recorder())


def test_disaggregation_callbacks_come_in_lifecycle_order(model):
    """Prefill side: on_admit(handle) before any layer, every layer of each forward in order
    with ``upto`` growing to L, then the HELD output with token #1, then release. Decode side:
    reserve → admit → tokens #2… → finished; a fake transfer in between by hand."""
    cfg = EngineConfig(block_size=B, num_pages=64, num_slots=4, num_snapshots=4,
                       max_num_batched_tokens=8)  # fmt: skip
    P, D = LLMEngine(model, MICRO, None, cfg), LLMEngine(model, MICRO, None, cfg)
    Pk, Dk = DisaggConnector.of(P), DisaggConnector.of(D)
    prompt = list(range(60, 79))  # 19 tokens: forwards of 8, 8, 3
    sp = SamplingParams(max_tokens=4, **GREEDY)
    events: list[tuple] = []
    Pk.add_prefill_request(
        "x", prompt, sp,
        on_admit=lambda h: events.append(("admit", h.slot, tuple(h.pages))),
        layer_hook=lambda layer, upto: events.append(("layer", layer, upto)),
    )  # fmt: skip
    held = None
    while held is None:
        held = next((o for o in P.step() if o.handle and o.handle.first_token), None)
    events.append(("held", held.handle.first_token.token_id))
    L = MICRO.num_layers
    assert events[0] == ("admit", held.handle.slot, tuple(held.handle.pages))
    assert len(held.handle.pages) == 5  # pages for the whole prompt at admission
    assert events[1:-1] == [("layer", l, u) for u in (8, 16, 19) for l in range(L)]
    assert held.finished and P.requests["x"].seqs[0].status is SeqStatus.HELD
    assert P.has_unfinished_requests() is False  # held: off the scheduler, still live
    with pytest.raises(ValueError, match="already live"):
        P.add_request("x", prompt)
    dh = Dk.reserve("x", prompt)
    with pytest.raises(ValueError, match="already live"):
        D.add_request("x", prompt)
    with torch.no_grad():
        D.pools.kda_state[:, dh.slot] = P.pools.kda_state[:, held.handle.slot]
        D.pools.conv_state[:, dh.slot] = P.pools.conv_state[:, held.handle.slot]
        for s_, d_ in zip(held.handle.pages, dh.pages):
            D.pools.mla_latent[:, d_] = P.pools.mla_latent[:, s_]
    Pk.release("x")
    with pytest.raises(ValueError, match="not a held prefill request"):
        Pk.release("x")
    ft = held.handle.first_token
    assert Dk.admit("x", [ft.token_id], sp.with_seed(ft.seed)) is None and Dk.num_reserved == 0
    final = None
    while final is None:
        final = next((o for o in D.step() if o.finished), None)
    assert final.token_ids == alone(model, prompt, 4)
    for e in (P, D):
        assert e.requests == {} and e.cm.usage().pages_used == 0
        e.cm.check()


def test_runner_execute_is_the_run_seam(model):
    """Every forward goes through ``runner.execute(RunBatch)`` (where a CUDA-graph runner
    plugs in): prefill chunks and decode batches arrive as such, with no layer hook when no
    connector asks for one."""
    llm = tiny_llm(max_num_batched_tokens=8)
    seen: list[RunBatch] = []
    orig = llm.engine.runner.execute

    def execute(batch):
        seen.append(batch)
        return orig(batch)

    llm.engine.runner.execute = execute
    out = llm.generate([list(range(20, 33))], SamplingParams(max_tokens=3, **GREEDY))[0]
    assert out.token_ids == alone(model, list(range(20, 33)), 3)
    # 13 tokens: chunks end on the snapshot point 12, so token 12 runs alone, then 2 decodes
    assert [b.num_tokens for b in seen] == [8, 4, 1, 1, 1]
    assert [b.is_decode for b in seen] == [False, False, True, True, True]  # one token per row
    assert all(b.layer_hook is None for b in seen)
    assert llm.engine.stats.num_forwards == len(seen)


def test_prefill_backlog_cap_admits_prompts_fcfs(model):
    """Uncapped, chunks ending on snapshot points leave budget that admits
    every waiting prompt, and all of them share the steps; with ``max_prefill_backlog`` a
    prompt is admitted only while fewer tokens than the cap are left to prefill, so prompts
    are computed nearly one after another, each finishing in about (cap + its length) of
    compute — with the same tokens."""
    rng = random.Random(15)
    prompts = _prompts(rng, 6, 24, 33)
    params = SamplingParams(max_tokens=2, **GREEDY)

    def run(cap):
        llm = tiny_llm(max_num_batched_tokens=16, dense_snapshot_blocks=4)  # 4-token chunks first
        e = llm.engine
        e.scheduler.max_prefill_backlog = cap
        for i, p in enumerate(prompts):
            e.add_request(f"r{i}", p, params)
        most, outs = 0, {}
        while e.has_unfinished_requests():
            for o in e.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0].token_ids
            most = max(most, sum(s.is_prefill for s in e.scheduler.running))
        return most, [outs[f"r{i}"] for i in range(len(prompts))]

    most_uncapped, outs_uncapped = run(None)
    most_capped, outs_capped = run(8)
    assert most_uncapped >= 4  # the failure mode: most of the queue prefilling at once
    assert most_capped <= 2  # one prompt, plus the next once fewer than 8 tokens are left
    assert outs_capped == outs_uncapped == [alone(model, p, 2) for p in prompts]
    with pytest.raises(ValueError, match="max_prefill_backlog"):
        Scheduler(tiny_llm().engine.cm, 16, 4, max_prefill_backlog=0)
