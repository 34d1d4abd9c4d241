"""Run a function on ``P`` gloo ranks in spawned processes: how rlk tests its distributed code on a CPU.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` fresh processes (``torch.multiprocessing``,
spawn), initializes a gloo process group through a file store in a new temporary directory (no TCP port,
so parallel test runs never collide), calls ``fn(rank, world_size, *args)`` on each and raises the first
worker's exception with its traceback. ``fn`` must be importable by name (a module-level function).
"""

from __future__ import annotations

import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn, world_size: int, store: str, timeout_s: float, threads: int, args: tuple) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout_s: float = 300.0, threads: int = 1) -> None:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; a collective waiting longer than
    ``timeout_s`` fails instead of hanging. ``threads``: intra-op threads per rank (1: CPU kernels see
    the same threading whatever the number of ranks)."""
    with tempfile.TemporaryDirectory(prefix="rlk-dist-") as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(
            _entry, args=(fn, world_size, store, timeout_s, threads, args), nprocs=world_size, start_method="spawn"
        )
