"""Microbenchmark: the CPU tensor-parallel all-reduce, shared memory vs gloo.

    python benchmarks/all_reduce_bench.py                       # 2 ranks, one core each
    python benchmarks/all_reduce_bench.py --world-size 2 --hidden 896 --rows 1 2 4 8 16 32 512 --iters 2000

Starts ``--world-size`` processes (spawn), each pinned to its own cores as the
multiprocess executor pins its workers (``PAGEDLLM_CPU_OMP_THREADS_BIND``), joined by gloo,
and times ``GroupCoordinator.all_reduce`` on [rows, hidden] float32 tensors with the
shared-memory all-reduce (``pagedllm.distributed.shm_communicator``) and with gloo's.
Prints the median microseconds per call of rank 0 for each size. The decode step of the
0.5B shape all-reduces [batch, 896] twice per layer.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time


def _rank_main(rank: int, world_size: int, init_method: str, args: argparse.Namespace, results) -> None:
    import torch
    import torch.distributed as dist

    from pagedllm.distributed.parallel_state import GroupCoordinator, init_distributed_environment
    from pagedllm.distributed.shm_communicator import ShmCommunicator
    from pagedllm.platforms import current_platform

    current_platform.bind_worker(rank, world_size)
    init_distributed_environment(world_size, rank, init_method, rank, "gloo")
    ranks = list(range(world_size))
    group = dist.new_group(ranks, backend="gloo")
    impls = {"shm": GroupCoordinator(ranks, rank, group, ShmCommunicator(group, ranks)),
             "gloo": GroupCoordinator(ranks, rank, group)}
    for rows in args.rows:
        x = torch.randn(rows, args.hidden)
        for name, coordinator in impls.items():
            for _ in range(args.warmup):
                coordinator.all_reduce(x)
            samples = []
            for _ in range(args.iters):
                start = time.perf_counter()
                coordinator.all_reduce(x)
                samples.append(time.perf_counter() - start)
            if rank == 0:
                results.put((rows, name, statistics.median(samples) * 1e6))
    dist.barrier()
    impls["shm"].destroy()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 256])
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100)
    args = parser.parse_args()

    from pagedllm.distributed.utils import get_open_port

    init_method = f"tcp://127.0.0.1:{get_open_port()}"
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, args.world_size, init_method, args, results))
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    table: dict[int, dict[str, float]] = {}
    for _ in range(len(args.rows) * 2):
        rows, name, micros = results.get()
        table.setdefault(rows, {})[name] = micros
    for p in procs:
        p.join()
    print(f"all-reduce, {args.world_size} ranks, float32 [rows, {args.hidden}], median us per call")
    print(f"{'rows':>6} {'bytes':>9} {'shm':>9} {'gloo':>9} {'gloo/shm':>9}")
    for rows in args.rows:
        shm, gloo = table[rows]["shm"], table[rows]["gloo"]
        print(f"{rows:>6} {rows * args.hidden * 4:>9} {shm:>9.1f} {gloo:>9.1f} {gloo / shm:>9.2f}")


if __name__ == "__main__":
    main()
