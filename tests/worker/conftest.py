"""Fixtures of the worker tests: one real prefill + decode pair shared by the issue-15 tests
that drive workers by hand (test_aborts.py, test_transfer_load.py), started once per session
(a worker start is most of such a module's time on 2 cores)."""

from __future__ import annotations

import pytest

from tests.worker_procs import Proc, stop_all

B = 16
#: test_transfer_load: the prefill worker's ``--max-prefill-backlog`` (tokens) and sender
#: deadline — far longer than one prompt's prefill, shorter than its whole burst's here
CAP = 256
SENDER_TIMEOUT_S = 12.0


@pytest.fixture(scope="session")
def shared_pair(tmp_path_factory):
    """``(P, D)``: k3-tiny, block size 16, 512 pages each; P with the backlog cap and the
    short sender deadline above."""
    logs = tmp_path_factory.mktemp("pair-logs")
    P = Proc("prefill", "prefill-rel", B, logs, pages=512,
             extra=("--max-prefill-backlog", str(CAP)),
             env={"K3SERVE_KV_SENDER_TIMEOUT_S": str(SENDER_TIMEOUT_S)})
    D = Proc("decode", "decode-rel", B, logs, pages=512)
    try:
        P.wait_ready()
        D.wait_ready()
        yield P, D
    finally:
        # both at once (SIGTERM, then SIGKILL after 5 s): nothing of a test's is left to drain
        stop_all((P, D), timeout=5.0)
