"""The sampling fields are defined once, in :mod:`k3serve.sampling`.

``SamplingParams`` is the wire model (the ``sampling`` field of the internal messages) and the
engine's type; the router's OpenAI schemas annotate their sampling fields with the same field
types (narrowed where OpenAI is narrower). These tests fail when a second definition creeps
back: a field re-declared with its own ``Field(ge=…)``, a wire copy of the params, a bound that
differs between the public API and the engine.
"""

from __future__ import annotations

import ast
import subprocess
import typing
from pathlib import Path

import annotated_types
import pytest
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from k3serve import messages
from k3serve.sampling import SamplingParams, non_empty_stops
from router import schemas
from router.schemas import SAMPLING_FIELDS, ChatCompletionRequest, CompletionRequest

ROOT = Path(__file__).resolve().parents[1]
REQUESTS = (CompletionRequest, ChatCompletionRequest)
#: Where OpenAI's API is narrower than the engine: (request model, OpenAI name) → upper bound.
NARROWED = {
    (CompletionRequest, "temperature"): 2.0, (ChatCompletionRequest, "temperature"): 2.0,
    (CompletionRequest, "n"): schemas.MAX_N, (ChatCompletionRequest, "n"): schemas.MAX_N,
    (CompletionRequest, "logprobs"): schemas.MAX_COMPLETION_LOGPROBS,
}


def _parts(obj: typing.Any) -> list[typing.Any]:
    """Every metadata object of a field (its FieldInfo's and those inside its annotation)."""
    out: list[typing.Any] = []
    if isinstance(obj, FieldInfo):
        out += list(obj.metadata)
        out += [obj] if obj.annotation is None else _parts(obj.annotation)
        return out
    if typing.get_origin(obj) is typing.Annotated:
        args = typing.get_args(obj)
        out += _parts(args[0])
        for a in args[1:]:
            out += _parts(a) if isinstance(a, FieldInfo) else [a]
        return out
    for a in typing.get_args(obj):
        out += _parts(a)
    return out


def _bounds(field: FieldInfo) -> dict[str, float]:
    b: dict[str, float] = {}
    for m in _parts(field):
        for kind in ("ge", "gt", "le", "lt"):
            if isinstance(m, getattr(annotated_types, kind.capitalize())):
                b[kind] = min(b.get(kind, float("inf")), getattr(m, kind)) \
                    if kind in ("le", "lt") else max(b.get(kind, -float("inf")),
                                                     getattr(m, kind))
    return b


def _openai_fields() -> list[tuple[type, str, str]]:
    out = [(model, name, target) for model in REQUESTS for name, target in SAMPLING_FIELDS.items()
           if name in model.model_fields]
    # chat's logprobs is OpenAI's bool switch (the number is top_logprobs), not the field
    return [t for t in out if t[:2] != (ChatCompletionRequest, "logprobs")]


def test_every_openai_sampling_field_maps_to_a_params_field():
    assert set(SAMPLING_FIELDS.values()) <= set(SamplingParams.model_fields)
    for model in REQUESTS:
        mapped = {n for n in SAMPLING_FIELDS if n in model.model_fields}
        # a sampling-named field outside the table would be a second, unchecked definition
        assert set(model.model_fields) & set(SamplingParams.model_fields) <= mapped, model
    assert {n for _, n, _ in _openai_fields()} == set(SAMPLING_FIELDS)  # none unused


@pytest.mark.parametrize("model,name,target", _openai_fields(),
                         ids=lambda x: x if isinstance(x, str) else x.__name__)
def test_openai_field_is_annotated_with_the_params_field_type(model, name, target):
    engine, openai = SamplingParams.model_fields[target], model.model_fields[name]
    if target == "stop":  # str | list[str] on the API, validated by the same rule
        assert schemas.non_empty_stops is non_empty_stops
        return
    ours = _parts(openai)
    for m in _parts(engine):  # the very objects, not equal copies
        assert any(m is o for o in ours), (name, m)
    eb, ob = _bounds(engine), _bounds(openai)
    assert {k: v for k, v in ob.items() if k in ("ge", "gt")} == \
        {k: v for k, v in eb.items() if k in ("ge", "gt")}, name
    want_le = NARROWED.get((model, name), eb.get("le"))
    assert ob.get("le") == want_le, name


@pytest.mark.parametrize("name,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0), ("n", 0), ("max_tokens", 0), ("seed", 1.5), ("stop", [""]),
    ("ignore_eos", 1),
])
def test_engine_and_api_refuse_the_same_values_naming_the_field(name, value):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{name}:"):
        SamplingParams(**{name: value})
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", name: value})
    assert e.value.errors()[0]["loc"][0] == name


def test_a_message_names_the_sampling_field():
    with pytest.raises(ValidationError) as e:
        messages.ReserveRequest.model_validate(
            {"request_id": "r", "prompt_token_ids": [1], "sampling": {"top_p": 2.0}})
    assert e.value.errors()[0]["loc"][:2] == ("sampling", "top_p")
    body = messages.ReserveRequest(request_id="r", prompt_token_ids=[1],
                                   sampling=SamplingParams(stop="x", seed=3))
    back = messages.ReserveRequest.model_validate_json(body.model_dump_json())
    assert isinstance(back.sampling, SamplingParams) and back.sampling == body.sampling


def test_no_second_class_declares_the_sampling_fields():
    """No class outside k3serve/sampling.py and router/schemas.py declares three or more of
    the sampling fields (a wire copy such as a ``SamplingSpec``)."""
    names = set(SamplingParams.model_fields) - {"n", "seed", "stop", "max_tokens", "logprobs"}
    allowed = {("k3serve/sampling.py", "SamplingParams"), ("router/schemas.py", "_SamplingFields")}
    found = []
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.py"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    for rel in tracked:  # the project's files: no venv, no ignored copies of the tree
        path = ROOT / rel
        if rel.startswith("tests/") or not path.is_file():
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                declared = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign)
                            and isinstance(s.target, ast.Name)}
                if len(declared & names) >= 3 and (rel, node.name) not in allowed:
                    found.append((rel, node.name, sorted(declared & names)))
    assert not found, found


def test_a_direct_call_refuses_an_unknown_field():
    """A typo in a keyword must not silently keep the default (``temprature=0`` → 1.0)."""
    with pytest.raises(ValueError, match=r"SamplingParams: unknown field\(s\) \['max_token', "
                                         r"'temprature'\]"):
        SamplingParams(temprature=0, max_token=5)
    # messages from a newer peer may carry fields this side does not know: ignored there
    assert SamplingParams.model_validate({"temperature": 0, "newer_field": 1}).temperature == 0
