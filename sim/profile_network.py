"""Collective timings for `python -m sim.profile --collectives N`: all-reduce over 2, 4, ... N
workers and send/recv between two (half a ping-pong), rank 0's milliseconds per message size,
written as DIR/network/<node>/{all_reduce,send_recv}.csv like the shipped tables
(sim/profiles/README.md); sim/cost/collectives.py reads them.
"""

from __future__ import annotations

import csv
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

GPU_SIZES = tuple(2 ** i for i in range(10, 29))  # 1 KiB .. 256 MiB: a decode's to a long prefill's activations
CPU_SIZES = (1024, 16384, 262144)
WARMUP = 2


def worker_counts(max_workers: int) -> list[int]:
    """2, 4, 8, ... up to max_workers, and max_workers itself."""
    counts, w = [], 2
    while w < max_workers:
        counts.append(w)
        w *= 2
    return counts + [max_workers] if max_workers >= 2 else []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, device: str, sizes: tuple[int, ...], repeats: int, dtype: str,
            result: str) -> None:
    import torch
    import torch.distributed as dist

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    dev = torch.device(f"cuda:{rank}" if cuda else "cpu")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    tdtype = getattr(torch, dtype)
    elt = torch.empty(0, dtype=tdtype).element_size()
    times: dict[str, dict[int, list[float]]] = {"all_reduce": {}, "send_recv": {}}
    try:
        for size in sizes:
            x = torch.ones(max(1, size // elt), dtype=tdtype, device=dev)
            ar = []
            for i in range(WARMUP + repeats):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                dist.all_reduce(x)
                sync()
                if i >= WARMUP:
                    ar.append((time.perf_counter() - t0) * 1e3)
            times["all_reduce"][size] = ar
            if world == 2:
                sr = []
                for i in range(WARMUP + repeats):
                    dist.barrier()
                    sync()
                    t0 = time.perf_counter()
                    if rank == 0:
                        dist.send(x, 1)
                        dist.recv(x, 1)
                    else:
                        dist.recv(x, 0)
                        dist.send(x, 0)
                    sync()
                    if i >= WARMUP:
                        sr.append((time.perf_counter() - t0) * 1e3 / 2)
                times["send_recv"][size] = sr
        if rank == 0:
            Path(result).write_text(json.dumps({k: {str(s): v for s, v in d.items()} for k, d in times.items()}))
    finally:
        dist.destroy_process_group()


def time_collectives(workers: int, device: str = "cpu", sizes: tuple[int, ...] = CPU_SIZES, repeats: int = 5,
                     dtype: str = "float32") -> dict[str, dict[int, list[float]]]:
    """Rank 0's timings (ms) of each collective per message size, `workers` processes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result = str(Path(tmp) / "times.json")
        # fork on CPU starts workers with torch already imported; CUDA cannot be forked.
        mp.start_processes(_worker, args=(workers, _free_port(), device, tuple(sizes), repeats, dtype, result),
                           nprocs=workers, join=True, start_method="spawn" if device.startswith("cuda") else "fork")
        raw = json.loads(Path(result).read_text())
    return {k: {int(s): v for s, v in d.items()} for k, d in raw.items()}


def profile_collectives(out: Path, node: str, max_workers: int, device: str = "cpu",
                        sizes: tuple[int, ...] | None = None, repeats: int = 5,
                        dtype: str = "float32") -> dict[str, Path]:
    """All-reduce at every worker count of `worker_counts(max_workers)`, send/recv between two;
    the tables' paths by collective."""
    sizes = tuple(sizes or (GPU_SIZES if device.startswith("cuda") else CPU_SIZES))
    rows: dict[str, list[dict[str, Any]]] = {"all_reduce": [], "send_recv": []}
    for w in worker_counts(max_workers):
        for kind, by_size in time_collectives(w, device, sizes, repeats, dtype).items():
            for size, ms in sorted(by_size.items()):
                rows[kind].append({
                    **{f"time_stats.{kind}.{k}": v for k, v in _stats(ms).items()},
                    "rank": 0, "num_workers": 2 if kind == "send_recv" else w, "size": size, "collective": kind,
                    "devices_per_node": 2 if kind == "send_recv" else w, "max_devices_per_node": max_workers})
    folder = out / "network" / node
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for kind, table in rows.items():
        if not table:
            continue
        paths[kind] = path = folder / f"{kind}.csv"
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["", *table[0]])  # the shipped tables' unnamed index column
            w.writeheader()
            w.writerows({"": i, **r} for i, r in enumerate(table))
    return paths


def _stats(ms: list[float]) -> dict[str, float]:
    return {"min": min(ms), "max": max(ms), "mean": statistics.fmean(ms), "median": statistics.median(ms),
            "std": statistics.pstdev(ms)}
