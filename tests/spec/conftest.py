"""The k3-tiny fixture of the speculative-decoding tests."""

from __future__ import annotations

import pytest
import torch

from k3serve.model.checkpoint import load_model
from k3serve.tokenizer import get_tokenizer


@pytest.fixture(scope="session")
def tiny():
    """``(model, config, tokenizer)`` of k3-tiny, loaded once."""
    net, cfg, folder = load_model("k3-tiny", "cpu", torch.float32)
    return net, cfg, get_tokenizer(folder)


