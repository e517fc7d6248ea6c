"""``CacheConfig``: the paged KV cache (block size, memory budget, dtype, prefix caching)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from pagedllm import envs

if TYPE_CHECKING:
    import torch

    from pagedllm.config.engine_args import EngineArgs

SUPPORTED_BLOCK_SIZES = (8, 16, 32)

#: ``--kv-cache-dtype`` FP8 values -> torch dtype attribute names. "fp8" is e4m3, as vLLM on
#: CUDA (OCP FP8: e4m3 has 3 mantissa bits and reaches +-448; e5m2 2 bits, +-57344).
KV_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size (tokens), memory budget (bytes), prefix caching.

    ``kv_cache_memory_bytes`` is an exact budget, from ``kv_cache_memory_source`` (the
    argument, or ``PAGEDLLM_CPU_KVCACHE_SPACE`` / ``VLLM_CPU_KVCACHE_SPACE`` in GiB on CPU).
    Without it the budget is what ``gpu_memory_utilization`` leaves, and on CPU at most
    ``max_kv_cache_tokens`` tokens: what the configuration can use at once.
    ``num_gpu_blocks_override`` (vLLM's) sets the number of blocks exactly, with no sizing.
    The number of blocks the budget buys is the engine's run-time state, not configuration
    (``EngineCore.num_gpu_blocks``; the clients' ``num_gpu_blocks``).
    """

    block_size: int
    gpu_memory_utilization: float
    kv_cache_memory_bytes: Optional[int]
    enable_prefix_caching: bool
    prefix_caching_hash_algo: str
    kv_cache_memory_source: str = "kv_cache_memory_bytes"
    max_kv_cache_tokens: Optional[int] = None
    num_gpu_blocks_override: Optional[int] = None
    #: vLLM's ``--kv-cache-dtype``: "auto" (the model's dtype) or a key of ``KV_CACHE_DTYPES``.
    cache_dtype: str = "auto"
    #: vLLM's ``--calculate-kv-scales``: FP8 scales from the first batch (``pagedllm.attention.kv_cache_quant``).
    calculate_kv_scales: bool = False
    #: vLLM's ``--kv-offloading-size``: the second KV tier in GiB (all ranks together; None: none).
    kv_offloading_size: Optional[float] = None
    #: ``--kv-offloading-path``: the second tier's directory (None: host RAM).
    kv_offloading_path: Optional[str] = None

    def __post_init__(self) -> None:
        if self.kv_offloading_size is not None and self.kv_offloading_size <= 0:
            raise ValueError(f"kv_offloading_size must be > 0 GiB, got {self.kv_offloading_size}.")
        if self.kv_offloading_path is not None and self.kv_offloading_size is None:
            raise ValueError("kv_offloading_path needs kv_offloading_size (the second KV tier's size in GiB).")
        if self.kv_offloading_size is not None and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size keeps blocks evicted from the prefix cache: it needs prefix caching "
                             "(--enable-prefix-caching).")

    @property
    def kv_offloading_bytes(self) -> int:
        """The second tier's size in bytes (0: none)."""
        return int((self.kv_offloading_size or 0) * 2**30)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, max_model_len: int) -> CacheConfig:
        """The cache of ``args``: the budget is ``kv_cache_memory_bytes``, else the CPU
        KV-cache environment variable (``CPU_KVCACHE_SPACE_ENV_VARS``), else sized from
        ``gpu_memory_utilization``.

        Raises:
            ValueError: a KV-cache environment variable that is not a number.
        """
        kv_cache_memory_bytes, source = args.kv_cache_memory_bytes, "kv_cache_memory_bytes"
        if kv_cache_memory_bytes is None:
            kv_cache_memory_bytes, source = _cpu_kvcache_space_env()
        return cls(
            block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enable_prefix_caching=args.enable_prefix_caching,
            prefix_caching_hash_algo=args.prefix_caching_hash_algo,
            kv_cache_memory_source=source,
            max_kv_cache_tokens=cpu_max_kv_cache_tokens(args.max_num_seqs, max_model_len, args.enable_prefix_caching),
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            cache_dtype=args.kv_cache_dtype,
            calculate_kv_scales=args.calculate_kv_scales,
            kv_offloading_size=args.kv_offloading_size,
            kv_offloading_path=args.kv_offloading_path,
        )

    def kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The cache's element type: ``model_dtype`` for "auto", else the FP8 type of
        ``KV_CACHE_DTYPES`` (1 byte per element)."""
        if self.cache_dtype == "auto":
            return model_dtype
        import torch

        return getattr(torch, KV_CACHE_DTYPES[self.cache_dtype])

    def cache_dtype_name(self, model_dtype: torch.dtype) -> str:
        """The cache's dtype as the start-up log and ``/metrics`` name it: the model's dtype
        for "auto" (e.g. "bfloat16"), else "fp8_e4m3" / "fp8_e5m2" ("fp8" is e4m3)."""
        if self.cache_dtype == "auto":
            return str(model_dtype).removeprefix("torch.")
        return "fp8_e5m2" if self.cache_dtype == "fp8_e5m2" else "fp8_e4m3"


#: Environment variables giving the CPU KV-cache size in GiB (vLLM-CPU's is the second).
CPU_KVCACHE_SPACE_ENV_VARS = envs.PAGEDLLM_CPU_KVCACHE_SPACE.names


def _cpu_kvcache_space_env() -> tuple[Optional[int], str]:
    """(bytes, source) from the first of ``CPU_KVCACHE_SPACE_ENV_VARS`` set to a positive
    number of GiB on CPU, else ``(None, "")``. 0 means unset, as in vLLM-CPU.

    Raises:
        ValueError: a value that is not a number.
    """
    from pagedllm.platforms import current_platform

    if not current_platform.is_cpu:
        return None, ""
    setting = envs.PAGEDLLM_CPU_KVCACHE_SPACE.lookup()
    if setting is None:
        return None, ""
    return int(setting.value * 2**30), f"{setting.name}={setting.text.strip()} GiB"


def cpu_max_kv_cache_tokens(max_num_seqs: int, max_model_len: int, enable_prefix_caching: bool) -> Optional[int]:
    """On CPU, the most KV-cache tokens the configuration can use: ``max_num_seqs`` sequences
    of ``max_model_len`` tokens, twice that with prefix caching (finished requests' blocks
    stay cached while as many again run). None on GPU, where vLLM fills the device."""
    from pagedllm.platforms import current_platform

    if not current_platform.is_cpu:
        return None
    return max_num_seqs * max_model_len * (2 if enable_prefix_caching else 1)
