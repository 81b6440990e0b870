"""Suite-wide settings.

CI runs on 2 cores; tests that start worker processes share them with the test process. One
intra-op thread per process keeps small-tensor work fast and the machine responsive. Without a
CUDA device, Triton kernels run under its interpreter (``TRITON_INTERPRET=1``).
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
    if not torch.cuda.is_available():
        # Triton kernels run under the interpreter on CPU. The variable must be set before any
        # @triton.jit definition is imported, whichever test file is collected first (the
        # kernel test files set it too, but a directory or file run alone may import the
        # kernels through k3serve.model before them).
        os.environ.setdefault("TRITON_INTERPRET", "1")
