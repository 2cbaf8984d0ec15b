"""How much of a decode step is attention, by context length and backend (the ~50M Qwen3 shape).

    python benchmarks/attention_share.py [--contexts 128 1024] [--batch 64] [--backends torch_paged torch_sdpa]

The KV cache is filled with random values (timing does not depend on them), so no prefill is needed.
Best of `--repeats` steps; the last column is the step time relative to the first backend's.
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

from varlen import registry  # noqa: E402
from varlen.batch import SeqSlice, build_batch  # noqa: E402
from varlen.model_runner import ModelRunner  # noqa: E402


class Timed:
    """Wraps a backend, adding up the time spent in its forward (all layers of a step)."""

    def __init__(self, inner):
        self.inner, self.spent = inner, 0.0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, *args, **kwargs):
        t = time.perf_counter()
        out = self.inner.forward(*args, **kwargs)
        self.spent += time.perf_counter() - t
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backends", nargs="+", default=["torch_paged", "torch_sdpa"])
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    path = model_dir("big")
    print(f"{'backend':<12} {'decodes':>8} {'context':>8} {'step ms':>9} {'attention ms':>13} {'share':>6} "
          f"{'step vs first':>14}")
    for ctx in a.contexts:
        per = ctx // 16 + 2
        first = None
        for name in a.backends:
            timed = Timed(registry.build("backend", name))
            runner = ModelRunner(path, timed, 16, a.batch * per)
            for cache in runner.kv_caches:
                cache.normal_()
            batch = build_batch([SeqSlice([5], ctx, np.arange(i * per, (i + 1) * per)) for i in range(a.batch)], 16)
            runner.execute(batch)
            best = (float("inf"), 0.0)
            for _ in range(a.repeats):
                timed.spent = 0.0
                t = time.perf_counter()
                runner.execute(batch)
                best = min(best, (time.perf_counter() - t, timed.spent))
            step, attn = best
            first = first or step
            print(f"{name:<12} {a.batch:>8} {ctx:>8} {step * 1e3:>9.1f} {attn * 1e3:>13.1f} {attn / step:>6.0%} "
                  f"{step / first:>13.2f}x")


if __name__ == "__main__":
    main()
