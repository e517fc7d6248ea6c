"""``LoRARequest``: which adapter a request runs with (vLLM's ``vllm.lora.request``).

Plain data (a msgspec Struct: it crosses the front end -> engine-core boundary inside an
``EngineCoreRequest``); no torch.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

import msgspec

#: The weight files a PEFT adapter folder may hold, in the order they are looked for.
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class LoRARequest(msgspec.Struct, omit_defaults=True):  # type: ignore[call-arg]
    """A LoRA adapter to apply to one request, vLLM's fields and order.

    Args:
        lora_name: a name for people (the server's model name for it).
        lora_int_id: a positive id, unique per adapter (vLLM's "globally unique ID").
        lora_path: the PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``
            or ``.bin``).
        base_model_name: the model the adapter was trained on (reported by ``/v1/models``).
        load_generation: set by the engine, not by users: a fingerprint of the adapter's
            weight file (``with_load_generation``) when the request arrived, so that an
            adapter re-written on disk under the same name and id is loaded again and never
            shares prefix-cache blocks with the old weights (``adapter_key``).

    Raises:
        ValueError: ``lora_int_id`` < 1 (vLLM's rule), or an empty ``lora_name``.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = None
    load_generation: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}.")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string.")

    @property
    def adapter_key(self) -> tuple[str, int, int]:
        """(name, int id, load generation): the adapter's identity in the engine (device
        slots, loaded-adapter cache, prefix-cache block hashes)."""
        return (self.lora_name, self.lora_int_id, self.load_generation)


def adapter_weight_file(lora_path: str) -> Path:
    """The weight file of a PEFT adapter folder.

    Raises:
        FileNotFoundError: the folder, its ``adapter_config.json`` or both weight files are
            missing (the message names the path).
    """
    folder = Path(lora_path).expanduser()
    if not (folder / "adapter_config.json").is_file():
        raise FileNotFoundError(f"No LoRA adapter at {lora_path!r}: adapter_config.json not found there.")
    for name in ADAPTER_WEIGHT_FILES:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(
        f"No LoRA adapter weights at {lora_path!r}: neither {' nor '.join(ADAPTER_WEIGHT_FILES)} found there."
    )


def with_load_generation(request: LoRARequest) -> LoRARequest:
    """``request`` with ``load_generation`` set from its weight file as it is now (path,
    inode, size, modification and status-change times in ns; 63 bits of their SHA-256).

    Raises:
        FileNotFoundError: see ``adapter_weight_file``.
    """
    weights = adapter_weight_file(request.lora_path)
    stat = os.stat(weights)
    stamp = f"{weights.resolve()}\0{stat.st_ino}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ctime_ns}".encode()
    generation = int.from_bytes(hashlib.sha256(stamp).digest()[:8], "big") >> 1
    return msgspec.structs.replace(request, load_generation=generation)
