"""Admission by cost (router/admission.py): a request costs its choices and its tokens
(prompt + ``max_tokens`` per choice); the 400 is judged against the capacity the registered
decode workers announced, a capacity short for now answers 503 + ``Retry-After``; the admitted
cost never passes twice the limit, however many keys.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from deploy.fake_stack import Stack
from deploy.fake_workers import MODEL
from router.admission import Admission, Cost, DecodeCapacity
from router.errors import APIError


def _adm(slots: int, max_queued: int, kv_tokens: int = 1 << 40, **kw) -> Admission:
    return Admission(lambda: DecodeCapacity(slots, kv_tokens), max_queued=max_queued,
                     retry_after_s=1, **kw)


def _wait(cond, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# ----------------------------------------------------------------------------- tokens
def test_a_key_of_few_huge_requests_and_a_key_of_many_small_ones_are_limited_by_tokens():
    adm = _adm(100, 100, max_tokens=1000)  # 200 choices: never the binding part here
    huge, small = Cost(1, 400), Cost(1, 10)
    a = [adm.admit(huge, "key0") for _ in range(2)]
    with pytest.raises(APIError) as e:  # 1,200 tokens > 1,000: two choices are enough
        adm.admit(huge, "key0")
    assert e.value.status == 429 and e.value.retry_after == 1
    assert "800 tokens admitted" in e.value.message and "1000 tokens" in e.value.message
    b = []
    with pytest.raises(APIError) as e:
        while True:
            b.append(adm.admit(small, "key1"))
    assert e.value.status == 429
    # key1's share is 500 tokens (two keys): 50 requests of 10, beside key0's 2 of 400
    assert len(b) == 50 and adm.by_key == {"key0": Cost(2, 800), "key1": Cost(50, 500)}
    assert adm.admitted == 52 and adm.admitted_tokens == 1300
    with pytest.raises(APIError):
        adm.admit(huge, "key0")  # past the limit and past key0's share (500)
    for t in b[:30]:
        t.release()
    assert adm.admitted_tokens == 1000
    with pytest.raises(APIError):
        adm.admit(huge, "key0")  # the total has room for no 400 more, nor has key0's share
    for t in b[30:] + a:
        t.release()
    assert adm.admitted == 0 and adm.admitted_tokens == 0 and adm.by_key == {}
    assert [adm.admit(huge, "key0") for _ in range(2)]  # the limit whole again


def test_a_request_past_the_token_limit_is_400_too_many_tokens():
    adm = _adm(8, 16, kv_tokens=4096)  # default token limit: 4,096 × (8 + 16) / 8 = 12,288
    assert adm.limit(DecodeCapacity(8, 4096)) == Cost(24, 12_288)
    with pytest.raises(APIError) as e:
        adm.admit(Cost(4, 12_289))
    err = e.value.body()["error"]
    assert e.value.status == 400 and err["code"] == "too_many_tokens"
    assert err["param"] == "max_tokens" and "12289" in err["message"] and "12288" in err["message"]
    assert adm.admit(Cost(4, 12_288)).cost == Cost(4, 12_288)
    with pytest.raises(ValueError, match="max_tokens"):
        _adm(8, 16, max_tokens=0)


# ----------------------------------------------------------------------------- the bound
def test_the_admitted_cost_never_passes_twice_the_limit_with_many_keys():
    adm = _adm(8, 16, max_tokens=2400)
    limit = adm.limit(DecodeCapacity(8, 0))
    assert limit == Cost(24, 2400)
    rng = random.Random(7)
    held: list = []
    refused = admitted_over_limit = 0
    for step in range(4000):
        if held and rng.random() < 0.3:
            held.pop(rng.randrange(len(held))).release()
        else:
            key = f"key{rng.randrange(8)}"
            cost = Cost(rng.randint(1, 4), rng.randint(10, 400))
            try:
                held.append(adm.admit(cost, key))
            except APIError as e:
                assert e.status == 429
                refused += 1
        assert adm.total.fits(Cost(2 * limit.choices, 2 * limit.tokens)), (step, adm.total)
        admitted_over_limit += not adm.total.fits(limit)
    assert refused and admitted_over_limit  # the shares were used past the limit, bounded

    # one key fills the limit, then seven more keys each ask for their share: the first ones
    # get it, the total stops at twice the limit, the later keys wait (429)
    adm2 = _adm(8, 16, max_tokens=2400)
    flood = [adm2.admit(Cost(1, 100), "key0") for _ in range(24)]
    got = {}
    for k in range(1, 8):
        got[k] = 0
        with pytest.raises(APIError):
            while True:
                adm2.admit(Cost(1, 100), f"key{k}")
                got[k] += 1
        assert adm2.total.fits(Cost(48, 4800)), adm2.total
    assert got[1] == 12 and got[2] == 8 and adm2.total.choices <= 48  # shares of 2, 3 keys
    assert sum(got.values()) == 24  # exactly the second half of the bound
    for t in flood:
        t.release()


# ----------------------------------------------------------------------------- live vs configured
def test_a_stopped_decode_worker_turns_a_valid_request_into_503_not_400():
    """Two fake decode workers of 8 slots, ``max_queued`` 4: the configured limit is 20
    choices. With one hung (its polls unanswered) only 12 are usable: a request of 16 choices
    is 503 + ``Retry-After`` (it fits once the worker is back), one of 22 is still 400."""
    s = Stack(num_prefill=1, num_decode=2, api_key=None, max_queued=4, poll_timeout_s=0.2,
              unhealthy_after=2)
    _, (d1, _) = s.decode
    body16 = {"model": MODEL, "prompt": "within", "n": 16, "max_tokens": 4}
    body22 = {"model": MODEL, "prompt": ["over a", "over b"], "n": 11, "max_tokens": 4}
    try:
        d1.stalled = True  # hung: answers nothing, polls included
        _wait(lambda: s.health()["num_decode_healthy"] == 1, what="the hung worker out")
        r = s.post("/v1/completions", body16, key=None)
        assert r.status_code == 503, r.text
        assert r.headers.get("retry-after") == "1"
        err = r.json()["error"]
        assert err["code"] == "overloaded" and "8 of 16 decode slots" in err["message"]
        r = s.post("/v1/completions", body22, key=None)
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_choices", r.text
        assert "20" in r.json()["error"]["message"]
        d1.stalled = False
        _wait(lambda: s.health()["num_decode_healthy"] == 2, timeout=20, what="it back")
        r = s.post("/v1/completions", body16, key=None)
        assert r.status_code == 200 and len(r.json()["choices"]) == 16, r.text
        assert s.router.admission.admitted == 0
    finally:
        d1.stalled = False
        s.close()


def test_tokens_limit_a_key_over_http():
    """``max_admitted_tokens`` 1,300: key A's two long requests (~603 tokens each) fill it,
    its third is 429 although only 2 of 12 choices are admitted; key B's short requests are
    admitted within its share meanwhile; a request past 1,300 tokens is 400."""
    s = Stack(num_prefill=1, num_decode=1, api_key="key-a", api_keys=("key-b",),
              max_queued=4, max_admitted_tokens=1300, worker={"token_delay_s": 0.004})
    long_body = {"model": MODEL, "prompt": "long", "max_tokens": 600, "ignore_eos": True}
    codes: list[int] = []
    try:
        r = s.post("/v1/completions", {**long_body, "n": 3}, key="key-a")
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_tokens", r.text
        ts = [threading.Thread(target=lambda: codes.append(
            s.post("/v1/completions", long_body, key="key-a").status_code)) for _ in range(2)]
        for t in ts:
            t.start()
        _wait(lambda: s.router.admission.admitted == 2, what="key A's two requests admitted")
        assert s.router.admission.admitted_tokens > 1200
        r = s.post("/v1/completions", long_body, key="key-a")
        assert r.status_code == 429 and r.headers.get("retry-after") == "1", r.text
        for i in range(10):  # key B: 10 short requests beside them
            r = s.post("/v1/completions", {"model": MODEL, "prompt": f"b {i}",
                                           "max_tokens": 8}, key="key-b")
            assert r.status_code == 200, r.text
        for t in ts:
            t.join(60)
        assert codes == [200, 200]
        assert s.router.admission.admitted == 0 and s.router.admission.admitted_tokens == 0
    finally:
        s.close()
