"""kvstore settings: :class:`KVConfig` (pydantic-settings; the only place kvstore reads the
environment) and :class:`EngineConfig` (one Transfer Engine, :mod:`kvstore.engine`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import pydantic
from pydantic import Field
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)
from pydantic_settings.sources.utils import parse_env_vars

ENV_PREFIX = "K3SERVE_KV_"
P2PHANDSHAKE = "P2PHANDSHAKE"


@dataclass(frozen=True)
class EngineConfig:
    """How to bring up one Transfer Engine.

    Attributes:
        protocol: ``"tcp"`` (one machine, CI) or ``"rdma"`` (clusters); same code otherwise.
        metadata_server: ``"P2PHANDSHAKE"`` or a metadata service URL (``etcd://h:p``,
            ``http://h:p/metadata``).
        hostname: the address peers use to reach this engine (in P2P mode without a port: the
            engine picks its RPC port). With a metadata server, a unique segment name.
        device_name: RDMA devices, comma separated; ``""`` = auto.
        max_inflight_bytes: async path: bytes in flight per peer (admission control), bytes.
        max_request_bytes: async path: larger runs are split into chunks of this size, bytes.
        transfer_timeout_s: an async chunk not completed after this long fails, seconds.
        restrict_listen: accept Transfer Engine connections only on the interface of
            ``hostname`` (:mod:`kvstore.listen`); off: every interface, as Mooncake binds.
    """

    protocol: str = "tcp"
    metadata_server: str = P2PHANDSHAKE
    hostname: str = "127.0.0.1"
    device_name: str = ""
    max_inflight_bytes: int = 32 << 20
    max_request_bytes: int = 4 << 20
    transfer_timeout_s: float = 10.0
    restrict_listen: bool = True

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"EngineConfig.protocol: 'tcp' or 'rdma', not {self.protocol!r}")
        if self.max_request_bytes <= 0 or self.max_inflight_bytes < self.max_request_bytes:
            raise ValueError("EngineConfig: need 0 < max_request_bytes <= max_inflight_bytes")


class KVConfig(BaseSettings):
    """Transfer settings shared by prefill and decode workers (frozen).

    :meth:`from_env` reads every field from ``K3SERVE_KV_<FIELD>`` (case-insensitive), e.g.
    ``K3SERVE_KV_PROTOCOL=rdma``, ``K3SERVE_KV_FAIL_FIRST_N=1``, typed by pydantic: ints and
    floats must parse, booleans are ``1/0/true/false/yes/no/on/off``. The constructor
    (``KVConfig(max_retries=0)``) reads no environment: defaults and its arguments only.

    Attributes:
        protocol: ``tcp`` (one machine, CI) or ``rdma`` (clusters) — the one switch.
        metadata_server: ``P2PHANDSHAKE`` or a Mooncake metadata service URL.
        hostname: address peers use to reach this process's Transfer Engine.
        device_name: RDMA devices (comma separated), ``""`` = auto.
        bootstrap_host, bootstrap_port: decode side's bootstrap HTTP server (port 0 = any).
        notify: completion channel, ``te`` (TE notification) or ``http``.
        staging: how device pools meet the TE (:mod:`kvstore.staging`): ``auto`` (CUDA pools
            through one pinned host mirror per worker, CPU pools directly), ``host``, or
            ``direct`` (TE reads / writes GPU memory itself: Mooncake's tcp transport then
            bounces every 64 KiB slice through the host, ~0.02 GB/s measured on one H200).
        progress: senders report each layer as it lands (the receiver's TRANSFERRING state).
        sender_timeout_s, receiver_timeout_s: give-up times (seconds); the receiver's counts
            from pairing.
        pair_timeout_s: how long a decode reservation waits for the prefill worker to pair
            (seconds): the request may queue at the prefill worker first (its admission
            pairs), and that wait must not fail the transfer.
        max_retries: sender retries in total.
        fail_first_n: test hook: the first n write submissions of each sender fail.
        fault_fail_fraction, fault_hang_fraction, fault_pair_fraction: fault injection
            (:mod:`kvstore.faults`): this fraction of a prefill worker's senders fail / hang
            once paired / fail to pair (0: off).
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, frozen=True, extra="forbid", validate_default=True
    )

    protocol: Literal["tcp", "rdma"] = "tcp"
    metadata_server: str = P2PHANDSHAKE
    hostname: str = "127.0.0.1"
    device_name: str = ""
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = Field(default=0, ge=0, le=65535)
    notify: Literal["te", "http"] = "te"
    staging: Literal["auto", "host", "direct"] = "auto"
    progress: bool = True
    sender_timeout_s: float = Field(default=30.0, gt=0)
    receiver_timeout_s: float = Field(default=60.0, gt=0)
    pair_timeout_s: float = Field(default=600.0, gt=0)
    max_retries: int = Field(default=2, ge=0)
    fail_first_n: int = Field(default=0, ge=0)
    fault_fail_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    fault_hang_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    fault_pair_fraction: float = Field(default=0.0, ge=0.0, le=1.0)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        **_: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)  # the environment is read by from_env only

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            protocol=self.protocol,
            metadata_server=self.metadata_server,
            hostname=self.hostname,
            device_name=self.device_name,
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> KVConfig:
        """Defaults, then ``K3SERVE_KV_<FIELD>`` variables of ``env`` (default
        ``os.environ``), then ``overrides``.

        Raises:
            ValueError: a variable that does not parse as its field's type or is out of
                range; the message names the variable (``K3SERVE_KV_MAX_RETRIES='x': ...``),
                or the field for a bad override.
        """
        src = EnvSettingsSource(cls)  # the prefix and case rules of model_config
        if env is not None:
            src.env_vars = parse_env_vars(
                env, src.case_sensitive, src.env_ignore_empty, src.env_parse_none_str
            )
        raw: dict[str, Any] = src()
        try:
            return cls(**{**raw, **overrides})
        except pydantic.ValidationError as e:
            lines = []
            for err in e.errors():
                field = str(err["loc"][0]) if err["loc"] else ""
                where = (
                    f"{ENV_PREFIX}{field.upper()}={raw[field]!r}"
                    if field in raw and field not in overrides
                    else f"KVConfig.{field}"
                )
                lines.append(f"{where}: {err['msg']}")
            raise ValueError("; ".join(lines)) from None


__all__ = ["ENV_PREFIX", "P2PHANDSHAKE", "EngineConfig", "KVConfig"]
