"""KV memory of long generations on a sliding-window model, with and without window freeing.

    python benchmarks/window_kv.py [--window 128] [--requests 8] [--max-tokens 1024]

Two measurements, each against plain paging (`paged`) measured in the same run:

- real: the engine on a tiny Mistral-shaped model (every layer windowed) on CPU, greedy; the
  windowed allocator (`WindowedPagedAllocator`) must give the very same tokens.
- sim: the simulator on a Mistral-7B-shaped model (Llama-3-8B's KV shape: 32 layers x 8 KV heads
  x 128, bf16; window 4096) on an H100, 32 requests generating 16k tokens each, KV pool unbounded
  so that the peak is the demand itself.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's packages, not another install's


def real(window: int, n_req: int, max_tokens: int, block_size: int = 16) -> list[dict]:
    from varlen import LLM, SamplingParams
    from varlen.kv.windowed import WindowedPagedAllocator
    from varlen.model_runner import ModelRunner
    from varlen.tiny_model import write_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_tiny_model(Path(tmp) / "mistral", "mistral", sliding_window=window))
        prompts = [list(range(3 + i, 67 + i)) for i in range(n_req)]
        tokens = None
        for name, alloc in (("paged", "paged"),
                            ("paged_window", partial(WindowedPagedAllocator, sliding_window=window))):
            llm = LLM(model=path, backend="torch_sdpa", scheduler="chunked", allocator=alloc, block_size=block_size,
                      num_blocks=n_req * -(-(64 + max_tokens) // block_size), max_model_len=64 + max_tokens)
            t = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                                use_tqdm=False)
            wall = time.perf_counter() - t
            got = [o.token_ids for o in outs]
            same = "-" if tokens is None else ("yes" if got == tokens else "NO")
            tokens = tokens or got
            peak = max(s.kv_reserved_slots for s in llm.engine.steps)
            per_block = ModelRunner.kv_bytes_per_block(llm.runner.config, block_size, torch.float32)
            rows.append(dict(setting=f"real: tiny Mistral, window {window}, {n_req} x (64 + {max_tokens})",
                             allocator=name, peak_blocks=peak // block_size,
                             peak_mib=peak // block_size * per_block / 2**20, same_tokens=same, wall_s=wall))
    return rows


def sim(n_req: int = 32, prompt: int = 1024, output: int = 16384, window: int = 4096, block_size: int = 16) -> list[dict]:
    from sim.cost.hardware import HardwareSpec
    from sim.cost.roofline import RooflineCostModel
    from sim.executor import CostModelExecutor
    from sim.fast_forward import FastForwardEngine
    from sim.simulator import simulate
    from schedulers import ChunkedPolicy
    from varlen.assembly import build_engine
    from varlen.kv import PagedAllocator
    from varlen.kv.windowed import WindowedPagedAllocator
    from varlen.request import Request
    from varlen.sampling_params import SamplingParams
    from varlen.settings import EngineSizes

    cfg = yaml.safe_load((ROOT / "conf/sim_model/llama3_8b.yaml").read_text())["config"]
    hw = HardwareSpec.from_dict(yaml.safe_load((ROOT / "conf/hardware/h100_sxm.yaml").read_text()))
    cost = RooflineCostModel(cfg, hw)
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2  # bf16
    max_len = prompt + output
    rows = []
    for name, alloc in (("paged", partial(PagedAllocator, enable_prefix_caching=False)),
                        ("paged_window", partial(WindowedPagedAllocator, enable_prefix_caching=False,
                                                 sliding_window=window))):
        def make(clock):
            engine = build_engine(EngineSizes(n_req * -(-max_len // block_size), block_size, max_len),
                                  ChunkedPolicy(max_num_seqs=n_req, max_num_batched_tokens=2048), alloc,
                                  lambda _p, _n: CostModelExecutor(cost, clock), engine_class=FastForwardEngine,
                                  clock=clock)
            return engine, engine.executor

        reqs = [Request(str(i), [i % 500 + 1] * prompt, SamplingParams(max_tokens=output, ignore_eos=True))
                for i in range(n_req)]
        t = time.perf_counter()
        res = simulate(reqs, make)
        wall = time.perf_counter() - t
        peak = max(s.kv_reserved_slots for s in res.replicas[0].engine.steps)
        rows.append(dict(setting=f"sim: Mistral-7B KV shape, window {window}, {n_req} x ({prompt} + {output})",
                         allocator=name, peak_blocks=peak // block_size, peak_mib=peak * per_token / 2**20,
                         same_tokens="-", wall_s=wall))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--no-sim", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = real(a.window, a.requests, a.max_tokens) + ([] if a.no_sim else sim())
    print(f"{'setting':<58} {'allocator':<13} {'peak blocks':>11} {'peak MiB':>10} {'vs paged':>9} "
          f"{'same tokens':>11} {'wall s':>7}")
    base = {}
    for r in rows:
        base.setdefault(r["setting"], r["peak_blocks"])
        print(f"{r['setting']:<58} {r['allocator']:<13} {r['peak_blocks']:>11} {r['peak_mib']:>10.1f} "
              f"{r['peak_blocks'] / base[r['setting']]:>9.3f} {r['same_tokens']:>11} {r['wall_s']:>7.1f}")


if __name__ == "__main__":
    main()
