"""Tool calling and structured outputs through the live 2 prefill + 1 decode stack, with the
real ``openai`` client (issue 18, must-show 1).

* ``tool_choice`` ``required`` / named over 50 generated argument schemas (nested objects,
  enums, arrays, required fields), streaming and not: every reply carries exactly one call
  whose arguments validate against its tool's schema (``jsonschema``), and the streamed
  deltas reassemble into the same call as the non-streamed reply;
* ``response_format`` ``json_schema``: every reply validates;
* greedy output identical offline (``k3serve.LLM``, monolithic), through the router
  (disaggregated) and with the decode-side fallback forced (``debug_fail_transfer_n``).

The embedded k3-tiny is a 7 M-param byte model: the grammar, not the model, makes the format;
``max_tokens`` is small and the schemas keep strings and arrays short.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import jsonschema
import pytest

B = 16
KEY = "sk-tools-test"
MODEL = "k3-tiny"
MAX_TOKENS = 160


def _leaf(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(["string", "integer", "enum", "boolean", "array", "object"]
                      if depth < 2 else ["string", "integer", "enum", "boolean"])
    if kind == "string":
        return {"type": "string", "maxLength": 2}
    if kind == "integer":
        return {"type": "integer", "minimum": 0, "maximum": 99}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "c", "f", "x1"], 3)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": _leaf(rng, depth + 1), "minItems": 1, "maxItems": 2}
    return _object(rng, depth + 1, 1)


def _object(rng: random.Random, depth: int, width: int) -> dict:
    names = rng.sample(["a", "b", "city", "unit", "n", "tags", "opt", "q"], rng.randint(1, width))
    props = {n: _leaf(rng, depth) for n in names}
    req = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": props, "required": req,
            "additionalProperties": False}


def schemas(n: int = 50, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [_object(rng, 0, 3) for _ in range(n)]


def test_generated_schemas_cover_the_shapes():
    text = json.dumps(schemas())
    for word in ('"enum"', '"array"', '"required"', '"properties": {"'):
        assert word in text
    assert any(any(p.get("type") == "object" for p in s["properties"].values())
               for s in schemas())  # nested


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from deploy.launcher import start_stack

    mp = pytest.MonkeyPatch()
    mp.setenv("K3SERVE_TEST_HOOKS", "1")  # debug_fail_transfer_n on the internal hop
    logs = tmp_path_factory.mktemp("tools-logs")
    st = start_stack(model=MODEL, num_prefill=2, num_decode=1, api_key=KEY, block_size=B,
                     log_dir=str(logs), ready_timeout=180)
    mp.undo()
    try:
        yield st
    finally:
        st.stop()


@pytest.fixture(scope="module")
def aclient(stack):
    from openai import AsyncOpenAI

    return lambda: AsyncOpenAI(base_url=stack.url + "/v1", api_key=KEY, max_retries=0,
                               timeout=300)


def _tools(i: int, schema: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": f"tool_{i}", "description": "t",
                                              "parameters": schema}},
            {"type": "function", "function": {"name": "ping", "parameters": {
                "type": "object", "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"], "additionalProperties": False}}}]


async def _call(client, i: int, schema: dict, stream: bool) -> tuple[list[dict], str]:
    tools = _tools(i, schema)
    choice = ({"type": "function", "function": {"name": f"tool_{i}"}} if i % 2 == 0
              else "required")
    kw = {"model": MODEL, "messages": [{"role": "user", "content": f"call tool {i}"}],
              "tools": tools, "tool_choice": choice, "parallel_tool_calls": False, "temperature": 0,
              "max_completion_tokens": MAX_TOKENS}
    if not stream:
        r = await client.chat.completions.create(**kw)
        msg = r.choices[0].message
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in msg.tool_calls or ()]
        return calls, r.choices[0].finish_reason
    acc: dict[int, dict] = {}
    finish = None
    s = await client.chat.completions.create(**kw, stream=True,
                                             stream_options={"include_usage": True})
    usage = None
    async for chunk in s:
        usage = chunk.usage or usage
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or ():
                e = acc.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                e["id"] = tc.id or e["id"]
                if tc.function and tc.function.name:
                    e["name"] = tc.function.name
                e["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert usage is not None and usage.completion_tokens > 0
    return [acc[k] for k in sorted(acc)], finish


def _check_call(i: int, schema: dict, calls: list[dict], finish: str) -> None:
    assert finish == "tool_calls", (i, finish, calls)
    assert len(calls) == 1, calls
    c = calls[0]
    by_name = {f"tool_{i}": schema, "ping": _tools(i, schema)[1]["function"]["parameters"]}
    assert c["name"] in by_name and (i % 2 == 1 or c["name"] == f"tool_{i}"), c
    assert c["id"].startswith(f"functions.{c['name']}:"), c
    jsonschema.validate(json.loads(c["arguments"]), by_name[c["name"]])


def test_forced_tool_calls_validate_over_50_schemas(aclient):
    ss = schemas()

    async def main():
        client = aclient()
        sem = asyncio.Semaphore(30)

        async def one(i, s):
            async with sem:
                return await _call(client, i, s, stream=bool(i % 4 >= 2))

        return await asyncio.gather(*(one(i, s) for i, s in enumerate(ss)))

    for i, (s, (calls, finish)) in enumerate(zip(ss, asyncio.run(main()))):
        _check_call(i, s, calls, finish)


def test_streamed_call_equals_the_non_streamed_one(aclient):
    s = schemas()[7]

    async def main():
        client = aclient()
        return await asyncio.gather(_call(client, 7, s, False), _call(client, 7, s, True))

    (a, fa), (b, fb) = asyncio.run(main())
    assert a == b and fa == fb == "tool_calls"


def test_response_format_json_schema_always_validates(aclient):
    ss = schemas(20, seed=1)

    async def main():
        client = aclient()

        async def one(i, s):
            kw = {"model": MODEL, "messages": [{"role": "user", "content": f"json {i}"}],
                      "temperature": 0, "max_tokens": MAX_TOKENS,
                      "response_format": {"type": "json_schema",
                                       "json_schema": {"name": f"s{i}", "schema": s,
                                                       "strict": True}}}
            if i % 2:
                r = await client.chat.completions.create(**kw)
                return r.choices[0].message.content, r.choices[0].finish_reason
            text, fin = "", None
            async for ch in await client.chat.completions.create(**kw, stream=True):
                for c in ch.choices:
                    text += c.delta.content or ""
                    fin = c.finish_reason or fin
            return text, fin

        return await asyncio.gather(*(one(i, s) for i, s in enumerate(ss)))

    for s, (text, fin) in zip(ss, asyncio.run(main())):
        assert fin == "stop", (text, fin)
        jsonschema.validate(json.loads(text), s)


def test_logprobs_with_tool_calls(aclient):
    s = schemas()[3]

    async def main():
        client = aclient()
        return await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], tools=_tools(3, s),
            tool_choice="required", parallel_tool_calls=False, temperature=0,
            max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=2)

    r = asyncio.run(main())
    c = r.choices[0]
    assert c.message.tool_calls and c.finish_reason == "tool_calls"
    assert len(c.logprobs.content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)


@pytest.mark.parametrize("body, needle", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "no tool named"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "response_format": {"type": "json_object"}}, "not supported"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nosuch"}}}}}},
     "response_format"),
    # keywords the grammar cannot enforce are refused, not dropped
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "items": {"type": "integer"},
                                "contains": {"const": 42}}}}}, "contains"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"not": {}}}}}, "not"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}],
      "tool_choice": "required"}, "uniqueItems"),
])
def test_unsupported_combinations_are_clear_400s(stack, body, needle):
    r = httpx.post(stack.url + "/v1/chat/completions", timeout=30,
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                         **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.text


def test_tool_history_renders_and_model_route_exists(stack):
    h = {"Authorization": f"Bearer {KEY}"}
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "functions.ping:0", "type": "function",
                 "function": {"name": "ping", "arguments": "{\"ok\":true}"}}]},
            {"role": "tool", "tool_call_id": "functions.ping:0", "content": "pong"}]
    r = httpx.post(stack.url + "/v1/chat/completions", headers=h, timeout=60, json={
        "model": MODEL, "messages": msgs, "max_tokens": 4, "temperature": 0,
        "tools": _tools(0, schemas()[0]), "tool_choice": "auto"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 0
    r = httpx.get(stack.url + f"/v1/models/{MODEL}", headers=h, timeout=10)
    assert r.status_code == 200 and r.json()["id"] == MODEL


def test_greedy_same_offline_disaggregated_and_with_the_fallback(stack, aclient):
    """One named-tool request three ways: k3serve.LLM (monolithic), the router
    (P samples token #1 under the mask, D rebuilds the matcher from grammar + token #1), and
    reserve → prefill with the transfer failing so D recomputes prompt + token #1 itself."""
    from k3serve import LLM
    from k3serve.tokenizer import ByteTokenizer
    from router.preprocess import Preprocessor
    from router.schemas import ChatCompletionRequest

    s = schemas()[11]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "call it"}],
            "tools": _tools(11, s), "tool_choice": {"type": "function",
                                                    "function": {"name": "tool_11"}},
            "parallel_tool_calls": False, "temperature": 0, "max_tokens": MAX_TOKENS,
            "logprobs": True}
    tok = ByteTokenizer()
    pre = Preprocessor(tok, add_bos=False)
    req = ChatCompletionRequest.model_validate(body)
    job = pre.chat_jobs(req, 4096)[0]
    params = pre.sampling(req, MAX_TOKENS, 0, 1234)

    offline = LLM(MODEL, block_size=B, num_pages=256).generate([job.token_ids], params)
    want = offline[0].outputs[0].token_ids

    async def via_router():
        r = await aclient().chat.completions.create(**body)
        return [tok.token_to_id(t.token) if len(t.bytes or []) != 1 else t.bytes[0]
                for t in r.choices[0].logprobs.content], r

    got_ids, r = asyncio.run(via_router())
    assert r.choices[0].message.tool_calls
    assert got_ids == want

    async def fallback():
        h = {"X-K3serve-Cluster-Token": stack.cluster_token}
        P, D = stack.worker_urls[0], stack.worker_urls[-1]
        spec = params.to_dict()
        async with httpx.AsyncClient(timeout=120, headers=h) as c:
            rr = (await c.post(D + "/internal/reserve", json={
                "request_id": "fb-1", "prompt_token_ids": job.token_ids, "sampling": spec,
                "n": 1})).json()
            first = (await c.post(P + "/internal/prefill", json={
                "request_id": "fb-1", "prompt_token_ids": job.token_ids, "sampling": spec,
                "ticket": rr["ticket"], "bootstrap_addr": rr["bootstrap_addr"],
                "snapshot_at": [], "cache_salt": None, "debug_fail_transfer_n": 10})).json()
            toks = [first["token_id"]]
            body2 = {"request_id": "fb-1", "token_id": first["token_id"],
                     "logprob": first["logprob"]}
            async with c.stream("POST", D + "/internal/stream", json=body2) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        ev = json.loads(line[5:])
                        assert "error" not in ev, ev
                        toks += ev["token_ids"]
            return toks

    fb = asyncio.run(fallback())
    # the router cuts at the stop token; the worker stream includes it
    assert fb[:len(want)] == want


def test_vllm_sampling_extras_reach_the_engine(stack):
    """``top_k``, ``min_p`` and ``repetition_penalty`` (vLLM's extra parameters) are applied:
    the served greedy text under a repetition penalty equals the offline engine's with the same
    parameters (and differs from the unpenalised one here); bad values are 400s naming them."""
    from k3serve import LLM, SamplingParams

    prompt = "def fibonacci(n):"
    url, h = stack.url + "/v1/completions", {"Authorization": f"Bearer {KEY}"}

    def served(**extra) -> str:
        r = httpx.post(url, headers=h, timeout=120, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    llm = LLM(MODEL, block_size=B, num_pages=256)

    def offline(**extra) -> str:
        sp = SamplingParams(max_tokens=24, temperature=0, **extra)
        return llm.generate([prompt], sp)[0].outputs[0].text

    penalised = served(repetition_penalty=1.5, top_k=5, min_p=0.05)
    assert penalised == offline(repetition_penalty=1.5, top_k=5, min_p=0.05)
    assert penalised != served()
    for field, bad in (("top_k", 0), ("min_p", 5), ("repetition_penalty", 0)):
        r = httpx.post(url, headers=h, timeout=30, json={"model": MODEL, "prompt": prompt,
                                                          field: bad})
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
