"""The GPU check's CPU-checkable parts: the benchmark's arithmetic and arguments, and the flow of
scripts/gpu_check.sh, run here against a stand-in `python3` that records what it is asked to run."""

from __future__ import annotations

import importlib.util
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_bench():
    spec = importlib.util.spec_from_file_location("gpu_attention", ROOT / "benchmarks" / "gpu_attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load_bench()


def test_roofline_arithmetic():
    # One request of 1024 tokens, 8 KV heads of 128, bf16: K and V, 4 MiB.
    assert bench.decode_kv_bytes(1, 1024, 2) == 1024 * 2 * 8 * 128 * 2 == 4 * 2**20
    assert bench.decode_kv_bytes(256, 8192, 2) == 256 * bench.decode_kv_bytes(1, 8192, 2)
    assert bench.roofline_us(4.8e12, 4.8e12) == pytest.approx(1e6)
    assert bench.roofline_us(bench.decode_kv_bytes(64, 8192, 2), bench.SPEC_HBM_BPS) == pytest.approx(447.4, abs=0.1)
    # Enough layers to read 4x the L2 per pass, 1..32 of them.
    assert bench.decode_layers(bench.decode_kv_bytes(1, 1024, 2)) == 32
    assert bench.decode_layers(int(bench.L2_BYTES)) == 4 and bench.decode_layers(10**10) == 1


def test_prefill_flops_count_every_visible_key():
    for lengths in ([(0, 1)], [(0, 7)], [(5, 3), (0, 4)], [(3072, 1024)]):
        keys_seen = sum(c + i + 1 for c, n in lengths for i in range(n))  # token i sees c + i + 1 keys
        assert bench.prefill_flops(lengths, hq=2, d=4) == 4 * 2 * 4 * keys_seen


def test_arguments_and_cases():
    args = bench.parse_args([])
    assert args.backends[0] == "triton" and {"flashinfer", "flash_attn", "torch_ref"} <= set(args.backends)
    assert args.contexts == [1024, 8192] and args.batches == [1, 16, 64, 256]
    cases = bench.plan_cases(args.backends, args.batches, args.contexts)
    triton = [(k, c) for b, k, c in cases if b == "triton"]
    assert [c for k, c in triton if k == "decode"] == [(b, c) for c in (1024, 8192) for b in (1, 16, 64, 256)]
    assert [c for k, c in triton if k == "prefill"] == list(bench.PREFILL_CASES)
    assert max(c[0] for b, k, c in cases if b == "torch_ref" and k == "decode") == bench.TORCH_REF_MAX_BATCH
    for bad in (["--batches", "1,x"], ["--contexts", "0"], ["--dtype", "fp32"]):
        with pytest.raises(SystemExit) as info:
            bench.parse_args(bad)
        assert info.value.code == 2


def test_dry_run_lists_the_cases(capsys):
    bench.main(["--dry-run", "--backends", "triton", "--batches", "1,256", "--contexts", "8192"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + len(bench.PREFILL_CASES)
    assert re.search(r"B=256 .*ctx=8192 .*KV +8589\.9 MB .*roofline +1789\.6 us", lines[1]), lines[1]


STAND_IN = """#!/usr/bin/env bash
echo "python3 $* | TRITON_INTERPRET=${TRITON_INTERPRET-unset}" >> "$CALLS"
case "$*" in
  -) cat > /dev/null; echo "torch 0.0, cuda 0.0, device STAND-IN" ;;
  "-m pytest"*) echo "3 passed, 2 skipped in 1.00s" ;;
  "-m varlen.run"*) echo "output tokens/s 123.4"; exit 0 ;;
  benchmarks/gpu_attention.py*) echo "device STAND-IN"; echo "SUMMARY (per attention layer)"; echo "decode  triton B=1" ;;
  "-m sim.profile"*) echo "22 token counts x 10 operators -> x/mlp.csv" ;;
  "-m sim.explain"*) echo "total_s 1.0" ;;
esac
"""


def test_gpu_check_runs_every_part_within_its_share(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    stub = bindir / "python3"
    stub.write_text(STAND_IN)
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    calls = tmp_path / "calls.log"
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"), CALLS=str(calls),
               TRITON_INTERPRET="1")
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr
    log = calls.read_text().splitlines()
    runs = [line.split(" | ")[0] for line in log if not line.startswith("python3 - ")]
    assert len(runs) == 6, log
    assert all("tests/backends/test_gpu_backends.py" in r and "-m gpu" in r for r in runs[:2])
    assert "-k bf16" in runs[0] and "-k fp16" in runs[1]
    assert "-m varlen.run backend=triton engine.device=cuda" in runs[2]
    budget = int(re.search(r"--budget (\d+)", runs[3]).group(1))
    assert 0 < budget <= 120 - 30, runs[3]
    assert "-m sim.profile --model big --device cuda --dtype bfloat16 --gpu h200_sxm" in runs[4]
    assert "-m sim.explain cost.model=measured" in runs[5] and "sim_model=local" in runs[5]
    assert all(line.endswith("TRITON_INTERPRET=unset") for line in log), "the GPU check must run compiled kernels"
    summary = res.stdout[res.stdout.index("GPU CHECK SUMMARY"):]
    for part in ("tests bf16: rc=0", "tests fp16: rc=0", "end to end (backend=triton engine.device=cuda): rc=0",
                 "output tokens/s", "benchmark: rc=0", "SUMMARY (per attention layer)",
                 "profile (sim.profile, 50M shape, bf16): rc=0", "-> x/mlp.csv"):
        assert part in summary, (part, summary)


def test_gpu_check_shares_fit_in_nine_minutes():
    text = (ROOT / "scripts" / "gpu_check.sh").read_text()

    def default(name: str) -> int:
        return int(re.search(rf"\$\{{{name}:-(\d+)\}}", text).group(1))

    dtypes = len(re.search(r'GPU_DTYPES:-([^}]*)\}', text).group(1).split())
    kill_grace = 10
    parts = dtypes * default("SHARE_TESTS") + default("SHARE_RUN") + default("SHARE_BENCH") + default("SHARE_PROFILE")
    assert parts + int(re.search(r"SUMMARY_RESERVE=(\d+)", text).group(1)) <= default("BUDGET")
    assert default("BUDGET") + kill_grace <= 9 * 60
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], check=True)
    assert sys.executable  # the check itself needs no GPU
