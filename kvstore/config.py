"""kvstore settings in one frozen dataclass; the only place kvstore reads the environment."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvstore.engine import P2PHANDSHAKE, EngineConfig

ENV_PREFIX = "K3SERVE_KV_"


@dataclass(frozen=True)
class KVConfig:
    """Transfer settings shared by prefill and decode workers.

    Attributes:
        protocol: ``tcp`` (one machine, CI) or ``rdma`` (clusters) — the one switch.
        metadata_server: ``P2PHANDSHAKE`` or a Mooncake metadata service URL.
        hostname: address peers use to reach this process's Transfer Engine.
        device_name: RDMA devices (comma separated), ``""`` = auto.
        bootstrap_host, bootstrap_port: decode side's bootstrap HTTP server (port 0 = any).
        notify: completion channel, ``te`` (TE notification) or ``http``.
        sender_timeout_s, receiver_timeout_s: give-up times (seconds); the receiver's counts
            from pairing.
        pair_timeout_s: how long a decode reservation waits for the prefill worker to pair
            (seconds): the request may queue at the prefill worker first (its admission
            pairs), and that wait must not fail the transfer.
        max_retries: sender retries in total.
        fail_first_n: test hook: the first n write submissions of each sender fail.
    """

    protocol: str = "tcp"
    metadata_server: str = P2PHANDSHAKE
    hostname: str = "127.0.0.1"
    device_name: str = ""
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 0
    notify: str = "te"
    sender_timeout_s: float = 30.0
    receiver_timeout_s: float = 60.0
    pair_timeout_s: float = 600.0
    max_retries: int = 2
    fail_first_n: int = 0

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            protocol=self.protocol,
            metadata_server=self.metadata_server,
            hostname=self.hostname,
            device_name=self.device_name,
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> KVConfig:
        """Defaults, then ``K3SERVE_KV_<FIELD>`` variables (e.g. ``K3SERVE_KV_PROTOCOL=rdma``,
        ``K3SERVE_KV_FAIL_FIRST_N=1``), then ``overrides``.

        Raises:
            ValueError: a variable that does not parse as the field's type.
        """
        env = os.environ if env is None else env
        vals: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            typ = type(f.default)
            try:
                vals[f.name] = typ(raw)
            except ValueError as e:
                raise ValueError(
                    f"{ENV_PREFIX}{f.name.upper()}={raw!r}: not a {typ.__name__}"
                ) from e
        vals.update(overrides)
        return cls(**vals)  # type: ignore[arg-type]


__all__ = ["ENV_PREFIX", "KVConfig"]
