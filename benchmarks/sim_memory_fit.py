"""The constants of sim/memory.py's estimate, measured: peak RSS of synthetic simulations (one
process each) at two sizes and two output lengths, with and without token-level output.

    python benchmarks/sim_memory_fit.py [--sizes 2000,10000] [--outputs 16,512]

Per request = (peak(large) - peak(small)) / (large - small) at each output length; per output token
= the difference of those over the difference of the lengths; fixed per request = the rest. Runs
the default synthetic workload (1 replica, 4 req/s) with output.requests=false; about 20 s of CPU.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def child(n: int, out: int, token_times: bool) -> None:
    from hydra import compose, initialize_config_dir

    from sim.run import CONF, simulate_config

    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("sim", overrides=["workload=synthetic", f"workload.limit={n}", f"workload.output_len={out}",
                                        "output.requests=false", "progress.enabled=false", "memory_limit_gb=1000",
                                        f"output.token_times={str(token_times).lower()}"])
    simulate_config(cfg)
    print(json.dumps({"peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def peak(n: int, out: int, token_times: bool) -> float:
    r = subprocess.run([sys.executable, __file__, "--child", str(n), str(out), str(int(token_times))],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])["peak_bytes"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="2000,10000")
    ap.add_argument("--outputs", default="16,512")
    ap.add_argument("--child", nargs=3, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], a.child[1], bool(a.child[2]))
        return
    small, large = (int(x) for x in a.sizes.split(","))
    short, long = (int(x) for x in a.outputs.split(","))
    for token_times in (False, True):
        per = {}
        for out in (short, long):
            lo, hi = peak(small, out, token_times), peak(large, out, token_times)
            per[out] = (hi - lo) / (large - small)
            print(f"token_times={token_times} output {out}: peak {lo / 1e6:.0f} MB at {small}, {hi / 1e6:.0f} MB at "
                  f"{large}: {per[out]:,.0f} B a request", flush=True)
        per_token = (per[long] - per[short]) / (long - short)
        print(f"token_times={token_times}: BYTES_PER_REQUEST ~ {per[short] - per_token * short:,.0f}, "
              f"BYTES_PER_OUTPUT_TOKEN ~ {per_token:,.1f}", flush=True)


if __name__ == "__main__":
    main()
