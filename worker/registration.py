"""Registration with the router: ``POST {router}/internal/register``, again after a restart;
``POST {router}/internal/deregister`` when the worker drains (SIGTERM).

The worker asks the router's ``GET /health?detail=1`` (:class:`~k3serve.messages.RouterHealth`)
every ``check_every_s`` whether it still lists this worker's URL; when it does not (first start,
router restart) it posts :class:`~k3serve.messages.RegisterRequest` and reads
:class:`~k3serve.messages.RegisterResponse`.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from pydantic import ValidationError

from k3serve.messages import RegisterRequest, RegisterResponse, RouterHealth
from k3serve.protocol import CLUSTER_TOKEN_HEADER

log = logging.getLogger("k3serve.worker")


class RegistrationRefused(RuntimeError):
    """The router answered the registration with a 4xx (another model or layout, ...)."""


async def is_listed(client: httpx.AsyncClient, router_url: str, url: str) -> bool:
    """Whether the router's ``/health?detail=1`` lists ``url`` (False for a body it cannot
    read: registering again is harmless).

    Raises:
        httpx.HTTPError: the router is unreachable.
    """
    r = await client.get(f"{router_url}/health", params={"detail": 1})
    if r.status_code not in (200, 503):
        return False
    try:
        health = RouterHealth.model_validate_json(r.content)
    except ValidationError:
        return False
    return any(w.url == url for w in health.workers or ())


async def register_once(client: httpx.AsyncClient, router_url: str, url: str) -> RegisterResponse:
    """Post one registration.

    Raises:
        RegistrationRefused: a 4xx answer.
        ConnectionError: another non-200 answer (e.g. 503: the router could not reach us yet).
        httpx.HTTPError: the router is unreachable.
        pydantic.ValidationError: a 200 whose body is not a :class:`RegisterResponse`.
    """
    r = await client.post(f"{router_url}/internal/register",
                          json=RegisterRequest(url=url).model_dump(mode="json"))
    if 400 <= r.status_code < 500:
        raise RegistrationRefused(f"HTTP {r.status_code}: {r.text[:300]}")
    if r.status_code != 200:
        raise ConnectionError(f"HTTP {r.status_code}: {r.text[:300]}")
    return RegisterResponse.model_validate_json(r.content)


async def register_loop(router_url: str, url: str, cluster_token: str | None,
                        check_every_s: float = 2.0, first_backoff_s: float = 0.2) -> None:
    """Register ``url`` with the router at ``router_url`` and keep it registered.

    Never raises (cancel the task to stop it): a refused registration is logged and retried
    every ``check_every_s``; an unreachable router is retried with exponential backoff from
    ``first_backoff_s`` up to ``check_every_s`` (seconds).
    """
    headers = {CLUSTER_TOKEN_HEADER: cluster_token} if cluster_token else {}
    backoff = first_backoff_s
    async with httpx.AsyncClient(timeout=10.0, headers=headers, trust_env=False) as c:
        while True:
            try:
                if not await is_listed(c, router_url, url):
                    reg = await register_once(c, router_url, url)
                    log.info("registered with %s as %s", router_url, reg.worker_id)
                backoff = first_backoff_s
                await asyncio.sleep(check_every_s)
            except asyncio.CancelledError:
                raise
            except RegistrationRefused as e:
                log.warning("registration with %s refused: %s", router_url, e)
                await asyncio.sleep(check_every_s)
            except Exception as e:  # noqa: BLE001 - the router may be down; keep trying
                log.info("registration with %s: %r", router_url, e)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, check_every_s)


async def deregister(router_url: str, url: str, cluster_token: str | None,
                     timeout_s: float = 3.0) -> bool:
    """``POST {router}/internal/deregister``: the router stops placing on ``url`` at once
    (a draining worker). Best effort: never raises.

    Returns:
        True when the router removed it (False: unreachable, not listed, refused).
    """
    headers = {CLUSTER_TOKEN_HEADER: cluster_token} if cluster_token else {}
    try:
        async with httpx.AsyncClient(timeout=timeout_s, headers=headers, trust_env=False) as c:
            r = await c.post(f"{router_url}/internal/deregister",
                             json=RegisterRequest(url=url).model_dump(mode="json"))
    except httpx.HTTPError as e:
        log.info("deregistration from %s: %r", router_url, e)
        return False
    if r.status_code != 200:
        log.info("deregistration from %s: HTTP %d %s", router_url, r.status_code, r.text[:200])
    return r.status_code == 200


__all__ = ["RegistrationRefused", "deregister", "is_listed", "register_loop", "register_once"]
