"""The line a rank-0 process prints when its other ranks are started by another launcher
(torch-free, so the launcher's actors read it without importing torch)::

    rank rendezvous at HOST:PORT {"model": …, "tp": 2, "ep": 2, …}

``HOST:PORT`` is the ``TCPStore`` rank 0 hosts (a free port of its host); the JSON is the
``InstanceSpec`` every rank builds (``k3serve.parallel.ranks``).
"""

from __future__ import annotations

RENDEZVOUS = "rank rendezvous at "


def format_rendezvous(addr: str, spec_json: str) -> str:
    """The line for store ``addr`` (``HOST:PORT``) and the spec's JSON."""
    return f"{RENDEZVOUS}{addr} {spec_json}"


def parse_rendezvous(line: str) -> tuple[str, str] | None:
    """``(HOST:PORT, SPEC_JSON)`` of a rendezvous line, else None."""
    at = line.find(RENDEZVOUS)
    if at < 0:
        return None
    addr, _, spec = line[at + len(RENDEZVOUS):].partition(" ")
    return (addr, spec) if addr and spec else None


__all__ = ["RENDEZVOUS", "format_rendezvous", "parse_rendezvous"]
