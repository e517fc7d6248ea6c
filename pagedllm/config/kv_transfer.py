"""``KVTransferConfig``: disaggregated prefill / decode (vLLM's ``--kv-transfer-config``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

#: ``kv_connector`` values built here (``pagedllm.distributed.kv_transfer``).
KV_CONNECTORS = ("TCPConnector",)
#: vLLM's ``kv_role`` values: send finished prefills, receive them, or both.
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
#: ``--role`` -> the ``kv_role`` it stands for.
ROLE_TO_KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
_KEYS = ("kv_connector", "kv_role", "kv_ip", "kv_port", "kv_connector_extra_config", "engine_id")
#: ``kv_connector_extra_config`` keys of the TCP connector -> default.
TCP_EXTRA_DEFAULTS: dict[str, float] = {
    # Seconds a consumer waits for a producer's answer before failing the request.
    "timeout_s": 10.0,
    # Seconds a producer keeps a finished prefill's KV that no consumer has fetched.
    "buffer_timeout_s": 120.0,
}


@dataclass(frozen=True)
class KVTransferConfig:
    """How this engine takes part in a prefill / decode split (vLLM's field names).

    ``kv_role``: ``kv_producer`` (a prefill instance: a request sent with
    ``kv_transfer_params={"do_remote_decode": true}`` keeps its prompt's KV for a consumer
    to fetch, and its output's ``kv_transfer_params`` says where), ``kv_consumer`` (a decode
    instance: a request sent with those params loads the prompt's KV instead of computing
    it), or ``kv_both``. ``kv_ip`` / ``kv_port``: where a producer serves its KV (worker
    rank r on ``kv_port + r``); a consumer reads the address from each request.
    ``kv_connector_extra_config``: the connector's own settings (``TCP_EXTRA_DEFAULTS``).
    ``engine_id``: named in the params a producer returns (default: ``kv_ip:kv_port``).
    """

    kv_connector: str = "TCPConnector"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    engine_id: Optional[str] = None

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra(self, key: str) -> float:
        """A ``kv_connector_extra_config`` value, or its default (``TCP_EXTRA_DEFAULTS``)."""
        return float(self.kv_connector_extra_config.get(key, TCP_EXTRA_DEFAULTS[key]))

    @classmethod
    def from_args(cls, config: Optional[dict], role: Optional[str]) -> Optional["KVTransferConfig"]:
        """The config of ``--kv-transfer-config`` (a dict) and ``--role`` (prefill | decode,
        which sets ``kv_role``; alone it implies the TCP connector's defaults); None when
        neither is given.

        Raises:
            ValueError: an unknown key, connector, role or extra key, a bad port or
                timeout, or a ``--role`` that contradicts ``kv_role``.
        """
        if config is None and role is None:
            return None
        values = dict(config or {})
        unknown = sorted(set(values) - set(_KEYS))
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown key(s) {unknown}; known: {list(_KEYS)}.")
        if role is not None:
            if role not in ROLE_TO_KV_ROLE:
                raise ValueError(f"role must be one of {list(ROLE_TO_KV_ROLE)}, got {role!r}.")
            kv_role = ROLE_TO_KV_ROLE[role]
            if values.get("kv_role", kv_role) != kv_role:
                raise ValueError(f"--role {role} means kv_role {kv_role!r}, but kv_transfer_config has "
                                 f"kv_role {values['kv_role']!r}.")
            values["kv_role"] = kv_role
        kv_config = cls(**values)
        kv_config._check()
        return kv_config

    def _check(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config: kv_connector {self.kv_connector!r} is not supported yet; "
                             f"supported: {list(KV_CONNECTORS)}.")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {list(KV_ROLES)}, got {self.kv_role!r}.")
        if not isinstance(self.kv_port, int) or not 0 < self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config: kv_port must be a TCP port (1-65535), got {self.kv_port!r}.")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config: kv_connector_extra_config must be a JSON object.")
        unknown = sorted(set(self.kv_connector_extra_config) - set(TCP_EXTRA_DEFAULTS))
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown kv_connector_extra_config key(s) {unknown}; known: "
                             f"{list(TCP_EXTRA_DEFAULTS)}.")
        for key in TCP_EXTRA_DEFAULTS:
            value = self.kv_connector_extra_config.get(key, 1.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"kv_transfer_config: kv_connector_extra_config[{key!r}] must be a positive "
                                 f"number of seconds, got {value!r}.")
