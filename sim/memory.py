"""The memory a simulation will need, estimated before it starts, and the refusal of a workload
that would not fit (`memory_limit_gb`; null: the memory available when the run starts)."""

from __future__ import annotations

from typing import Any, Mapping

from varlen.cli import SettingError

# Peak resident bytes a simulated request adds: a fixed part, one per output token and, with
# token_ids=true, one per prompt token id. Without token-level output (output.token_times=false)
# requests are built as they arrive, an ended one is a row of columns and the step log keeps the
# metrics' per-step columns (32 bytes a step, the per-token part); with it, every request keeps its
# token times and the log its step records.
# Fitted by benchmarks/sim_memory_fit.py (peak RSS of synthetic runs of 2,000 and 10,000 requests
# with 16- and 512-token outputs, one replica at 4 req/s: light load, many steps a request, so an
# upper bound at fleet loads); refit when what a request keeps changes.
BYTES_PER_REQUEST = 2_200
BYTES_PER_OUTPUT_TOKEN = 6
TOKEN_LEVEL_BYTES_PER_REQUEST = 5_500
TOKEN_LEVEL_BYTES_PER_OUTPUT_TOKEN = 35
BYTES_PER_PROMPT_TOKEN_ID = 8
SAMPLE = 4096  # synthetic lengths are estimated from this many generated requests


def estimate_bytes(requests: int, mean_prompt: float, mean_output: float, token_ids: bool,
                   token_times: bool = False) -> float:
    if token_times:
        per = TOKEN_LEVEL_BYTES_PER_REQUEST + TOKEN_LEVEL_BYTES_PER_OUTPUT_TOKEN * mean_output
    else:
        per = BYTES_PER_REQUEST + BYTES_PER_OUTPUT_TOKEN * mean_output
    if token_ids:
        per += BYTES_PER_PROMPT_TOKEN_ID * mean_prompt
    return requests * per


def available_bytes() -> float | None:
    """MemAvailable (Linux), else None: no default limit where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def limit_bytes(limit_gb: float | None) -> tuple[float | None, str]:
    """(the limit in bytes or None for none, how it was set)."""
    if limit_gb is not None:
        if isinstance(limit_gb, bool) or not isinstance(limit_gb, (int, float)) or not limit_gb > 0:
            raise SettingError(f"memory_limit_gb={limit_gb!r}: give a size in GB above 0, or null for the "
                               "memory available")
        return float(limit_gb) * 1e9, "memory_limit_gb"
    return available_bytes(), "the memory available now; memory_limit_gb sets it"


def check_trace(trace: Any, token_ids: bool, limit_gb: float | None, requests: int | None = None,
                token_times: bool = False) -> None:
    """Refuse (one-line SettingError) the requests of `trace`, or `requests` of its kind (the trace
    a sample), when their estimated memory exceeds the limit (token_times: token-level output)."""
    limit, how = limit_bytes(limit_gb)
    rows = trace.requests
    if limit is None or not rows:
        return
    n = len(rows) if requests is None else requests
    mean_prompt = sum(r.prompt_len for r in rows) / len(rows)
    mean_output = sum(r.output_len for r in rows) / len(rows)
    need = estimate_bytes(n, mean_prompt, mean_output, token_ids, token_times)
    if need <= limit:
        return
    per = need / n
    fits = int(limit // per)
    raise SettingError(
        f"workload of {n:,} requests needs an estimated {need / 1e9:,.1f} GB ({per / 1e3:,.1f} KB a request, "
        f"{mean_output:,.0f} output tokens on average) but the limit is {limit / 1e9:,.1f} GB ({how}); "
        f"set workload.limit={fits} or fewer, or raise memory_limit_gb"
        + (" (output.token_times=false needs less)" if token_times else ""))


def check_synthetic(workload: Mapping[str, Any], limit_gb: float | None, token_times: bool = False) -> None:
    """Before generating a large synthetic workload: its lengths from a sample, its size from `limit`."""
    from varlen.workload import load_workload

    n = workload.get("limit")
    if str(workload.get("source", "synthetic")) != "synthetic" or n is None or n <= SAMPLE:
        return
    sample, _ = load_workload({**workload, "limit": SAMPLE})
    if sample is not None:
        check_trace(sample, bool(workload.get("token_ids")), limit_gb, requests=int(n), token_times=token_times)
