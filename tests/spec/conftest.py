"""The session fixtures of the speculative-decoding tests: k3-tiny, and the plain greedy
reference on 20 repository prompts that the offline, served and graph tests compare with."""

from __future__ import annotations

import pytest
import torch

from k3serve.model.checkpoint import load_model
from k3serve.tokenizer import get_tokenizer
from tests.spec.helpers import GREEDY, make_engine, repo_prompts, run


@pytest.fixture(scope="session")
def tiny():
    """``(model, config, tokenizer)`` of k3-tiny, loaded once."""
    net, cfg, folder = load_model("k3-tiny", "cpu", torch.float32)
    return net, cfg, get_tokenizer(folder)




@pytest.fixture(scope="session")
def greedy20(tiny) -> tuple[list[list[int]], list[list[int]]]:
    """``(prompts, tokens)``: 20 prompts of 16…64 tokens cut from k3serve's sources and the
    plain engine's greedy output for each (:data:`GREEDY`), computed once."""
    prompts = repo_prompts(tiny[2], 20, 16, 64)
    return prompts, [o.outputs[0].token_ids for o in run(make_engine(tiny), prompts, GREEDY)]
