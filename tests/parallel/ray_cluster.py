"""A local Ray cluster of its own for a test: ``ray.cluster_utils.Cluster`` on loopback with its
own temp dir (not ``/tmp/ray``) and free ports for everything Ray would otherwise bind at a
fixed number (GCS 6379, dashboard 8265, dashboard agent 52365, …), so it runs beside another
Ray on the same machine. ``with local_cluster(nodes, gpus) as c:`` connects this process
(``ray.init``) and shuts everything down on exit, leaving no Ray process behind;
:data:`SHARED` keeps one up across the test modules that deploy on the same shape in turn.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback (before ray import)

SMALL_STORE = 80 * 2**20


def free_port() -> int:
    """A port nothing listens on right now (127.0.0.1)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports nothing listens on right now (127.0.0.1): the sockets stay bound
    until all are chosen, so the kernel cannot hand one out twice."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                 for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


NODE_PORTS = ("node_manager_port", "object_manager_port", "dashboard_agent_listen_port",
              "metrics_agent_port", "metrics_export_port", "runtime_env_agent_port")


def node_ports(ports: list[int]) -> dict[str, Any]:
    """Ports for the per-node servers Ray starts on fixed defaults, taken off the end of
    ``ports`` (distinct free ports chosen together, :func:`free_ports`)."""
    return {name: ports.pop() for name in NODE_PORTS}


def alive(pid: int) -> bool:
    """``pid`` runs and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_gone(pids: set[int] | list[int], what: str, within_s: float = 30.0) -> None:
    """Wait up to ``within_s`` for every process of ``pids`` to end; fail naming ``what``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.3)
    assert not [p for p in pids if alive(p)], f"{what} left behind"


def pids_with(text: str) -> list[int]:
    """Live processes (not this one) whose command line contains ``text``."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if text in (d / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(d.name))
            except OSError:
                pass
    return [p for p in found if alive(p)]


@contextmanager
def local_cluster(nodes: int, gpus_per_node: int = 0, cpus_per_node: float = 0,
                  dashboard: bool = False) -> Iterator[Any]:
    """A head node without resources plus ``nodes`` worker nodes, this process connected.

    Args:
        nodes: worker nodes.
        gpus_per_node / cpus_per_node: logical resources of each worker node.
        dashboard: start the dashboard (Ray's state API needs it) on a free port.

    Yields:
        the ``Cluster``; its ``temp_dir`` attribute is the cluster's own temp folder.
    """
    import ray
    from ray.cluster_utils import Cluster

    temp = tempfile.mkdtemp(prefix="k3ray", dir="/tmp")  # Ray's socket paths must stay short
    # every port of the cluster chosen at once: ports chosen one by one, each socket closed
    # before the next, can come back twice
    ports = free_ports(3 + len(NODE_PORTS) * (nodes + 1))
    head = {"num_cpus": 0, "num_gpus": 0, "object_store_memory": SMALL_STORE,
            "node_ip_address": "127.0.0.1", "temp_dir": temp, "gcs_server_port": ports.pop(),
            "include_dashboard": dashboard, "dashboard_host": "127.0.0.1",
            "dashboard_port": ports.pop(), "ray_client_server_port": ports.pop(),
            **node_ports(ports)}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for _ in range(nodes):
            cluster.add_node(num_cpus=cpus_per_node, num_gpus=gpus_per_node,
                             object_store_memory=SMALL_STORE, node_ip_address="127.0.0.1",
                             **node_ports(ports))
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        cluster.temp_dir = temp
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and pids_with(temp):
            time.sleep(0.5)
        shutil.rmtree(temp, ignore_errors=True)


class SharedCluster:
    """One :func:`local_cluster` kept up for consecutive tests that deploy on the same shape
    (each stops its deployment: actors killed, placement groups removed), started by the
    first :meth:`get` and shut down by :meth:`close` or by a :meth:`get` of another shape."""

    def __init__(self) -> None:
        self._exit: ExitStack | None = None
        self._shape: tuple[int, int, bool] | None = None
        self.cluster: Any = None

    def get(self, nodes: int, gpus_per_node: int, dashboard: bool = False) -> Any:
        """The running cluster of this shape (``local_cluster``'s arguments), this process
        connected; another shape's is shut down first."""
        shape = (nodes, gpus_per_node, dashboard)
        if shape != self._shape:
            self.close()
            exit_stack = ExitStack()
            self.cluster = exit_stack.enter_context(
                local_cluster(nodes, gpus_per_node, dashboard=dashboard))
            self._exit, self._shape = exit_stack, shape
        return self.cluster

    def close(self) -> None:
        """Shut the cluster down (as ``local_cluster``'s exit); nothing when none runs."""
        exit_stack, self._exit, self._shape, self.cluster = self._exit, None, None, None
        if exit_stack is not None:
            exit_stack.close()


#: the cluster the Ray test files share (``tests/deploy/conftest.py``: ``ray_cluster``)
SHARED = SharedCluster()
