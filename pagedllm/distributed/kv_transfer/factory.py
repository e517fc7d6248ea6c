"""The connector ``KVTransferConfig.kv_connector`` names (``KV_CONNECTORS``)."""

from __future__ import annotations

from pagedllm.config import KVTransferConfig
from pagedllm.distributed.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker


def make_scheduler_connector(config: KVTransferConfig) -> KVConnectorScheduler:
    """The scheduler side of ``config.kv_connector`` (checked by ``KVTransferConfig``)."""
    from pagedllm.distributed.kv_transfer.tcp_connector import TCPConnectorScheduler

    return TCPConnectorScheduler(config)


def make_worker_connector(config: KVTransferConfig) -> KVConnectorWorker:
    """The worker side of ``config.kv_connector``, for this process's rank."""
    from pagedllm.distributed.kv_transfer.tcp_connector import TCPConnectorWorker

    return TCPConnectorWorker(config)
