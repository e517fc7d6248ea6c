"""The arithmetic of splitting a model across tensor-parallel ranks."""

from __future__ import annotations


def divide(numerator: int, denominator: int) -> int:
    """``numerator / denominator`` for sizes that must split evenly across ranks.

    Raises:
        ValueError: if ``denominator`` is not positive or does not divide ``numerator``.
    """
    if denominator <= 0 or numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}: it cannot be split evenly across ranks.")
    return numerator // denominator


def kv_heads_per_rank(total_num_kv_heads: int, tp_size: int) -> int:
    """KV heads each of ``tp_size`` ranks holds: ``total / tp_size``, or 1 when there are at
    least as many ranks as KV heads (each head is then replicated on ``tp_size / total``
    ranks, as vLLM does).

    Raises:
        ValueError: if neither count divides the other.
    """
    if tp_size >= total_num_kv_heads:
        divide(tp_size, total_num_kv_heads)
        return 1
    return divide(total_num_kv_heads, tp_size)


def get_open_port() -> int:
    """A TCP port on 127.0.0.1 free now (the OS's choice), for ``tcp://127.0.0.1:<port>``."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
