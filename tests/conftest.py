"""Suite-wide settings.

CI runs on 2 cores; tests that start worker processes share them with the test process. One
intra-op thread per process keeps small-tensor work fast and the machine responsive.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import torch
except ImportError:  # the torch-free parts of the suite still run
    torch = None

if torch is not None:
    torch.set_num_threads(1)
