"""One rank's loaded model as files that any engine can map: ``write_store`` / ``map_store``.

A store is a folder of three files, written to a temporary folder and renamed into place
(a store is whole or absent):

- ``weights.bin``: the bytes of every tensor storage of the model, each once, at page-aligned
  offsets (a tensor in oneDNN's opaque layout is stored plain);
- ``model.pkl``: the model object itself, pickled with each tensor replaced by a reference
  into ``weights.bin`` (storage, offset, shape, strides, dtype, whether a parameter);
- ``key.json``: the cache key (``pagedllm.preload.key``) and the store's size;
- later, ``profile.json``: the activation peak the first engine mapping it measured, and the
  settings it measured it with (``ipc_cache.record_activation_peak``).

``map_store`` maps ``weights.bin`` copy-on-write (``MAP_PRIVATE``): the tensors view the shared
pages, the file is never written, and a page an engine writes (none of the weights; an FP8 KV
scale) becomes that engine's own. The pages are faulted in when mapped (``MADV_POPULATE_READ``;
0.08 s for the 0.5B shape's 790 MB from the page cache), so the engine's memory profile sees
resident weights, as after a load, and the first forward does not read them in. Engines mapping one store share one copy of its pages; the
file's pages stay while any engine maps it, even once the store is deleted. Opaque tensors
are packed again when mapped (``pack_opaque``: private memory, not shared).
"""

from __future__ import annotations

import io
import json
import mmap
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

WEIGHTS_FILE, MODEL_FILE, KEY_FILE, PROFILE_FILE = "weights.bin", "model.pkl", "key.json", "profile.json"
_PAGE = mmap.PAGESIZE
#: madvise(2)'s MADV_POPULATE_READ (Linux 5.14; not in Python 3.11's ``mmap``).
_MADV_POPULATE_READ = 22


class _Writer(pickle.Pickler):
    """Pickles a model with its tensors as references into ``weights.bin``, collecting the storages."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.storages: list[torch.Tensor] = []  # uint8 views of whole storages
        self._index: dict[int, int] = {}  # storage data_ptr -> index
        self._pids: dict[int, tuple] = {}  # id(tensor) -> its reference (a tensor is stored once)

    def _storage_index(self, tensor: torch.Tensor) -> int:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._index:
            self._index[ptr] = len(self.storages)
            self.storages.append(torch.empty(0, dtype=torch.uint8).set_(storage))
        return self._index[ptr]

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        if id(obj) not in self._pids:
            self._pids[id(obj)] = self._reference(obj)
        return self._pids[id(obj)]

    def _reference(self, obj: torch.Tensor) -> tuple:
        is_parameter = isinstance(obj, nn.Parameter)
        if obj.is_mkldnn:
            plain = obj.to_dense()
            return ("opaque", self._storage_index(plain), 0, tuple(plain.shape), plain.stride(),
                    str(plain.dtype), is_parameter, id(obj))
        if obj.device.type != "cpu":
            raise ValueError(f"Only CPU tensors can be preloaded, not one on {obj.device}.")
        return ("tensor", self._storage_index(obj), obj.storage_offset(), tuple(obj.shape), obj.stride(),
                str(obj.dtype), is_parameter, id(obj))


class _Reader(pickle.Unpickler):
    """Unpickles a model whose tensors view ``mapping`` (uint8, the whole ``weights.bin``)."""

    def __init__(self, file: io.BytesIO, mapping: torch.Tensor, offsets: list[int],
                 pack_opaque: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__(file)
        self.storage = mapping.untyped_storage()
        self.offsets = offsets
        self.pack_opaque = pack_opaque
        self._objects: dict[int, torch.Tensor] = {}  # writer's object id -> tensor: one object per tensor

    def persistent_load(self, pid: Any) -> torch.Tensor:
        kind, index, offset, shape, stride, dtype_name, is_parameter, object_id = pid
        if object_id in self._objects:
            return self._objects[object_id]
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        itemsize = torch.empty(0, dtype=dtype).element_size()
        tensor = torch.empty(0, dtype=dtype).set_(self.storage, self.offsets[index] // itemsize + offset, shape, stride)
        if kind == "opaque":
            tensor = self.pack_opaque(tensor)
        if is_parameter:
            tensor = nn.Parameter(tensor, requires_grad=False)
        self._objects[object_id] = tensor
        return tensor


def write_store(model: nn.Module, directory: Path, key: dict[str, Any]) -> int:
    """Write ``model`` (loaded, on CPU) and its ``key`` as the store ``directory`` (replacing
    one there); returns the bytes of ``weights.bin``.

    Raises:
        ValueError: the model holds a tensor off the CPU or an object pickle cannot store.
    """
    skeleton = io.BytesIO()
    writer = _Writer(skeleton)
    try:
        writer.dump(model)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise ValueError(f"This model cannot be preloaded: {type(exc).__name__}: {exc}") from exc
    offsets, total = [], 0
    for storage in writer.storages:
        offsets.append(total)
        total += -(-storage.numel() // _PAGE) * _PAGE
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    with open(staging / WEIGHTS_FILE, "wb") as f:
        f.truncate(max(total, 1))
    out = torch.from_file(str(staging / WEIGHTS_FILE), shared=True, size=max(total, 1), dtype=torch.uint8)
    for storage, offset in zip(writer.storages, offsets):
        out[offset : offset + storage.numel()].copy_(storage)
    del out
    (staging / MODEL_FILE).write_bytes(skeleton.getvalue())
    (staging / KEY_FILE).write_text(json.dumps({"key": key, "offsets": offsets, "nbytes": total}, indent=1))
    if directory.exists():
        shutil.rmtree(directory)
    os.rename(staging, directory)
    return total


def read_key(directory: Path) -> dict[str, Any]:
    """The store's ``key.json``: ``{"key": ..., "offsets": [...], "nbytes": ...}``."""
    return json.loads((directory / KEY_FILE).read_text())


def map_store(directory: Path, pack_opaque: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """The model of the store ``directory``, its tensors viewing the mapped ``weights.bin``
    (see the module docstring); ``pack_opaque`` turns a plain tensor back into the opaque
    layout it was stored from (the loader's ``cpu_gemm.pack_weight``). The mapping lives as
    long as the model's tensors."""
    meta = read_key(directory)
    with open(directory / WEIGHTS_FILE, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    mapping = torch.frombuffer(mapped, dtype=torch.uint8)
    _populate(mapped, mapping)
    return _Reader(io.BytesIO((directory / MODEL_FILE).read_bytes()), mapping, meta["offsets"], pack_opaque).load()


def _populate(mapped: mmap.mmap, mapping: torch.Tensor) -> None:
    """Fault in every page of ``mapped`` (``mapping`` views it): one ``madvise``, or where the
    kernel refuses it (before Linux 5.14) a read of one byte per page."""
    try:
        mapped.madvise(_MADV_POPULATE_READ)
    except (OSError, AttributeError):
        int(mapping[::_PAGE].sum())
