"""Structured outputs: the grammar engine's mask against the plain-torch reference, the
sampler under a mask, and the matcher rebuilt from grammar + generated tokens (the hand-off
and the decode-side fallback) giving the same greedy output as one uninterrupted run."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from k3serve.engine.sampler import SamplingRow, sample
from k3serve.sampling import SamplingParams
from k3serve.structured import (
    GrammarError,
    GrammarVocab,
    json_schema_grammar,
    tool_call_grammar,
)
from k3serve.structured.mask import apply_mask, grammar_mask, reference_mask, unpack_bitmask
from k3serve.tokenizer import ByteTokenizer

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 5}, "unit": {"enum": ["c", "f"]},
    "days": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
             "maxItems": 2}}, "required": ["city", "unit"], "additionalProperties": False}


@pytest.fixture(scope="module")
def vocab():
    return GrammarVocab(ByteTokenizer())


def test_unpack_bitmask_matches_bit_by_bit():
    g = torch.Generator().manual_seed(0)
    raw = [bytes(torch.randint(0, 256, (36,), generator=g).tolist()) for _ in range(3)]
    got = unpack_bitmask(raw, 272)
    want = torch.tensor([[bool(m[v // 8] >> (v % 8) & 1) for v in range(272)] for m in raw])
    assert torch.equal(got, want)


def test_mask_equals_reference_along_a_tool_call(vocab):
    tok = ByteTokenizer()
    g = tool_call_grammar([{"name": "get_weather", "parameters": SCHEMA},
                           {"name": "f", "parameters": None}])
    text = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
            '<|tool_call_argument_begin|>{"city":"Rome","unit":"c","days":[1,2]}'
            '<|tool_call_end|><|tool_call_begin|>functions.f:1<|tool_call_argument_begin|>{}'
            '<|tool_call_end|><|tool_calls_section_end|>')
    ids = tok.encode(text, parse_special=True)
    m = vocab.matcher(g)
    for t in ids:
        fast, ref = grammar_mask([m], 272), reference_mask([m], 272)
        assert torch.equal(fast, ref)
        assert fast[0, t], (t, tok.decode([t], skip_special_tokens=False))
        assert m.consume(t)
    end = grammar_mask([m], 272)[0]
    assert set(end.nonzero()[:, 0].tolist()) == set(tok.stop_token_ids)  # only the stops


def test_matcher_rebuilt_from_generated_tokens_equals_the_stepped_one(vocab):
    tok = ByteTokenizer()
    g = json_schema_grammar(SCHEMA)
    ids = tok.encode('{"city":"Oslo","unit":"f"}')
    stepped = vocab.matcher(g)
    for k, t in enumerate(ids):
        rebuilt = vocab.matcher(g, ids[:k])
        assert torch.equal(grammar_mask([stepped], 272), grammar_mask([rebuilt], 272))
        stepped.consume(t)
    with pytest.raises(GrammarError, match="violates"):
        vocab.matcher(g, tok.encode('{"nope"'))


def test_invalid_grammar_is_a_grammar_error(vocab):
    with pytest.raises(GrammarError):
        vocab.validate(json_schema_grammar({"type": "nosuchtype"}))
    with pytest.raises(GrammarError):
        tool_call_grammar([])


def test_sampler_mask_restricts_choice_and_keeps_raw_logprobs():
    logits = torch.randn(3, 272, generator=torch.Generator().manual_seed(1))
    allowed = torch.zeros(3, 272, dtype=torch.bool)
    allowed[0, [5, 9]] = True
    allowed[1, 200] = True
    allowed[2] = True
    rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=1), 1, 10),
            SamplingRow(SamplingParams(temperature=1.0, logprobs=1), 2, 10),
            SamplingRow(SamplingParams(temperature=0.0, logprobs=1), 3, 10)]
    free = sample(logits, rows)
    got = sample(logits, rows, allowed)
    assert got[0].token_id == (5 if logits[0, 5] > logits[0, 9] else 9)
    assert got[1].token_id == 200
    assert got[2] == free[2]  # an all-true row is unconstrained
    raw = torch.log_softmax(logits, -1)
    assert got[1].logprob == pytest.approx(float(raw[1, 200]))
    with pytest.raises(ValueError, match="allows no token"):
        apply_mask(logits, torch.zeros(3, 272, dtype=torch.bool))


@pytest.fixture(scope="module")
def llm():
    from k3serve import LLM

    return LLM("k3-tiny", block_size=16, num_pages=256)


def _params(grammar: str, n: int = 1) -> SamplingParams:
    tok = ByteTokenizer()
    return SamplingParams(n=n, max_tokens=80, temperature=0.0, grammar=grammar,
                          skip_special_tokens=False, stop_token_ids=tok.stop_token_ids)


def _run(engine, rid, ids, params, outs=()):
    done = engine.add_request(rid, ids, params, output_token_ids=outs)
    while done is None:
        for o in engine.step():
            if o.request_id == rid and o.finished:
                done = o
    return done.outputs[0].token_ids


def test_offline_json_schema_validates_and_continuation_matches(llm):
    tok = ByteTokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "weather"}])
    params = _params(json_schema_grammar(SCHEMA))
    out = llm.generate([ids], params)[0].outputs[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), SCHEMA)
    # the decode-side fallback / admit: continue after tokens #1..k sampled elsewhere
    for k in (1, 2, 7):
        cont = _run(llm.engine, f"cont-{k}", ids, params, out.token_ids[:k])
        assert cont == out.token_ids, k


def test_bad_grammar_rejected_at_admission(llm):
    with pytest.raises(ValueError, match="grammar"):
        llm.engine.add_request("bad", [1, 2, 3], _params("start: %json {\"type\": \"x\"}"))


def test_n2_choices_each_follow_the_grammar(llm):
    g = json_schema_grammar(SCHEMA)
    p = SamplingParams(n=2, max_tokens=80, temperature=1.0, seed=5, grammar=g,
                       stop_token_ids=ByteTokenizer().stop_token_ids)
    outs = llm.generate([[256, 104, 105]], p)[0].outputs
    assert len(outs) == 2
    for o in outs:
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), SCHEMA)
