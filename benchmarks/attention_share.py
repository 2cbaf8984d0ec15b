"""How much of a decode step is attention, by context length (torch_sdpa on the ~50M Qwen3 shape).

    python benchmarks/attention_share.py [--contexts 128 1024] [--batch 64]

The KV cache is filled with random values (timing does not depend on them), so no prefill is needed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import model_dir  # noqa: E402

import backends.torch_sdpa as sdpa  # noqa: E402
from backends import make_backend  # noqa: E402
from varlen.batch import SeqSlice, build_batch  # noqa: E402
from varlen.model_runner import ModelRunner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    path = model_dir("big")
    spent = {"attention": 0.0}
    inner = sdpa.TorchSdpaBackend.forward

    def timed(self, *args, **kw):
        t = time.perf_counter()
        out = inner(self, *args, **kw)
        spent["attention"] += time.perf_counter() - t
        return out

    sdpa.TorchSdpaBackend.forward = timed
    print(f"{'decodes':>8} {'context':>8} {'step ms':>9} {'attention ms':>13} {'share':>6}")
    for ctx in a.contexts:
        per = ctx // 16 + 2
        runner = ModelRunner(path, make_backend("torch_sdpa"), 16, a.batch * per)
        for cache in runner.kv_caches:
            cache.normal_()
        batch = build_batch([SeqSlice([5], ctx, np.arange(i * per, (i + 1) * per)) for i in range(a.batch)], 16)
        runner.execute(batch)
        spent["attention"], reps = 0.0, 5
        t = time.perf_counter()
        for _ in range(reps):
            runner.execute(batch)
        step, attn = (time.perf_counter() - t) / reps, spent["attention"] / reps
        print(f"{a.batch:>8} {ctx:>8} {step * 1e3:>9.1f} {attn * 1e3:>13.1f} {attn / step:>6.0%}")


if __name__ == "__main__":
    main()
