"""Latency per collective: the shared-memory communicator against gloo, interleaved in one run.

Ranks are spawned processes with one intra-op thread each, joined by ``init_tp(comm="shm")``, which
also builds the gloo process group, so both paths run on the same ranks: per size, blocks of gloo
and shm all-reduces alternate and each path's median per-call latency (rank 0's clock, every rank
synchronised before each block) is reported.

    .venv/bin/python benchmarks/allreduce.py [--ranks 2 4] [--dtypes bfloat16 float32] [--iters 200]

Prints a markdown table (docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from worker_svc.parallel.group import destroy_tp, free_port, init_tp  # noqa: E402

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20]
BLOCKS = 5


def _time_block(fn, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def _rank(rank: int, size: int, addr: str, dtypes: list[str], iters: int, results) -> None:
    torch.set_num_threads(1)
    tp = init_tp(rank, size, addr, comm="shm")
    try:
        rows = []
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            for nbytes in SIZES:
                t = torch.randn(nbytes // torch.empty(0, dtype=dtype).element_size()).to(dtype)
                n = max(10, iters if nbytes <= (256 << 10) else iters // 10)
                times: dict[str, list[float]] = {"gloo": [], "shm": []}
                paths = {
                    "gloo": lambda t=t: dist.all_reduce(t, group=tp.group),
                    "shm": lambda t=t: tp.communicator.all_reduce(t),
                }
                for path in paths.values():  # warm-up
                    for _ in range(5):
                        path()
                for _ in range(BLOCKS):
                    for name, path in paths.items():
                        dist.barrier(group=tp.group)
                        times[name].append(_time_block(path, n))
                if rank == 0:
                    gloo, shm = statistics.median(times["gloo"]), statistics.median(times["shm"])
                    rows.append((size, dtype_name, nbytes, gloo * 1e6, shm * 1e6))
        if rank == 0:
            results.extend(rows)
    finally:
        destroy_tp(tp)


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    print("| ranks | dtype | size | gloo us | shm us | gloo / shm |")
    print("|---|---|---|---|---|---|")
    for size in args.ranks:
        with mp.Manager() as manager:
            results = manager.list()
            mp.spawn(_rank, args=(size, f"127.0.0.1:{free_port()}", args.dtypes, args.iters, results), nprocs=size)
            for ranks, dtype, nbytes, gloo, shm in results:
                print(f"| {ranks} | {dtype} | {_size(nbytes)} | {gloo:.1f} | {shm:.1f} | {gloo / shm:.1f}x |",
                      flush=True)


if __name__ == "__main__":
    main()
