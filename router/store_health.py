"""The shared store's master as the router sees it: :class:`StoreProbe` connects to the
master's RPC port (``--store-url host:port``) every ``every_s`` seconds and keeps its state
(``up`` while the port accepts a TCP connection within ``timeout_s``, ``down`` while it does
not, ``unknown`` before the first answer) and since when (Unix seconds of the last change).

``GET /health`` carries it as ``store`` (:class:`k3serve.messages.StoreHealth`; the master's
address only with ``?detail=1``). A store that is down leaves ``/health`` 200 and ``/readyz``
as they are: the workers serve every request without it (store lookups miss, puts are
dropped), so it degrades reuse across workers, not availability. The check is the one the
launcher's supervisor uses for the master's readiness (deploy/supervisor.py), made from the
router's host.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from k3serve.messages import StoreHealth

log = logging.getLogger("k3serve.router")


class StoreProbe:
    """Reachability of the store's master at ``url`` (``host:port``).

    Args:
        url: The master's RPC address ``host:port``.
        every_s: Seconds between two checks.
        timeout_s: Seconds a connection may take before the check counts as failed.

    Raises:
        ValueError: ``url`` is not ``host:port`` with a numeric port (named).
    """

    def __init__(self, url: str, every_s: float = 1.0, timeout_s: float = 1.0) -> None:
        host, _, port = url.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"store_url: {url!r} is not host:port")
        self.url, self.host, self.port = url, host.strip("[]"), int(port)
        self.every_s, self.timeout_s = every_s, timeout_s
        self.status = "unknown"
        self.since = time.time()
        self.checks = 0

    async def check(self) -> bool:
        """One check: connect, close, update the state. Returns whether the port accepted."""
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port), self.timeout_s)
        except (TimeoutError, OSError):
            ok = False
        else:
            ok = True
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        self.checks += 1
        status = "up" if ok else "down"
        if status != self.status:
            if status == "down":
                log.warning("store master %s is not reachable: requests are served without "
                            "the store until it returns", self.url)
            elif self.status == "down":
                log.warning("store master %s is reachable again", self.url)
            self.status, self.since = status, time.time()
        return ok

    async def run(self) -> None:
        """Check every ``every_s`` seconds until cancelled."""
        while True:
            await self.check()
            await asyncio.sleep(self.every_s)

    def health(self, detail: bool = False) -> StoreHealth:
        """The ``store`` of ``GET /health``: status, since (Unix s), seconds in that state;
        ``url`` with ``detail``."""
        return StoreHealth(status=self.status, since=round(self.since, 3),
                           for_s=round(max(0.0, time.time() - self.since), 3),
                           url=self.url if detail else None)


__all__ = ["StoreProbe"]
