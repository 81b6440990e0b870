"""Sampling params, the batched sampler and incremental detokenization."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from typing import ClassVar

import pytest
import torch

from k3serve.tokenizer.detok import IncrementalDetokenizer
from k3serve.engine.sampler import (
    SamplingRow,
    apply_penalties,
    row_key,
    sample,
    uniform_noise,
)
from k3serve.sampling import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _logits(n: int, v: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * scale


def _tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    return [r.token_id for r in sample(logits, rows)]


# ============================================================== SamplingParams
@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("repetition_penalty", 0.0),
        ("n", 0),
        ("logprobs", 21),
        ("logprobs", -1),
        ("seed", 1.5),
        ("stop", [""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("ignore_eos", 1),
        ("n", True),
    ],
)
def test_params_validation_names_field(field, value):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}:"):
        SamplingParams(**{field: value})


def test_params_normalise_and_roundtrip_json():
    p = SamplingParams(
        n=2,
        temperature=1,
        top_k=5,
        seed=-7,
        stop="###",
        stop_token_ids=[3, 4],
        logprobs=0,
        max_tokens=None,
    )
    assert p.stop == ("###",) and p.stop_token_ids == (3, 4)
    assert isinstance(p.temperature, float)
    wire = json.loads(json.dumps(p.to_dict()))
    assert SamplingParams.from_dict(wire) == p
    assert SamplingParams.from_dict({}) == SamplingParams()
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams.from_dict({"best_of": 2})
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p"):
        SamplingParams.from_dict({"top_p": 2})
    assert SamplingParams(temperature=0).is_greedy and not p.is_greedy
    assert p.with_seed(5).seed == 5


def test_sampling_and_detok_import_without_torch():
    code = textwrap.dedent("""
        import sys
        sys.modules['torch'] = None  # any 'import torch' now raises ImportError
        import k3serve.sampling as s, k3serve.tokenizer.detok as d
        p = s.SamplingParams(temperature=0.5, stop=['x'])
        assert s.SamplingParams.from_dict(p.to_dict()) == p
        print('ok')
    """)
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


# ============================================================== noise
def _mix32_ref(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_uniform_noise_matches_pure_python_hash():
    keys = [row_key(s, c, p) for s, c, p in [(0, 0, 0), (2**64 - 1, 3, 10**9), (-5, 1, 7)]]
    u = uniform_noise(keys, torch.arange(300))
    for r, key in enumerate(keys):
        k0, k1 = key & 0xFFFFFFFF, key >> 32
        for v in (0, 1, 17, 255, 299):
            h = _mix32_ref(_mix32_ref(v ^ k0) ^ k1)
            assert u[r, v].item() == ((h >> 9) + 0.5) / 2**23


def test_uniform_noise_statistics():
    keys = [row_key(1234, c, p) for c in range(2) for p in range(64)]
    u = uniform_noise(keys, torch.arange(4096)).double()
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.002
    assert abs(u.var().item() - 1 / 12) < 0.001
    # rows (neighbouring positions, the two choices) are uncorrelated
    c = torch.corrcoef(u)
    off = c - torch.eye(len(keys), dtype=c.dtype)
    assert off.abs().max() < 0.08
    # histogram over 16 bins is flat
    hist = torch.histc(u.float(), bins=16, min=0, max=1) / u.numel()
    assert (hist - 1 / 16).abs().max() < 0.003


def test_row_key_rejects_negative_position():
    with pytest.raises(ValueError, match="position"):
        row_key(0, 0, -1)


# ============================================================== sampler
def test_greedy_is_argmax():
    x = _logits(9, 300)
    rows = [SamplingRow(SamplingParams(temperature=0), seed=i, position=i) for i in range(9)]
    assert _tokens(x, rows) == x.argmax(-1).tolist()


def test_same_key_same_token_regardless_of_batch():
    x = _logits(6, 500, scale=1.0)  # flat-ish: many plausible tokens
    params = [
        SamplingParams(temperature=0.9),
        SamplingParams(top_k=50),
        SamplingParams(top_p=0.8),
        SamplingParams(min_p=0.05, temperature=1.3),
        SamplingParams(temperature=0),
        SamplingParams(presence_penalty=1.0),
    ]
    rows = [
        SamplingRow(p, seed=100 + i, position=40 + i, choice=i % 2, output_token_ids=[1, 2, 2])
        for i, p in enumerate(params)
    ]
    base = _tokens(x, rows)

    torch.manual_seed(999)  # the global RNG plays no part
    perm = [3, 0, 5, 1, 4, 2]
    assert _tokens(x[perm], [rows[i] for i in perm]) == [base[i] for i in perm]
    for i in range(6):  # alone
        assert _tokens(x[i : i + 1], [rows[i]]) == [base[i]]
    # inside a bigger batch with unrelated rows around it
    extra = _logits(10, 500, seed=7)
    big = torch.cat([extra[:5], x, extra[5:]])
    other = [SamplingRow(SamplingParams(top_k=3), seed=9, position=j) for j in range(10)]
    got = _tokens(big, other[:5] + rows + other[5:])
    assert got[5:11] == base
    # plain-temperature rows take the full-vocabulary path alone and the sorted-candidate path
    # next to a top-p row: the same tokens either way
    plain = [SamplingRow(SamplingParams(temperature=1.5), seed=3, position=p) for p in range(24)]
    xs = _logits(24, 500, seed=5, scale=0.5)
    alone = _tokens(xs, plain)
    mixed = _tokens(torch.cat([xs, x[2:3]]), [*plain, rows[2]])
    assert mixed[:24] == alone and mixed[24] == base[2]
    # the key really matters: another seed or position changes some tokens
    moved = [r._replace(position=r.position + 1) for r in rows]
    reseeded = [r._replace(seed=r.seed + 1) for r in rows]
    assert _tokens(x, moved) != base or _tokens(x, reseeded) != base


def test_same_key_same_token_in_fresh_process():
    code = textwrap.dedent("""
        import torch
        from k3serve.engine.sampler import SamplingRow, sample
        from k3serve.sampling import SamplingParams
        x = torch.randn(32, 400, generator=torch.Generator().manual_seed(3))
        rows = [SamplingRow(SamplingParams(temperature=1.0, top_p=0.95), seed=77, position=p,
                            choice=p % 3) for p in range(32)]
        print([r.token_id for r in sample(x, rows)])
    """)
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    x = torch.randn(32, 400, generator=torch.Generator().manual_seed(3))
    rows = [
        SamplingRow(SamplingParams(temperature=1.0, top_p=0.95), seed=77, position=p, choice=p % 3)
        for p in range(32)
    ]
    assert json.loads(res.stdout) == _tokens(x, rows)


def test_choices_are_different_streams():
    v, steps = 1000, 64
    x = torch.zeros(steps, v)  # uniform distribution: every token equally likely
    p = SamplingParams(n=2, seed=5)
    streams = [
        _tokens(x, [SamplingRow(p, seed=5, position=t, choice=c) for t in range(steps)])
        for c in (0, 1)
    ]
    same = sum(a == b for a, b in zip(*streams))
    assert same <= 3  # ~0.064 expected coincidences
    assert len(set(streams[0])) > 55  # and each stream itself looks random
    again = _tokens(x, [SamplingRow(p, seed=5, position=t, choice=0) for t in range(steps)])
    assert again == streams[0]


def _freqs(x_row: torch.Tensor, params: SamplingParams, draws: int = 6000) -> torch.Tensor:
    x = x_row.expand(draws, -1)
    toks = _tokens(x, [SamplingRow(params, seed=11, position=t) for t in range(draws)])
    return torch.bincount(torch.tensor(toks), minlength=x.shape[1]).double() / draws


def test_distribution_temperature_topk_topp_minp():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    x = probs.log()
    tol = 0.025
    f = _freqs(x, SamplingParams(temperature=1.0))
    assert (f - probs.double()).abs().max() < tol
    t = torch.softmax(x / 0.5, -1).double()
    assert (_freqs(x, SamplingParams(temperature=0.5)) - t).abs().max() < tol
    # top-k 2 → renormalised top two
    f = _freqs(x, SamplingParams(top_k=2))
    assert f[2:].sum() == 0 and abs(f[0].item() - 0.625) < tol
    # top-p 0.7: mass before token 1 is 0.5 < 0.7 (kept), before token 2 is 0.8 (dropped)
    f = _freqs(x, SamplingParams(top_p=0.7))
    assert f[2:].sum() == 0 and f[1] > 0.3
    # top-p 0.85 keeps three tokens
    f = _freqs(x, SamplingParams(top_p=0.85))
    assert f[3] == 0 and f[2] > 0.1
    # top-p boundary: with 4 equally likely tokens and top_p 0.5, the third token has exactly
    # 0.5 of mass before it and is dropped
    f = _freqs(torch.zeros(4), SamplingParams(top_p=0.5), draws=400)
    assert f[2:].sum() == 0 and f[0] > 0.3 and f[1] > 0.3
    # min-p 0.2: threshold 0.1 drops only token 3
    f = _freqs(x, SamplingParams(min_p=0.2))
    assert f[3] == 0 and abs(f[2].item() - 0.15 / 0.95) < tol


def test_topk1_and_tiny_topp_equal_greedy():
    x = _logits(16, 700, seed=4, scale=0.5)
    greedy = x.argmax(-1).tolist()
    for p in (
        SamplingParams(top_k=1, temperature=2.0),
        SamplingParams(top_p=1e-6, temperature=2.0),
        SamplingParams(top_k=1, top_p=0.3, min_p=0.1),
    ):
        rows = [SamplingRow(p, seed=s, position=3 * s) for s in range(16)]
        assert _tokens(x, rows) == greedy


def test_penalties_follow_formula_exactly():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.25, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    p0 = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5)
    rows = [
        SamplingRow(p0, seed=0, position=9, output_token_ids=[3, 3, 1, 3], prompt_token_ids=[0, 4]),
        SamplingRow(SamplingParams(), seed=0, position=9, output_token_ids=[2]),
    ]
    got = apply_penalties(x, rows)
    r = 1.5
    exp0 = [2.0 / r, -1.0 * r - 0.25 * 1 - 0.5, 0.5, 3.0 / r - 0.25 * 3 - 0.5, -0.25 * r, 0.0]
    assert torch.equal(got[0], torch.tensor(exp0))
    assert torch.equal(got[1], x[1])  # no penalty on this row
    assert torch.equal(x[0], torch.tensor([2.0, -1.0, 0.5, 3.0, -0.25, 0.0]))  # input untouched
    # greedy decoding sees the penalised logits
    pg = SamplingParams(temperature=0, frequency_penalty=2.0)
    row = SamplingRow(pg, seed=0, position=0, output_token_ids=[3])
    assert _tokens(x[:1], [row]) == [0]
    assert _tokens(x[:1], [row._replace(params=SamplingParams(temperature=0))]) == [3]
    with pytest.raises(ValueError, match="output token id"):
        apply_penalties(x, [rows[0]._replace(output_token_ids=[6]), rows[1]])


def test_logprobs_are_raw_log_softmax():
    x = _logits(5, 200, seed=8)
    ps = [
        SamplingParams(logprobs=5, temperature=0.7, presence_penalty=1.5),
        SamplingParams(logprobs=0),
        SamplingParams(),
        SamplingParams(logprobs=20, top_k=4, temperature=0),
        SamplingParams(logprobs=1, repetition_penalty=2.0),
    ]
    rows = [
        SamplingRow(p, seed=i, position=i, output_token_ids=[0, 1], prompt_token_ids=[2])
        for i, p in enumerate(ps)
    ]
    out = sample(x, rows)
    ref = torch.log_softmax(x.double(), -1)
    for i, (res, p) in enumerate(zip(out, ps)):
        assert abs(res.logprob - ref[i, res.token_id].item()) < 1e-5
        if p.logprobs is None:
            assert res.top_logprobs is None
            continue
        assert len(res.top_logprobs) == p.logprobs
        vals, ids = ref[i].topk(p.logprobs)
        assert [t for t, _ in res.top_logprobs] == ids.tolist()
        assert all(abs(lp - v) < 1e-5 for (_, lp), v in zip(res.top_logprobs, vals.tolist()))


def test_sample_rejects_shape_mismatch():
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        sample(torch.zeros(3, 10), [SamplingRow(SamplingParams(), seed=0, position=0)])


# ============================================================== detokenizer
class FakeByteTokenizer:
    """ids < 256 are bytes; 256.. are specials; 300.. are multi-byte merges."""

    SPECIAL: ClassVar[dict[int, str]] = {256: "<s>", 257: "</s>"}
    MERGES: ClassVar[dict[int, bytes]] = {
        300: b"ST",
        301: b"OP he",
        302: b"\xe4\xb8",
        303: b"\x96!",
        304: b"xabcd",
    }

    def decode(self, ids):
        out, buf = [], bytearray()
        for i in ids:
            if i in self.SPECIAL:
                out.append(buf.decode("utf-8", "replace"))
                buf = bytearray()
                out.append(self.SPECIAL[i])
            else:
                buf += bytes([i]) if i < 256 else self.MERGES[i]
        out.append(buf.decode("utf-8", "replace"))
        return "".join(out)


TOK = FakeByteTokenizer()
EOS = 257


def _detok(params: SamplingParams, **kw) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(TOK, params, eos_token_id=EOS, special_token_ids=(256, 257), **kw)


def _run(params: SamplingParams, ids, **kw):
    d = _detok(params, **kw)
    pieces = []
    for t in ids:
        out = d.step(t)
        pieces.append(out.new_text)
        if out.finished:
            break
    return pieces, d


def test_detok_multibyte_utf8_split_across_tokens():
    text = "héllo 世界 🙂!"
    ids = list(text.encode())
    pieces, d = _run(SamplingParams(max_tokens=100), ids)
    assert "".join(pieces) == text and d.text == text
    assert all("\ufffd" not in p for p in pieces)
    # the 4-byte emoji appears only at its last byte, whole
    k = ids.index(0xF0)
    assert pieces[k : k + 3] == ["", "", ""] and pieces[k + 3] == "🙂"
    # a merge token carrying a partial character
    pieces, d = _run(SamplingParams(), [ord("a"), 302, 303])
    assert pieces == ["a", "", "世!"]


def test_detok_length_finish_flushes_partial_character():
    ids = list("ok世".encode())[:-1]  # cut inside 世
    pieces, d = _run(SamplingParams(max_tokens=len(ids)), ids)
    assert d.finish_reason == "length" and d.finished
    assert "".join(pieces) == TOK.decode(ids) == "ok\ufffd"
    # an engine-side cap below params.max_tokens also ends with "length"
    _, d = _run(SamplingParams(max_tokens=50), list(b"abcdef"), max_tokens=3)
    assert d.text == "abc" and d.finish_reason == "length" and d.token_ids == list(b"abc")


def test_detok_stop_string_split_across_tokens():
    ids = list(b"Hello, ") + [300, 301] + list(b"llo")  # "ST" + "OP he": stop spans two tokens
    pieces, d = _run(SamplingParams(stop=["STOP"]), ids)
    assert d.finish_reason == "stop" and d.stop_reason == "STOP"
    assert "".join(pieces) == d.text == "Hello, "
    assert pieces[-2:] == ["", ""]  # "ST" was held back, then the stop cut everything
    pieces, d = _run(SamplingParams(stop=["STOP"], include_stop_str_in_output=True), ids)
    assert "".join(pieces) == d.text == "Hello, STOP"  # " he" after the stop is dropped
    assert d.token_ids == ids[:9]


def test_detok_holdback_released_on_false_start():
    pieces, d = _run(SamplingParams(stop=["STOP"], max_tokens=100), list(b"a STx"))
    assert pieces == ["a", " ", "", "", "STx"]
    assert not d.finished


def test_detok_finish_releases_held_back_text():
    """A stream that ends abnormally (the producer aborted, hit its own limit) used to lose
    the held-back text: a suffix that might start a stop string, and a partial character."""
    pieces, d = _run(SamplingParams(stop=["STOP"], max_tokens=100), list(b"a ST"))
    assert "".join(pieces) == "a " and d.text == "a " and not d.finished
    out = d.finish("abort")
    assert out == ("ST", True, "abort")
    assert d.text == "a ST" and d.finish_reason == "abort" and d.stop_reason is None
    assert d.finish("length") == ("", True, "abort")  # idempotent: the first reason stays
    # a partial character is flushed as decoded; the reason is the caller's
    pieces, d = _run(SamplingParams(max_tokens=100), [ord("o"), ord("k"), 302])
    assert "".join(pieces) == "ok"
    assert d.finish("length") == ("\ufffd", True, "length") and d.text == "ok\ufffd"
    # nothing held back: no text, the reason recorded
    _, d = _run(SamplingParams(max_tokens=100), list(b"abc"))
    assert d.finish() == ("", True, "abort") and d.text == "abc"
    with pytest.raises(RuntimeError):
        d.step(ord("x"))
    # a finished choice keeps its reason and text
    _, d = _run(SamplingParams(max_tokens=2), list(b"abc"))
    assert d.finish("abort") == ("", True, "length") and d.text == "ab"


def test_detok_earliest_completed_stop_wins():
    _, d = _run(SamplingParams(stop=["abcd", "bc"]), list(b"xabcd"))
    assert d.text == "xa" and d.stop_reason == "bc"
    _, d = _run(SamplingParams(stop=["abcd", "bc"]), [304])  # both inside one token
    assert d.text == "xa" and d.stop_reason == "bc"
    _, d = _run(SamplingParams(stop=["bc", "abc"]), list(b"xabc"))
    assert d.text == "x" and d.stop_reason == "abc"  # both end together: the longer one


def test_detok_stop_tokens_eos_and_specials():
    _, d = _run(SamplingParams(), list(b"hi") + [EOS] + list(b"more"))
    assert d.text == "hi" and d.finish_reason == "stop" and d.stop_reason == EOS
    assert d.token_ids == [ord("h"), ord("i"), EOS]
    _, d = _run(SamplingParams(ignore_eos=True, max_tokens=5), list(b"hi") + [EOS] + list(b"mo"))
    assert d.text == "himo" and d.finish_reason == "length"
    _, d = _run(
        SamplingParams(ignore_eos=True, max_tokens=5, skip_special_tokens=False),
        list(b"hi") + [EOS] + list(b"mo"),
    )
    assert d.text == "hi</s>mo"
    _, d = _run(SamplingParams(stop_token_ids=[ord("!")]), list(b"yes!no"))
    assert d.text == "yes" and d.stop_reason == ord("!")
    _, d = _run(
        SamplingParams(stop_token_ids=[ord("!")], include_stop_str_in_output=True), list(b"yes!no")
    )
    assert d.text == "yes!"
    # a stop token right after a partial character flushes it
    _, d = _run(SamplingParams(), list("世".encode())[:2] + [EOS])
    assert d.text == "\ufffd" and d.finish_reason == "stop"
    with pytest.raises(RuntimeError):
        d.step(1)


def test_detok_with_project_byte_tokenizer():
    byte = pytest.importorskip("k3serve.tokenizer.byte")
    tok = byte.ByteTokenizer()
    ids = tok.encode("a<|im_end|>é", parse_special=True)
    for skip, want in ((True, "aé"), (False, "a<|im_end|>é")):
        d = IncrementalDetokenizer(
            tok,
            SamplingParams(skip_special_tokens=skip, max_tokens=50),
            eos_token_id=tok.eos_token_id,
        )
        pieces = [d.step(t).new_text for t in ids]
        assert "".join(pieces) == want and pieces[-2] == ""  # é's first byte held back
    d = IncrementalDetokenizer(tok, SamplingParams(), eos_token_id=tok.eos_token_id)
    assert d.update([*ids, tok.eos_token_id]) == ("aé", True, "stop")


def test_detok_update_matches_steps():
    ids = list("naïve STOP x".encode())
    d1 = _detok(SamplingParams(stop=["STOP"]))
    out = d1.update(ids)
    assert out == (d1.text, True, "stop") and d1.text == "naïve "


def _reference_text(ids: list[int], stops: list[str]) -> tuple[str, bool]:
    full = TOK.decode(ids)
    best = None
    for s in stops:
        i = full.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < (best[1], best[0])):
            best = (i, i + len(s))
    return (full, False) if best is None else (full[: best[0]], True)


def test_detok_random_streams_match_reference():
    rng = random.Random(0)
    alphabet = list(b"ab ") + list("é世".encode())
    for _ in range(300):
        ids = [rng.choice(alphabet) for _ in range(rng.randint(1, 30))]
        stops = [
            "".join(rng.choice("ab é") for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(0, 3))
        ]
        pieces, d = _run(SamplingParams(stop=stops, max_tokens=len(ids)), ids)
        # reference: stop search over the text of the tokens consumed so far
        ref, stopped = _reference_text(d.token_ids, stops)
        assert d.finished
        assert "".join(pieces) == d.text == ref, (ids, stops)
        assert (d.finish_reason == "stop") == stopped
