"""Attention-only GPU benchmark of the varlen backends: decode against the HBM roofline, prefill throughput.

    python benchmarks/gpu_attention.py [--backends triton,flashinfer,flash_attn,torch_ref] [--dtype bf16]
                                       [--contexts 1024,8192] [--batches 1,16,64,256] [--budget 150]
                                       [--json out.json] [--dry-run]

One attention layer of Llama-3-8B's shape (32 query heads, 8 KV heads, head dim 128) through each
backend's real `prepare` + `forward` (so the K/V write at the slot mapping is included), on a paged
cache with scattered, shuffled blocks.

Decode: B requests, each with C tokens (C in `--contexts`) of which the last is new. A decode step reads
every cached K and V once, so its floor is roofline = KV bytes / HBM bandwidth; we report the
time per layer, the achieved bandwidth and the fraction of the roofline, against both the
bandwidth of a device-to-device copy measured here and the datasheet's 4.8 TB/s (H200). Enough
layers (separate caches) are cycled that the data read per step is several times the 60 MB L2,
so the numbers are HBM numbers. `step_overhead_us` is the host cost a step adds once, before
its layers: `prepare` (FlashInfer plans there) plus the first layer.

Prefill: whole prompts and a chunk after a cached prefix; tokens/s and TFLOP/s per layer, where
causal attention costs 4 * Hq * D * sum(new * cached + new * (new + 1) / 2) FLOPs.

`--budget` seconds: cases not yet started when it runs out are listed as skipped, and the
summary is still printed (scripts/gpu_check.sh gives this script a fixed share of its time).
`--dry-run` lists the cases with their KV bytes and roofline times, and runs nothing (any machine).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import numpy as np
import torch

from varlen import registry
from varlen.attention_api import AttentionBackend, BackendUnavailable
from varlen.batch import ForwardBatch, SeqSlice, build_batch

HQ, HKV, D = 32, 8, 128
SPEC_HBM_BPS = 4.8e12  # H200 datasheet
SPEC_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16 datasheet
L2_BYTES = 60e6
DEVICE = torch.device("cuda")  # a module global so that a CPU smoke run can point it elsewhere
DEFAULT_BLOCK = {"flash_attn": 256, "flashinfer": 16, "triton": 16, "torch_ref": 16}
TORCH_REF_MAX_BATCH = 64  # the reference loops over requests in Python: larger batches only cost time


def decode_kv_bytes(batch: int, context: int, dtype_bytes: int, hkv: int = HKV, d: int = D) -> int:
    """Bytes a decode step reads: every cached K and V of every request, once."""
    return batch * context * 2 * hkv * d * dtype_bytes


def roofline_us(nbytes: float, bytes_per_s: float) -> float:
    """The floor of a memory-bound kernel: bytes / bandwidth, in microseconds."""
    return nbytes / bytes_per_s * 1e6


def prefill_flops(lengths: list[tuple[int, int]], hq: int = HQ, d: int = D) -> float:
    """Causal attention FLOPs of (cached, new) requests: QK^T and PV, 2 FLOPs per multiply-add,
    over the keys each new token sees (cached + its own causal prefix)."""
    return 4 * hq * d * sum(n * c + n * (n + 1) / 2 for c, n in lengths)


def decode_layers(kv_bytes: int) -> int:
    """Layers (separate caches) cycled so that one pass reads >= 4x the L2: HBM, not L2, numbers."""
    return max(1, min(32, math.ceil(4 * L2_BYTES / kv_bytes)))


PREFILL_CASES = {"4 x 2048 new": [(0, 2048)] * 4, "4 x 1024 new after 3072 cached": [(3072, 1024)] * 4}


def plan_cases(backends: list[str], batches: list[int], contexts: list[int]) -> list[tuple[str, str, Any]]:
    """Every (backend, kind, case) the run would time, in order: decodes by context then batch, then prefills."""
    cases: list[tuple[str, str, Any]] = []
    for name in backends:
        for ctx in contexts:
            for b in batches:
                if name != "torch_ref" or b <= TORCH_REF_MAX_BATCH:
                    cases.append((name, "decode", (b, ctx)))
        cases += [(name, "prefill", label) for label in PREFILL_CASES]
    return cases


def measured_copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes read + written per second by a device-to-device copy: the practical HBM ceiling."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 10
    del src, dst
    return 2 * nbytes / seconds


def make_step(lengths: list[tuple[int, int]], block_size: int, seed: int = 0) -> tuple[ForwardBatch, int]:
    """(cached, new) per request → a batch over a shuffled pool of exactly the blocks needed."""
    need = [-(-(c + n) // block_size) for c, n in lengths]
    pool = sum(need)
    perm = np.random.default_rng(seed).permutation(pool)
    seqs, at = [], 0
    for i, ((cached, new), k) in enumerate(zip(lengths, need)):
        seqs.append(SeqSlice(np.zeros(new, np.int64), cached, perm[at:at + k], req_id=i))
        at += k
    return build_batch(seqs, block_size, pool), pool


def time_layers(backend: AttentionBackend, batch: ForwardBatch, pool: int, dtype: torch.dtype, layers: int,
                iters: int) -> dict[str, float]:
    dev = DEVICE
    backend.bind(HQ, HKV, D, dtype, batch.block_size, dev)  # as the model runner does, once
    caches = backend.allocate_kv_cache(layers, pool, batch.block_size, HKV, D, dtype, dev)
    for c in caches:
        c.normal_()
    n = batch.num_tokens
    q = torch.randn(n, HQ, D, device=dev, dtype=dtype)
    k = torch.randn(n, HKV, D, device=dev, dtype=dtype)
    v = torch.randn(n, HKV, D, device=dev, dtype=dtype)
    scale = D ** -0.5

    def step() -> None:
        meta = backend.prepare(batch, dev)
        for c in caches:
            backend.forward(q, k, v, c, meta, scale)

    step()  # JIT compilation and planning caches happen here, outside the timings
    torch.cuda.synchronize()
    # Host overhead once per step: prepare (which plans) + the first layer, synchronised.
    overhead = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        meta = backend.prepare(batch, dev)
        backend.forward(q, k, v, caches[0], meta, scale)
        torch.cuda.synchronize()
        overhead.append(time.perf_counter() - t0)
    meta = backend.prepare(batch, dev)
    backend.forward(q, k, v, caches[0], meta, scale)  # warm: the loop below times the layers alone
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        for c in caches:
            backend.forward(q, k, v, c, meta, scale)
    end.record()
    torch.cuda.synchronize()
    layer_s = start.elapsed_time(end) / 1e3 / (iters * layers)
    # A whole step, as an engine runs it: prepare (plans), all layers.
    t0 = time.perf_counter()
    for _ in range(max(1, iters // 4)):
        step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / max(1, iters // 4)
    caches.clear()  # free this size's cache before the next one is allocated
    torch.cuda.empty_cache()
    return {"layer_us": layer_s * 1e6, "step_ms": step_s * 1e3, "layers": layers,
            "step_overhead_us": (min(overhead) - layer_s) * 1e6}


def bench_decode(name: str, dtype: torch.dtype, b: int, context: int, block_size: int, copy_bps: float,
                 quick: bool) -> dict[str, Any]:
    elem = torch.empty(0, dtype=dtype).element_size()
    batch, pool = make_step([(context - 1, 1)] * b, block_size, seed=b)
    kv_bytes = decode_kv_bytes(b, context, elem)
    assert kv_bytes == int(batch.seq_lens.sum()) * 2 * HKV * D * elem
    iters = 3 if (quick or name == "torch_ref") else 20
    t = time_layers(registry.build("backend", name), batch, pool, dtype, decode_layers(kv_bytes), iters)
    roof_meas = roofline_us(kv_bytes, copy_bps)
    return dict(kind="decode", backend=name, batch=b, context=context, block_size=block_size,
                kv_mb=kv_bytes / 1e6, achieved_tbps=kv_bytes / t["layer_us"] / 1e6,
                roofline_us_spec=roofline_us(kv_bytes, SPEC_HBM_BPS), roofline_us_measured=roof_meas,
                frac_of_roofline_measured=roof_meas / t["layer_us"], **t)


def bench_prefill(name: str, dtype: torch.dtype, label: str, block_size: int, quick: bool) -> dict[str, Any]:
    lengths = PREFILL_CASES[label]
    batch, pool = make_step(lengths, block_size)
    flops = prefill_flops(lengths)
    iters = 2 if (quick or name == "torch_ref") else 10
    t = time_layers(registry.build("backend", name), batch, pool, dtype, 1, iters)
    return dict(kind="prefill", backend=name, case=label, block_size=block_size, tokens=batch.num_tokens,
                tokens_per_s=batch.num_tokens / (t["layer_us"] / 1e6),
                tflops=flops / (t["layer_us"] / 1e6) / 1e12,
                frac_of_bf16_peak=flops / (t["layer_us"] / 1e6) / SPEC_BF16_FLOPS, **t)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="triton,flashinfer,flash_attn,torch_ref")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--contexts", default="1024,8192", help="decode context lengths, comma-separated")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--block-size", type=int, default=0, help="0: each backend's usual size")
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--budget", type=float, default=0, help="seconds; 0: no limit")
    ap.add_argument("--json", default="", help="also write the rows here")
    ap.add_argument("--dry-run", action="store_true", help="list the cases and their rooflines, run nothing")
    args = ap.parse_args(argv)
    try:
        args.backends = [x for x in args.backends.split(",") if x]
        args.contexts = [int(x) for x in args.contexts.split(",") if x]
        args.batches = [int(x) for x in args.batches.split(",") if x]
    except ValueError as err:
        ap.error(f"--contexts and --batches take comma-separated integers ({err})")
    if not all(x >= 1 for x in args.contexts + args.batches):
        ap.error("--contexts and --batches must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    cases = plan_cases(args.backends, args.batches, args.contexts)
    if args.dry_run:
        elem = torch.empty(0, dtype=dtype).element_size()
        for name, kind, case in cases:
            if kind == "decode":
                kv = decode_kv_bytes(*case, elem)
                print(f"decode  {name:<10} B={case[0]:<4} ctx={case[1]:<6} KV {kv / 1e6:9.1f} MB  "
                      f"x{decode_layers(kv)} layers  roofline {roofline_us(kv, SPEC_HBM_BPS):8.1f} us (spec)")
            else:
                print(f"prefill {name:<10} {case:<31} {prefill_flops(PREFILL_CASES[case]) / 1e12:6.2f} TFLOP")
        return
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_attention.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    torch.set_num_threads(1)
    deadline = time.monotonic() + args.budget if args.budget else math.inf
    copy_bps = measured_copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {copy_bps / 1e12:.2f} TB/s "
          f"(datasheet {SPEC_HBM_BPS / 1e12:.1f}), dtype {args.dtype}, Hq={HQ} Hkv={HKV} D={D}", flush=True)
    rows: list[dict[str, Any]] = []
    notes: dict[str, list[str]] = {}  # per backend: why it or some of its cases did not run
    usable: dict[str, bool] = {}
    for name, kind, case in cases:
        bs = args.block_size or DEFAULT_BLOCK.get(name, 16)
        if name not in usable:
            try:
                backend = registry.build("backend", name)
                backend.check("cuda", dtype, bs)
                if getattr(backend, "interpreted", False):
                    raise BackendUnavailable("Triton's interpreter is on (TRITON_INTERPRET is set): nothing to time")
                usable[name] = True
            except (BackendUnavailable, ValueError) as err:
                usable[name] = False
                notes[name] = [f"skipped: {err}"]
                print(f"{name}: skipped: {err}", flush=True)
        if not usable[name]:
            continue
        if time.monotonic() > deadline:
            notes.setdefault(name, []).append(f"{kind} {case}: not run, time budget spent")
            continue
        try:
            row = (bench_decode(name, dtype, case[0], case[1], bs, copy_bps, args.quick) if kind == "decode"
                   else bench_prefill(name, dtype, case, bs, args.quick))
        except Exception as err:  # noqa: BLE001 - one case failing must not hide the others' numbers
            msg = f"{kind} {case} failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            print(f"{name}: {msg}", flush=True)
            notes.setdefault(name, []).append(msg[:200])
            torch.cuda.empty_cache()
            continue
        rows.append(row)
        print(_fmt(row), flush=True)
    print("\nSUMMARY (per attention layer)")
    for r in rows:
        print(_fmt(r))
    for name, why in notes.items():
        print(f"{name}: {'; '.join(why)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth_Bps": copy_bps, "dtype": args.dtype, "rows": rows, "notes": notes}, f,
                      indent=1)


def _fmt(r: dict[str, Any]) -> str:
    if r["kind"] == "decode":
        return (f"decode  {r['backend']:<10} B={r['batch']:<4} ctx={r['context']} bs={r['block_size']:<4} "
                f"{r['layer_us']:9.1f} us/layer  roofline {r['roofline_us_measured']:8.1f} us (copy bw) "
                f"{r['roofline_us_spec']:8.1f} us (spec)  {r['achieved_tbps']:5.2f} TB/s "
                f"= {100 * r['frac_of_roofline_measured']:5.1f}% of roofline; "
                f"step overhead {r['step_overhead_us']:7.1f} us")
    return (f"prefill {r['backend']:<10} {r['case']:<31} bs={r['block_size']:<4} {r['layer_us']:9.1f} us/layer  "
            f"{r['tokens_per_s'] / 1e6:7.2f} M tok/s  {r['tflops']:6.1f} TFLOP/s "
            f"({100 * r['frac_of_bf16_peak']:4.1f}% of dense bf16 peak)")


if __name__ == "__main__":
    main()
