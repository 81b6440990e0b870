"""Regressions of the engine, the cache and the offline API.

Each test names the bug it pins; the micro model and helpers come from ``test_engine``.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_engine import GREEDY, MICRO, alone, tiny_llm

from k3serve.engine.config import EngineConfig
from k3serve.engine.connector import DisaggConnector
from k3serve.engine.engine import LLMEngine
from k3serve.engine.llm import LLM, load_model
from k3serve.sampling import SamplingParams

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    return load_model(MICRO)[0]


class _Boom(Exception):
    pass


def _fail_once_mid_forward(eng: LLMEngine, which, at_layer: int = 2) -> None:
    """Make one forward of the engine raise after ``at_layer`` wrote its cache: the slots of its
    sequences are then part-way updated (a transfer hook failing, a KeyboardInterrupt).

    ``which``: the forward's 1-based number, or a predicate on its rows."""
    orig = eng.runner.forward
    calls = {"n": 0, "failed": False}

    def forward(rows, layer_hook=None):
        calls["n"] += 1
        hit = which(rows) if callable(which) else calls["n"] == which
        if calls["failed"] or not hit:
            return orig(rows, layer_hook)
        calls["failed"] = True

        def hook(layer: int) -> None:
            if layer_hook is not None:
                layer_hook(layer)
            if layer == at_layer:
                raise _Boom("simulated failure mid-forward")

        return orig(rows, hook)

    eng.runner.forward = forward


def test_failed_forward_neither_corrupts_the_request_nor_poisons_the_prefix_cache(model):
    """A forward that raised part-way left the KDA states of its sequences half-advanced; the
    next step re-ran the chunk from that state, so the request gave wrong tokens and the blocks
    and snapshot it indexed (under the right hashes) served wrong latents to later hits."""
    prompt = list(range(60, 79))  # 19 tokens; chunks of 8: [0,8) [8,16) (snapshot at 16) [16,19)
    expect = alone(model, prompt, 4)
    llm = tiny_llm(max_num_batched_tokens=8)
    eng = llm.engine
    _fail_once_mid_forward(eng, which=2)  # the chunk [8, 16): two full blocks + the snapshot
    sp = SamplingParams(max_tokens=4, **GREEDY)
    eng.add_request("a", prompt, sp)
    with pytest.raises(_Boom):
        while True:
            eng.step()
    eng.cm.check()
    done = None
    while done is None:
        done = next((o for o in eng.step() if o.finished), None)
    assert done.token_ids == expect
    again = llm.generate([prompt], sp)[0]
    assert again.num_cached_tokens == 16  # the snapshot at ⌊18/4⌋·4 is used …
    assert again.token_ids == expect  # … and it is the right one
    eng.cm.check()
    assert eng.cm.usage().pages_used == 0 and eng.cm.usage().slots_used == 0


def test_failed_decode_forward_keeps_the_prefills_of_the_same_step(model):
    """The prefill group's rows were sampled only after the decode group's forward: when that
    one raised, a finished prefill was never sampled and the sequence stalled forever."""
    p1, p2 = list(range(10, 17)), [30, 31, 32]  # b: one chunk, sampled this step
    llm = tiny_llm(max_num_batched_tokens=16)
    eng = llm.engine
    sp = SamplingParams(max_tokens=3, **GREEDY)
    eng.add_request("a", p1, sp)
    while not eng.requests["a"].seqs[0].output_token_ids:
        eng.step()  # a: prefill + token #1
    eng.add_request("b", p2, sp)
    # next step: b's prefill chunk runs fine, then a's decode forward fails
    _fail_once_mid_forward(eng, lambda rows: len(rows[0].token_ids) == 1, at_layer=0)
    with pytest.raises(_Boom):
        eng.step()
    assert eng.requests["b"].seqs[0].num_computed == 3  # b computed its prompt, unsampled
    outs = {}
    for _ in range(50):
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
        if not eng.has_unfinished_requests():
            break
    assert outs == {"a": alone(model, p1, 3), "b": alone(model, p2, 3)}
    eng.cm.check()


def test_interrupted_generate_leaves_no_orphan_requests():
    """LLM.generate interrupted mid-way left its requests queued in the engine: later calls
    kept computing them (and their half-done state) for nobody."""
    llm = tiny_llm(max_num_batched_tokens=8)
    eng = llm.engine
    _fail_once_mid_forward(eng, which=2)
    with pytest.raises(_Boom):
        llm.generate([list(range(60, 79)), [5, 6, 7]], SamplingParams(max_tokens=4, **GREEDY))
    assert eng.requests == {} and eng.cm.seq_ids() == []
    assert not eng.scheduler.waiting and not eng.scheduler.running
    u = eng.cm.usage()
    assert (u.pages_used, u.slots_used, u.snapshots_used) == (0, 0, 0)
    eng.cm.check()


def test_generate_rejects_malformed_prompts_with_value_error_naming_prompts():
    llm = tiny_llm()
    for bad in (None, 5, [None], [3.5], ["ok", 7], "a\ud800b", [["x"]]):
        with pytest.raises(ValueError, match="prompt"):
            llm.generate(bad, SamplingParams(max_tokens=1))
    assert llm.engine.requests == {} and llm.engine.cm.seq_ids() == []
    # array-likes of ids are prompts too (one prompt, or one per row)
    sp = SamplingParams(max_tokens=2, **GREEDY)
    ref = llm.generate([[1, 2, 3]], sp)[0].token_ids
    assert llm.generate(np.array([1, 2, 3]), sp)[0].token_ids == ref
    assert llm.generate((np.int64(1), np.int64(2), np.int64(3)), sp)[0].token_ids == ref
    assert [o.token_ids for o in llm.generate(torch.tensor([[1, 2, 3]] * 2), sp)] == [ref, ref]


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_model_len", 0),
        ("max_model_len", -5),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("num_pages", 0),
        ("num_slots", 0),
        ("num_snapshots", -1),
        ("block_size", 0),
        ("max_events", 0),
        ("snapshot_interval_tokens", -4),
        ("rolling_snapshot_fraction", 1.5),
        ("rolling_snapshot_fraction", -0.1),
    ],
)
def test_engine_config_rejects_bad_values_naming_the_field(field, value):
    """max_model_len=0 and max_num_seqs=0 were silently read as "unset"; a negative
    max_model_len rejected every prompt with a message about the prompt."""
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_reserve_for_fewer_tokens_than_the_prompt_is_refused(model):
    """A reservation of num_tokens < L could never be admitted (admit needs L + outputs - 1
    tokens): it held a slot and pages until someone aborted it."""
    eng = LLMEngine(model, MICRO, None, EngineConfig(block_size=4, num_pages=16, num_slots=2))
    dk = DisaggConnector.of(eng)
    with pytest.raises(ValueError, match="num_tokens"):
        dk.reserve("r", [1, 2, 3, 4, 5], num_tokens=3)
    assert eng.cm.usage().slots_used == 0 and eng.cm.seq_ids() == []
    h = dk.reserve("r", [1, 2, 3, 4, 5], num_tokens=6)  # prompt + token #1 + token #2
    assert h.num_tokens == 6
    assert eng.abort_request("r") and eng.cm.usage().pages_used == 0


def test_on_admit_may_abort_requests(model):
    """A sender that cannot start its transfer aborts the request from ``on_admit``: the step
    then crashed on the aborted sequence (``seq_id … is not registered``) and took the other
    requests of the step down with it."""
    eng = LLMEngine(
        model,
        MICRO,
        None,
        EngineConfig(block_size=4, num_pages=32, num_slots=4, num_snapshots=4),
    )
    sp = SamplingParams(max_tokens=3, **GREEDY)
    pk = DisaggConnector.of(eng)
    eng.add_request("g", [1, 2, 3, 4, 5], sp)
    pk.add_prefill_request("p", list(range(20, 31)), sp, on_admit=lambda h: eng.abort_request("p"))
    pk.add_prefill_request("q", list(range(40, 46)), sp, on_admit=lambda h: eng.abort_request("g"))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert {o.request_id for o in outs} == {"q"} and outs[-1].handle.first_token is not None
    assert outs[-1].handle.first_token.token_id == alone(model, list(range(40, 46)), 1)[0]
    pk.release("q")
    eng.cm.check()
    u = eng.cm.usage()
    assert (u.pages_used, u.slots_used, u.snapshots_used) == (0, 0, 0) and eng.requests == {}


def test_layer_hook_may_abort_requests(model):
    """Aborting from a layer hook (the transfer failed) made the commit after the forward crash
    on the aborted sequence (``seq_id … is not registered``), taking the step down."""
    eng = LLMEngine(
        model,
        MICRO,
        None,
        EngineConfig(block_size=4, num_pages=32, num_slots=4, num_snapshots=4),
    )
    sp = SamplingParams(max_tokens=3, **GREEDY)
    eng.add_request("g", [1, 2, 3], sp)

    def hook(layer: int, upto: int) -> None:
        if layer == 1:
            assert eng.abort_request("p")

    DisaggConnector.of(eng).add_prefill_request("p", list(range(20, 23)), sp, layer_hook=hook)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
    assert set(outs) == {"g"} and outs["g"].token_ids == alone(model, [1, 2, 3], 3)
    eng.cm.check()
    u = eng.cm.usage()
    assert (u.pages_used, u.slots_used, u.snapshots_used) == (0, 0, 0) and eng.requests == {}


def _drain(eng: LLMEngine) -> dict:
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def test_add_request_continues_after_given_output_tokens(model):
    """The decode worker's fallback after a failed transfer recomputed the prompt and sampled
    its own token #1, trusting (seed, position) sampling to reproduce the prefill worker's —
    which the client already had. ``add_request(output_token_ids=[t1])`` continues from the
    given token instead: prefill over prompt + t1, sampling from position L + 1, t1 counted as
    output #1 and never re-sampled."""
    eng = LLMEngine(
        model, MICRO, None, EngineConfig(block_size=4, num_pages=64, num_slots=4, num_snapshots=8)
    )
    prompt = list(range(60, 73))  # 13 tokens
    natural = alone(model, prompt, 1)[0]
    forced = (natural + 7) % MICRO.vocab_size  # a token the model would not pick
    sp = SamplingParams(max_tokens=4, temperature=0.8, seed=5, ignore_eos=True)
    given = eng.add_request("f", prompt, sp, output_token_ids=[forced], output_logprobs=[-1.5])
    assert given is None  # it runs
    assert eng.requests["f"].seqs[0].output_token_ids == [forced]
    out = _drain(eng)["f"]
    # the same as running prompt + forced by hand with the same seed: positions L+1, L+2, …
    assert out.token_ids == [forced] + alone(model, prompt + [forced], 3, sp, seed=5)
    assert out.outputs[0].logprobs[0] == -1.5 and len(out.outputs[0].logprobs) == 4
    assert out.finish_reason == "length"  # max_tokens counted the given token
    # given the token the engine itself samples, it is the plain request, penalties included
    sp2 = SamplingParams(
        max_tokens=5, temperature=0.9, seed=11, presence_penalty=2.0, frequency_penalty=1.5
    )
    eng.add_request("plain", prompt, sp2)
    plain = _drain(eng)["plain"]
    eng.add_request("given", prompt, sp2, output_token_ids=plain.token_ids[:1])
    assert _drain(eng)["given"].token_ids == plain.token_ids
    # a given token that ends the request: finished at once, nothing kept
    done = eng.add_request(
        "stop", prompt, SamplingParams(stop_token_ids=[forced]), output_token_ids=[forced]
    )
    assert done.finished and done.finish_reason == "stop" and done.token_ids == [forced]
    done = eng.add_request("len", prompt, SamplingParams(max_tokens=1), output_token_ids=[5])
    assert done.finish_reason == "length"
    for bad, kw in (
        ("SamplingParams.n", {"params": SamplingParams(n=2), "output_token_ids": [5]}),
        ("output_token_ids", {"output_token_ids": [MICRO.vocab_size]}),
        ("output_token_ids", {"params": SamplingParams(max_tokens=1), "output_token_ids": [5, 6]}),
    ):
        with pytest.raises(ValueError, match=bad):
            eng.add_request("bad", prompt, **kw)
    assert eng.requests == {} and eng.cm.seq_ids() == []
    eng.cm.check()


def test_prefix_queries_count_lookups_only():
    """``CacheManager.admit`` counted a decode reservation and every re-admission after a
    preemption as a prefix-cache query (its prompt tokens again)."""
    rng = random.Random(4)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(20, 30))] for _ in range(6)]
    llm = tiny_llm(num_pages=12, num_slots=4, num_snapshots=2, max_num_batched_tokens=16)
    eng = llm.engine
    llm.generate(prompts, SamplingParams(max_tokens=10, **GREEDY))
    assert eng.scheduler.num_preemptions > 0
    st = eng.cm.stats
    assert st.num_queries == 6 and st.query_tokens == sum(map(len, prompts))
    dk = DisaggConnector.of(eng)
    dk.reserve("r", prompts[0])
    assert dk.num_reserved == 1 and st.num_queries == 6
    assert eng.abort_request("r") and dk.num_reserved == 0


def test_fingerprint_tells_checkpoints_of_the_same_shape_apart(tmp_path):
    """The layout fingerprint (the block-hash salt and the kvstore pairing check) covered only
    the shape: two different checkpoints of one shape shared block hashes, so a router could
    send a prompt to a worker whose cache holds another model's latents for it."""
    import shutil

    from k3serve.model.checkpoint_files import checkpoint_identity
    from k3serve.model.checkpoint_save import save_checkpoint
    from kvstore.descriptors import PoolLayout, fingerprint_diff

    for seed in (3, 4):
        net, cfg, _ = load_model(MICRO, seed=seed)
        save_checkpoint(net, str(tmp_path / f"s{seed}"), cfg)
    shutil.copytree(tmp_path / "s3", tmp_path / "copy")
    kw = {"block_size": 4, "num_pages": 16}
    e3, e4, copy = (LLM(str(tmp_path / n), **kw).engine for n in ("s3", "s4", "copy"))
    assert e3.weights_id == checkpoint_identity(tmp_path / "s3") == copy.weights_id
    assert e3.fingerprint == copy.fingerprint  # deterministic, path-independent
    assert e3.fingerprint != e4.fingerprint
    r3, r4 = (LLM(MICRO, seed=s, **kw).engine for s in (3, 4))  # random init: the seed
    assert len({r3.fingerprint, r4.fingerprint, e3.fingerprint}) == 3
    assert r3.fingerprint == LLM(MICRO, seed=3, **kw).engine.fingerprint
    # the pairing check compares the same fields (the workers build their PoolLayout so)
    l3, l4 = (PoolLayout.from_kvpools(e.pools, extra=e.fingerprint_fields) for e in (e3, e4))
    diffs = fingerprint_diff(l3.fingerprint(), l4.fingerprint())
    assert len(diffs) == 1 and diffs[0].startswith("extra.weights: ")
    assert e3.info()["weights_id"] == e3.weights_id


def test_failed_forward_aborts_a_prefill_only_request_instead_of_recomputing_it(model):
    """A prefill-only request whose forward raised part-way (its transfer hook failed) must not
    be recomputed: a sender already holds its pages. The connector aborts it; a plain request
    of the same forward is preempted and still gives its tokens."""
    eng = LLMEngine(
        model, MICRO, None, EngineConfig(block_size=4, num_pages=32, num_slots=4, num_snapshots=4)
    )
    sp = SamplingParams(max_tokens=3, **GREEDY)
    calls = []

    def hook(layer: int, upto: int) -> None:
        calls.append(layer)
        if layer == 1:
            raise _Boom("transfer failed")

    eng.add_request("g", [1, 2, 3], sp)
    DisaggConnector.of(eng).add_prefill_request("p", list(range(20, 27)), sp, layer_hook=hook)
    with pytest.raises(_Boom):
        eng.step()
    assert calls == [0, 1] and "p" not in eng.requests
    assert eng.requests["g"].seqs[0].num_computed == 0  # preempted: recomputed from scratch
    assert _drain(eng)["g"].token_ids == alone(model, [1, 2, 3], 3)
    eng.cm.check()
    u = eng.cm.usage()
    assert (u.pages_used, u.slots_used) == (0, 0) and eng.requests == {}
