"""Sleep mode on one worker (vLLM's ``--enable-sleep-mode``): the loaded weights as a list of
storages, taken out of memory and put back in place.

The weights are every tensor the loader left in the model (parameters, buffers, and tensors
held by a layer or by an object of a layer, such as its matmul plan), counted once per
storage (``weight_storages``). Putting a storage back in place (``UntypedStorage.resize_``)
restores every tensor that views it, whoever holds it, so nothing is rebound on wake-up.

- Level 1 (``OffloadedWeights``): the bytes the tensors use of each storage are copied into a
  file-backed shared mapping (a temporary file in ``tempfile.gettempdir()``, deleted on
  wake-up), which is unmapped at once, and
  each storage is resized to 0 bytes: the weights leave this process's memory and live in the
  page cache of that file, which the kernel may write back and reclaim. ``restore`` maps the
  file again and copies them back.
- Level 2: the storages are resized to 0 bytes, nothing is kept; ``copy_storages`` fills them
  again from a model loaded anew (the same loader, so the same storages in the same order;
  its float32 weight copies from arenas of their own: ``cpu_gemm.separate_fp32_copies``).

Tensors without storage (``cpu_gemm.pack_weight``'s oneDNN layout: ``OpaqueWeights``) are
taken out of every attribute that holds them: at level 1 a plain copy goes to the file and
is packed again on wake-up; at level 2 the reloaded model's own are put in their places.
Storages that cannot be resized (a mapping of preloaded weights, ``--load-format ipc_cache``:
already shared page cache) stay as they are at every level.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn

#: Byte alignment of each storage in the offload file.
_ALIGN = 64


#: The attribute an attention / state layer's KV cache is bound to (``bind_kv_caches``).
KV_CACHE_ATTR = "kv_cache"


def _holders(module: nn.Module) -> Iterator[dict]:
    """Where the module keeps tensors: its parameters, its buffers, its attributes, and the
    attributes of the plain objects it holds (one level deep: its matmul plan ...)."""
    yield module._parameters
    yield module._buffers
    yield vars(module)
    for value in vars(module).values():
        if not isinstance(value, (nn.Module, type)) and hasattr(value, "__dict__"):
            yield vars(value)


def _slots(models: Iterable[nn.Module]) -> Iterator[tuple[dict, str, torch.Tensor]]:
    """(holder, key, tensor) for every tensor the modules of ``models`` hold, KV caches excepted."""
    for model in models:
        for module in model.modules():
            for holder in _holders(module):
                for key, value in holder.items():
                    if isinstance(value, torch.Tensor) and key != KV_CACHE_ATTR:
                        yield holder, key, value


@dataclass
class WeightStorages:
    """Storages of weights, each with its size and the bytes its tensors reach from its start
    (``used``: less than the size where tensors are carved from a larger block, as the float32
    weight copies' arena; only those bytes are kept and copied, the rest stays untouched memory)."""

    storages: list[torch.UntypedStorage] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    used: list[int] = field(default_factory=list)

    def add(self, storage: torch.UntypedStorage, used: int) -> None:
        self.storages.append(storage)
        self.sizes.append(storage.nbytes())
        self.used.append(used)


def _end_byte(tensor: torch.Tensor) -> int:
    """One past the last byte of its storage that ``tensor`` reaches."""
    if tensor.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return (tensor.storage_offset() + span) * tensor.element_size()


def weight_storages(models: Iterable[nn.Module]) -> WeightStorages:
    """The resizable, non-empty storages of every tensor of ``models`` but their KV caches
    (modules in ``modules()`` order), each once: a deterministic order, the same for two
    models built by the same loader."""
    index: dict[int, int] = {}
    found = WeightStorages()
    for _, _, tensor in _slots(models):
        if tensor.is_mkldnn or tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() == 0 or not storage.resizable():
            continue
        if ptr not in index:
            index[ptr] = len(found.storages)
            found.add(storage, 0)
        found.used[index[ptr]] = max(found.used[index[ptr]], _end_byte(tensor))
    return found


class OpaqueWeights:
    """The tensors of ``models`` in oneDNN's opaque layout (no storage), with every place
    that holds each: ``take`` removes them (memory freed), ``put_back`` puts tensors there.

    Args:
        models: the models, as for ``weight_storages`` (the same order for the same loader).
    """

    def __init__(self, models: Iterable[nn.Module]) -> None:
        places: dict[int, list[tuple[dict, str, bool]]] = {}
        self.tensors: list[torch.Tensor] = []
        for holder, key, tensor in _slots(models):
            if tensor.is_mkldnn:
                if id(tensor) not in places:
                    places[id(tensor)] = []
                    self.tensors.append(tensor)
                places[id(tensor)].append((holder, key, isinstance(tensor, nn.Parameter)))
        self.places = [places[id(t)] for t in self.tensors]

    def take(self) -> list[torch.Tensor]:
        """Remove them from their places (an empty tensor there); returns plain copies."""
        plain = [t.to_dense() for t in self.tensors]
        for places in self.places:
            for holder, key, _ in places:
                holder[key] = torch.empty(0)
        self.tensors = []
        return plain

    def put_back(self, tensors: list[torch.Tensor]) -> None:
        """Put ``tensors[i]`` wherever the i-th opaque tensor was (one object in all its places,
        a parameter where one was)."""
        for places, tensor in zip(self.places, tensors):
            if any(is_parameter for _, _, is_parameter in places) and not isinstance(tensor, nn.Parameter):
                tensor = nn.Parameter(tensor, requires_grad=False)  # one object, held where it was
            for holder, key, _ in places:
                holder[key] = tensor


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (no numpy: an exported storage can no longer be resized)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def unbind_kv_caches(models: Iterable[nn.Module]) -> None:
    """Drop every layer's KV cache (an empty tensor / list in its place): their memory is
    freed once the runner drops its own references."""
    for model in models:
        for module in model.modules():
            value = getattr(module, KV_CACHE_ATTR, None)
            if value is not None:
                setattr(module, KV_CACHE_ATTR, [] if isinstance(value, list) else torch.empty(0))


def release(weights: WeightStorages) -> None:
    """Resize each storage to 0 bytes (its memory is freed; its tensors keep shape and strides)."""
    for storage in weights.storages:
        storage.resize_(0)


def copy_storages(dst: WeightStorages, src: WeightStorages) -> None:
    """Give each released ``dst`` storage its size back and the used bytes of the matching ``src`` one.

    Raises:
        RuntimeError: ``src`` is not storage for storage the size of ``dst`` (another model).
    """
    if src.sizes != dst.sizes or src.used != dst.used:
        raise RuntimeError(
            f"The reloaded model's weights ({len(src.sizes)} storages, {sum(src.used):,} bytes) are not those put "
            f"to sleep ({len(dst.sizes)} storages, {sum(dst.used):,} bytes)."
        )
    for storage, size, used, source in zip(dst.storages, dst.sizes, dst.used, src.storages):
        storage.resize_(size)
        _bytes_of(storage)[:used].copy_(_bytes_of(source)[:used])


class OffloadedWeights:
    """Level 1: the used bytes of ``weights``' storages in a temporary file while they are released.

    Args:
        weights: from ``weight_storages``; released here, after their bytes are written.
    """

    def __init__(self, weights: WeightStorages) -> None:
        self.weights = weights
        self.offsets, total = [], 0
        for used in weights.used:
            self.offsets.append(total)
            total += -(-used // _ALIGN) * _ALIGN
        self.nbytes = total
        fd, self.path = tempfile.mkstemp(prefix="pagedllm-sleep-", suffix=".bin")
        os.close(fd)
        mapping = self._map()
        for storage, offset, used in zip(weights.storages, self.offsets, weights.used):
            mapping[offset : offset + used].copy_(_bytes_of(storage)[:used])
        del mapping  # unmapped: the bytes are the file's pages now
        release(weights)

    def _map(self) -> torch.Tensor:
        return torch.from_file(self.path, shared=True, size=max(self.nbytes, 1), dtype=torch.uint8)

    def restore(self) -> None:
        """Copy the bytes back into the storages and delete the file."""
        mapping: Optional[torch.Tensor] = self._map()
        assert mapping is not None
        w = self.weights
        for storage, size, offset, used in zip(w.storages, w.sizes, self.offsets, w.used):
            storage.resize_(size)
            _bytes_of(storage)[:used].copy_(mapping[offset : offset + used])
        mapping = None
        self.discard()

    def discard(self) -> None:
        """Delete the file (idempotent)."""
        if os.path.exists(self.path):
            os.unlink(self.path)


class SleepingWeights:
    """The weights of ``models`` while asleep at ``level`` (see the module): taken out of
    memory by the constructor, put back by ``wake_up``.

    Args:
        models: the models (``weight_storages``), their KV caches already unbound.
        level: 1 (into a file) or 2 (dropped).
    """

    def __init__(self, models: list[nn.Module], level: int) -> None:
        self.level = level
        self.opaque = OpaqueWeights(models)
        self.plain = self.opaque.take()
        self.weights = weight_storages(models)
        self.file: Optional[OffloadedWeights] = None
        if level == 1:
            for plain in self.plain:  # offloaded with the others
                self.weights.add(plain.untyped_storage(), plain.untyped_storage().nbytes())
            self.file = OffloadedWeights(self.weights)
        else:
            self.plain = []
            release(self.weights)

    def wake_up(self, load_model: Callable[[], nn.Module]) -> None:
        """Put the weights back: from the file, or (level 2) from ``load_model()``, a model
        loaded anew as the sleeping one was."""
        from pagedllm.model_executor.layers.cpu_gemm import pack_weight, separate_fp32_copies

        if self.file is not None:
            self.file.restore()
            self.opaque.put_back([pack_weight(p) for p in self.plain])
        else:
            with separate_fp32_copies():  # the reloaded model's copies die with it
                fresh = load_model()
            copy_storages(self.weights, weight_storages([fresh]))
            self.opaque.put_back(OpaqueWeights([fresh]).tensors)
        self.plain = []
