"""varlen's fused per-layer kernels (varlen/layer_kernels.py) on and off, on the same steps in one
process: one pure decode step holding every request and one prefill chunk, each re-executed
alternately with the fused forwards swapped in and out, `--repeats` times; the best thread CPU time
of each, split into linear layers (nn.Linear incl. the LM head), the attention backend and the rest
(norms, RoPE, activation, residual adds, HF's module code). Thread CPU time: robust to other load
on a shared machine, unlike wall time; it counts the calling thread only, so compare at the default
`--threads 1` (with more, the workers' share is missing and their spin-waits distort the rest).

    python benchmarks/layer_kernels.py                         # the ~50M Qwen3 shape, 1 thread
    taskset -c 1 python benchmarks/layer_kernels.py --seqs 64 --context 512
    python benchmarks/layer_kernels.py --model tiny --repeats 5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from throughput import model_dir  # noqa: E402
from varlen import LLM, SamplingParams  # noqa: E402
from varlen import layer_kernels as lk  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["big", "tiny"], default="big")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seqs", type=int, default=32, help="requests (the decode step's rows)")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--chunk", type=int, default=512, help="token budget per step (the prefill chunk)")
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    # Outputs long enough that every request is decoding together after the last chunk.
    out_len = a.seqs * a.context // a.chunk + 8
    llm = LLM(str(model_dir(a.model)), block_size=16, max_num_seqs=a.seqs, max_model_len=a.context + out_len,
              max_num_batched_tokens=max(a.chunk, a.seqs), kv_cache_memory="1GiB")
    runner = llm.runner
    print(f"{runner.model.config.num_hidden_layers} layers, {a.threads} thread(s), backend {llm.backend.name} | "
          f"layer kernels {runner.layer_kernels} | linear layers {runner.linear_kernel}")
    fused = {m: m.__dict__["forward"] for m in runner.model.modules()
             if getattr(m.__dict__.get("forward"), "func", None) in lk.KINDS}
    if not fused:
        sys.exit(f"nothing is fused ({runner.layer_kernels}); nothing to compare")

    steps: dict[str, object] = {}
    execute = runner.execute

    def capture(batch):
        if batch.is_pure_decode and batch.num_seqs == a.seqs:
            steps.setdefault("decode", batch)
        elif batch.num_tokens >= min(a.chunk, a.seqs * a.context) and not batch.is_pure_decode:
            steps.setdefault("prefill", batch)
        return execute(batch)

    runner.execute = capture
    prompts = [[(i * 7 + j) % 1000 + 3 for j in range(a.context)] for i in range(a.seqs)]
    llm.generate(prompts, SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True))
    runner.execute = execute

    acc = {"linear": 0.0, "attention": 0.0}

    def lin_pre(module, args):
        module._t0 = time.thread_time()

    def lin_post(module, args, out):
        acc["linear"] += time.thread_time() - module._t0

    for m in runner.model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lin_pre)
            m.register_forward_hook(lin_post)
    attend = runner.backend.forward

    def timed_attention(*args, **kwargs):
        t = time.thread_time()
        out = attend(*args, **kwargs)
        acc["attention"] += time.thread_time() - t
        return out

    runner.backend.forward = timed_attention

    def swap(on: bool) -> None:
        for m, f in fused.items():
            if on:
                m.forward = f
            else:
                del m.forward

    print(f"\nthread CPU ms, best of {a.repeats} (fused and unfused alternating on the same step):")
    print(f"{'step':<8} {'tokens':>6} {'kernels':<8} {'total':>8} {'linear':>8} {'attention':>9} {'rest':>8} "
          f"{'rest share':>10}")
    for kind, batch in steps.items():
        best: dict[bool, tuple] = {}
        for _ in range(a.repeats):
            for on in (True, False):
                swap(on)
                acc.update(linear=0.0, attention=0.0)
                t = time.thread_time()
                runner.execute(batch)
                total = time.thread_time() - t
                if on not in best or total < best[on][0]:
                    best[on] = (total, acc["linear"], acc["attention"])
        swap(True)
        for on in (True, False):
            total, lin, att = best[on]
            rest = total - lin - att
            print(f"{kind:<8} {batch.num_tokens:>6} {'fused' if on else 'unfused':<8} {total * 1e3:>8.2f} "
                  f"{lin * 1e3:>8.2f} {att * 1e3:>9.2f} {rest * 1e3:>8.2f} {rest / total:>10.0%}")
        r_on = best[True][0] - best[True][1] - best[True][2]
        r_off = best[False][0] - best[False][1] - best[False][2]
        print(f"{kind:<8} rest {r_off * 1e3:.2f} -> {r_on * 1e3:.2f} ms ({1 - r_on / r_off:.0%} less); "
              f"step {best[False][0] * 1e3:.2f} -> {best[True][0] * 1e3:.2f} ms ({best[False][0] / best[True][0]:.3f}x)")


if __name__ == "__main__":
    main()
