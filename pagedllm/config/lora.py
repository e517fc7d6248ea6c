"""``LoRAConfig``: multi-LoRA serving limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (``--enable-lora``; vLLM's ``LoRAConfig`` names and defaults):
    ``max_loras`` adapters in one step (device slots), ``max_lora_rank`` the largest rank,
    ``max_cpu_loras`` adapters kept loaded in CPU memory (LRU; None: ``max_loras``).

    Raises:
        ValueError: a value below 1, or ``max_cpu_loras`` < ``max_loras`` (vLLM's rule).
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None

    def __post_init__(self) -> None:
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)  # frozen: set once, here
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")
