"""The router never imports torch or model code (docs/CONTRIBUTING.md, import direction)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import importlib, pkgutil, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
for name in ("triton", "mooncake", "safetensors", "transformers"):
    sys.modules[name] = None
import router
mods = sorted(m.name for m in pkgutil.iter_modules(router.__path__, "router."))
for m in mods:
    importlib.import_module(m)
# what router/app.py imports lazily on the request path, and a whole app
for m in ("k3serve.tokenizer", "k3serve.sampling", "k3serve.tokenizer.detok",
          "k3serve.cache.hashing", "k3serve.config"):
    importlib.import_module(m)
from router.app import RouterConfig, create_app
app = create_app(RouterConfig(model="k3-tiny"))
assert app.state.router.max_model_len > 0
bad = sorted(m for m in sys.modules if m.startswith(("k3serve.model", "k3serve.kernels",
                                                     "k3serve.engine.llm", "prefill", "decode",
                                                     "kvstore")))
assert not bad, bad
print(" ".join(mods))
"""


def test_router_imports_without_torch():
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    mods = r.stdout.split()
    for m in ("router.index", "router.metrics", "router.placement", "router.schemas"):
        assert m in mods
