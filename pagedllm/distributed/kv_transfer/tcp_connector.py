"""``TCPConnector``: prompt KV moved between engines over TCP (ZeroMQ), one host or several.

Producer: each worker (rank r) serves the KV it saved on ``kv_ip:kv_port + r`` (a ROUTER
socket in a thread); a save is a copy of the prompt's slots (``block_copy``) into host
memory, kept until one consumer fetches it or ``buffer_timeout_s`` passes, so the
request's blocks are freed as soon as it finishes. Consumer: before a step's forward each
worker asks the producer's rank r for each load (a REQ socket, ``timeout_s``), checks the
answer against its own cache and writes it into the request's blocks.

Handshake: before its first fetch from a producer, each consumer rank sends its
``KVLayout`` to the producer's rank 0 (there at any parallel size); it answers with its own, and each side logs the fields that differ
(each distinct mismatch once). A consumer fetches only from a producer whose layout matches; until then
each of its loads fails at once with a ``LAYOUT_MISMATCH`` message naming the fields (a
failure that sending the request again does not fix). A producer that stops answering is
checked again at the next fetch (it may have restarted with another layout).

Wire format: a request ``[b"get", remote_request_id, num_tokens]``; an answer
``[b"ok", header JSON {"num_tokens", "dtype", "shapes"}, one frame per layer]`` (each
layer's ``gather_tokens`` tensor, raw bytes) or ``[b"error", message]``. The handshake
``[b"layout", KVLayout JSON]``, answered ``[b"layout", KVLayout JSON]``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import warnings
from typing import Any, Callable, Mapping, Optional

import torch
import zmq

from pagedllm.config import KVTransferConfig
from pagedllm.distributed.kv_transfer.base import (
    KVConnectorScheduler,
    KVConnectorWorker,
    Request,
    kv_transfer_params,
)
from pagedllm.distributed.kv_transfer.block_copy import gather_tokens, scatter_tokens, token_slots
from pagedllm.distributed.kv_transfer.layout import LAYOUT_MISMATCH, KVLayout, mismatch_message
from pagedllm.distributed.parallel_state import get_pp_group, get_tp_group
from pagedllm.messages.kv_transfer import KVConnectorMetadata, KVLoadSpec, KVSaveSpec

logger = logging.getLogger(__name__)

_POLL_MS = 200


class TCPConnectorScheduler(KVConnectorScheduler):
    """Which requests load remote KV (consumer) or keep theirs for a consumer (producer)."""

    def __init__(self, config: KVTransferConfig) -> None:
        self.config = config
        self.engine_id = config.engine_id or f"{config.kv_ip}:{config.kv_port}"
        self._to_load: dict[str, int] = {}  # admitted, load not sent yet: request id -> tokens
        self._loading: set[str] = set()  # requests whose KV was (or is being) loaded
        self._saved: dict[str, int] = {}  # request id -> tokens its producer keeps

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if not self.config.is_kv_consumer or request.request_id in self._loading or num_computed_tokens:
            return 0  # NOTE: a preempted request recomputes: its remote KV is fetched once
        if not kv_transfer_params(request).get("do_remote_prefill"):
            return 0
        return max(request.num_prompt_tokens - 1, 0)

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        self._to_load[request.request_id] = num_external_tokens
        self._loading.add(request.request_id)

    def build_connector_meta(
        self, scheduler_output: Any, requests: Mapping[str, Request],
        block_ids_of: Callable[[str], tuple[list[int], ...]],
    ) -> KVConnectorMetadata:
        metadata = KVConnectorMetadata()
        for req_id, num_tokens in self._to_load.items():
            params = kv_transfer_params(requests[req_id])
            metadata.loads.append(KVLoadSpec(req_id, str(params["remote_host"]), int(params["remote_port"]),
                                             str(params["remote_request_id"]), block_ids_of(req_id)[0], num_tokens))
        self._to_load = {}
        if self.config.is_kv_producer:
            for req_id in scheduler_output.num_scheduled_tokens:
                request = requests[req_id]
                num_tokens = request.num_prompt_tokens - 1
                if (req_id not in self._saved and num_tokens > 0 and request.num_computed_tokens >= num_tokens + 1
                        and kv_transfer_params(request).get("do_remote_decode")):
                    metadata.saves.append(KVSaveSpec(req_id, block_ids_of(req_id)[0], num_tokens))
                    self._saved[req_id] = num_tokens
        return metadata

    def request_finished(self, request: Request) -> Optional[dict[str, Any]]:
        num_tokens = self._saved.get(request.request_id)
        if num_tokens is None:
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.config.kv_ip,
            "remote_port": self.config.kv_port,
            "remote_request_id": request.request_id,
            "remote_num_tokens": num_tokens,
        }

    def request_failed(self, request: Request, reason: str) -> Optional[dict[str, Any]]:
        if request.request_id not in self._loading:
            return None
        return {"error": reason, "retryable": not reason.startswith(LAYOUT_MISMATCH)}

    def request_freed(self, request_id: str) -> None:
        self._to_load.pop(request_id, None)
        self._loading.discard(request_id)
        self._saved.pop(request_id, None)


class TCPConnectorWorker(KVConnectorWorker):
    """Serves this rank's saved KV (producer) and fetches remote KV into its cache (consumer).

    Raises (constructor):
        RuntimeError: a producer whose ``kv_ip:kv_port + rank`` cannot be bound.
    """

    def __init__(self, config: KVTransferConfig) -> None:
        self.config = config
        self.rank = get_pp_group().rank_in_group * get_tp_group().world_size + get_tp_group().rank_in_group
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = 0
        self.layout: Optional[KVLayout] = None
        # Consumer: the producer addresses whose layout matches this one.
        self._matched_peers: set[str] = set()
        # Both sides: the mismatch messages logged already (each once).
        self._logged_mismatches: set[str] = set()
        self._context = zmq.Context()
        self._timeout_ms = int(config.extra("timeout_s") * 1000)
        self._buffer_timeout_s = config.extra("buffer_timeout_s")
        # Request id -> (when saved, header, one tensor per layer), for a consumer to fetch.
        self._buffer: dict[str, tuple[float, dict[str, Any], list[torch.Tensor]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server: Optional[threading.Thread] = None
        if config.is_kv_producer:
            socket = self._context.socket(zmq.ROUTER)
            address = f"tcp://{config.kv_ip}:{config.kv_port + self.rank}"
            try:
                socket.bind(address)
            except zmq.ZMQError as exc:
                socket.close(linger=0)
                raise RuntimeError(f"The KV producer cannot listen on {address} ({exc}): set another kv_port "
                                   "in --kv-transfer-config.") from None
            self._server = threading.Thread(target=self._serve, args=(socket,), name="kv-producer", daemon=True)
            self._server.start()

    def register_kv_caches(self, kv_caches: list[torch.Tensor], layout: KVLayout) -> None:
        self.kv_caches, self.block_size, self.layout = kv_caches, layout.block_size, layout

    def _log_mismatch(self, message: str) -> None:
        if message not in self._logged_mismatches:
            self._logged_mismatches.add(message)
            logger.error("%s", message)

    # ------------------------------------------------------------------ producer
    def save_kv(self, metadata: KVConnectorMetadata) -> None:
        for save in metadata.saves:
            slots = token_slots(save.block_ids, save.num_tokens, self.block_size, self.kv_caches[0].device)
            layers = [gather_tokens(cache, slots).cpu() for cache in self.kv_caches]
            header = {"num_tokens": save.num_tokens, "dtype": str(layers[0].dtype).removeprefix("torch."),
                      "shapes": [list(t.shape) for t in layers]}
            with self._lock:
                self._buffer[save.req_id] = (time.monotonic(), header, layers)

    def _serve(self, socket: zmq.Socket) -> None:
        """The producer's thread: answer fetches until ``shutdown``."""
        try:
            while not self._stop.is_set():
                self._expire()
                if not socket.poll(_POLL_MS):
                    continue
                identity, _, *frames = socket.recv_multipart()
                socket.send_multipart([identity, b"", *self._answer(frames)], copy=False)
        finally:
            socket.close(linger=0)

    def _answer(self, frames: list[bytes]) -> list[Any]:
        if len(frames) == 2 and frames[0] == b"layout":
            return self._answer_layout(frames[1])
        if len(frames) != 3 or frames[0] != b"get":
            return [b"error", b"malformed KV fetch"]
        req_id, num_tokens = frames[1].decode(), int(frames[2])
        with self._lock:
            entry = self._buffer.pop(req_id, None)
        if entry is None:
            return [b"error", f"no KV kept for request {req_id} (never prefilled here, fetched already, or "
                              f"older than buffer_timeout_s={self._buffer_timeout_s:g})".encode()]
        _, header, layers = entry
        if header["num_tokens"] != num_tokens:
            return [b"error", f"request {req_id} has the KV of {header['num_tokens']} prompt tokens here, not "
                              f"{num_tokens}: the two requests' prompts differ".encode()]
        return [b"ok", json.dumps(header).encode(), *(t.view(torch.uint8).numpy() for t in layers)]

    def _answer_layout(self, data: bytes) -> list[Any]:
        """The handshake's answer: this rank's layout; a consumer's that differs is logged."""
        if self.layout is None:  # the caches are not allocated yet
            return [b"error", b"the prefill instance is starting"]
        try:
            theirs = KVLayout.from_json(data)
        except ValueError as exc:
            return [b"error", f"malformed KV layout handshake: {exc}".encode()]
        mismatches = self.layout.mismatches(theirs)
        if mismatches:
            self._log_mismatch(mismatch_message(
                mismatches, f"this prefill instance (rank {self.rank} on port {self.config.kv_port + self.rank})",
                "a decode instance that connected"))
        return [b"layout", self.layout.to_json()]

    def _expire(self) -> None:
        cutoff = time.monotonic() - self._buffer_timeout_s
        with self._lock:
            for req_id in [r for r, (saved, _, _) in self._buffer.items() if saved < cutoff]:
                logger.warning("KV of request %s dropped: no consumer fetched it in %g s.", req_id,
                               self._buffer_timeout_s)
                del self._buffer[req_id]

    # ------------------------------------------------------------------ consumer
    def start_load_kv(self, metadata: KVConnectorMetadata) -> dict[str, str]:
        failed = {}
        for load in metadata.loads:
            try:
                self._load(load)
            except (RuntimeError, ValueError) as exc:
                failed[load.req_id] = str(exc)
        return failed

    def _load(self, load: KVLoadSpec) -> None:
        """Fetch one request's KV from its producer and write it into its blocks.

        Raises:
            RuntimeError: no answer in ``timeout_s``, the producer's error, or a producer
                whose layout differs (``_handshake``).
            ValueError: KV that does not fit this cache (another model, dtype or parallel size).
        """
        address = f"tcp://{load.remote_host}:{load.remote_port + self.rank}"
        producer = f"tcp://{load.remote_host}:{load.remote_port}"  # its rank 0: there at every parallel size
        if producer not in self._matched_peers:
            self._handshake(producer)
        socket = self._context.socket(zmq.REQ)
        try:
            socket.connect(address)
            socket.send_multipart([b"get", load.remote_request_id.encode(), str(load.num_tokens).encode()])
            frames = self._receive(socket, address)
        finally:
            socket.close(linger=0)
        if frames[0].bytes != b"ok":
            raise RuntimeError(f"KV transfer failed: the prefill instance at {address}: {frames[1].bytes.decode()}")
        try:
            self._write(load, frames, address)
        except ValueError:
            self._matched_peers.discard(producer)  # a producer restarted with another layout: check it again
            raise

    def _write(self, load: KVLoadSpec, frames: list[Any], address: str) -> None:
        """Write a fetch's answer (``[b"ok", header, layers...]``) into the load's blocks.

        Raises:
            ValueError: KV that does not fit this cache.
        """
        header = json.loads(frames[1].bytes)
        if len(frames) - 2 != len(self.kv_caches):
            raise ValueError(f"KV transfer failed: {len(frames) - 2} layers from {address}, this engine has "
                             f"{len(self.kv_caches)}: the two engines must serve the same model.")
        dtype = getattr(torch, header["dtype"])
        slots = token_slots(load.block_ids, load.num_tokens, self.block_size, self.kv_caches[0].device)
        with warnings.catch_warnings():
            # NOTE: the frames are read-only; scatter_tokens copies them into the cache.
            warnings.simplefilter("ignore", UserWarning)
            for cache, frame, shape in zip(self.kv_caches, frames[2:], header["shapes"]):
                tokens = torch.frombuffer(frame.buffer, dtype=torch.uint8).view(dtype).reshape(shape)
                scatter_tokens(cache, slots, tokens)

    def _receive(self, socket: zmq.Socket, address: str) -> list[Any]:
        """The producer's answer on ``socket``, within ``timeout_s``.

        Raises:
            RuntimeError: no answer in time (the producer is checked again next time).
        """
        if not socket.poll(self._timeout_ms):
            self._matched_peers.clear()  # check each producer again (it may have restarted)
            raise RuntimeError(f"KV transfer failed: the prefill instance at {address} did not answer in "
                               f"{self._timeout_ms / 1000:g} s (is it running?)")
        return socket.recv_multipart(copy=False)

    def _handshake(self, address: str) -> None:
        """Exchange layouts with the producer's rank 0 at ``address``; remember it when they match.

        Every consumer rank asks rank 0 (a producer with fewer ranks has no port for this rank,
        so asking its own would time out instead of naming ``tensor_parallel_size``).

        Raises:
            RuntimeError: no answer, an error answer, or a layout that differs
                (``LAYOUT_MISMATCH``: the fields that differ, with both values).
        """
        assert self.layout is not None  # loads come after register_kv_caches
        socket = self._context.socket(zmq.REQ)
        try:
            socket.connect(address)
            socket.send_multipart([b"layout", self.layout.to_json()])
            frames = self._receive(socket, address)
        finally:
            socket.close(linger=0)
        if frames[0].bytes != b"layout":
            raise RuntimeError(f"KV transfer failed: the prefill instance at {address} refused the layout "
                               f"handshake: {frames[-1].bytes.decode()}")
        theirs = KVLayout.from_json(frames[1].bytes)
        mismatches = self.layout.mismatches(theirs)
        if mismatches:
            message = mismatch_message(mismatches, f"this decode instance (rank {self.rank})",
                                       f"the prefill instance at {address}")
            self._log_mismatch(message)
            raise RuntimeError(message)
        self._matched_peers.add(address)

    def shutdown(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.join()
        self._context.term()
