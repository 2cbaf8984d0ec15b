"""Decode steps, the real engine against `cost.model=measured`: the whole step and its attention, per cell.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 taskset -c 1 python3 benchmarks/measured_decode.py            # ~3 min CPU
    ... --profiles DIR      # reuse a build (sim.profile's folder layout) instead of timing one

Builds `measured` for the ~50M benchmark model as benchmarks/sim_fidelity.py's MeasuredProfiler does
(operator and attention tables, one engine pass), or loads one. Then, for each cell (requests x cached
tokens), one `generate` call of that many prompts of that length runs on the real engine (`--backend`, by
default what backend=auto picks, as a user's run does; chunked prefill), and its decode-only steps are compared with the model: the step time (the engine's log)
and one layer's attention (the backend's forward, timed in the engine). Cells run in `--rounds` rounds,
each in its own random order, so that a slow minute of a shared machine lands on different cells each
round; per cell it prints the median over rounds of model/real and the rounds' range. `--spread` runs each cell
also (or only) with its prompts' lengths spread over 0.5-1.5x the cell's (same total), as a real batch's are.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def spread_lengths(b: int, c: int) -> list[int]:
    """b lengths evenly over 0.5-1.5x c, c on average: a real batch's mix, which a backend may pad."""
    lengths = [int(round(c * (0.5 + i / (b - 1)))) for i in range(b)]
    lengths[-1] += c * b - sum(lengths)
    return lengths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", default="1,2,3,4,8", help="decode batch sizes")
    p.add_argument("--cached", default="300,900,1500", help="prompt lengths (cached tokens at the decodes)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profiles", default=None, help="a measured build's folder (default: build one in a temp dir)")
    p.add_argument("--backend", default="auto",
                   help="attention backend (default auto: what backend=auto, the engine's default, picks here; printed)")
    p.add_argument("--spread", choices=["no", "yes", "both"], default="both",
                   help="prompt lengths equal, or spread evenly over 0.5-1.5x the cell's (same total), or both")
    a = p.parse_args()

    import tempfile

    from sim.cost.base import StepSums
    from sim.cost.fitted import profile_rows
    from sim.cost.measured import MeasuredCostModel
    from sim_fidelity import MeasuredProfiler
    from throughput import model_dir
    from varlen import LLM
    from varlen.sampling_params import SamplingParams

    folder = str(model_dir("50m"))
    from sim.profile import resolve_backend

    a.backend, line = resolve_backend(a.backend, Path(folder))
    print(line, flush=True)
    cfg = json.loads((Path(folder) / "config.json").read_text())
    if a.profiles is None:
        prof = MeasuredProfiler(folder, a.backend, tempfile.mkdtemp(prefix="measured-decode-"))
        prof.between_runs(0)
        cost = prof.model()
        print(f"build: {prof.root}")
    else:
        cost = MeasuredCostModel(cfg, "cpu_2core", profiles=a.profiles)
    llm = LLM(folder, backend=a.backend, allocator="paged", block_size=16, num_blocks=1024, max_model_len=4096,
              max_num_seqs=16, max_num_batched_tokens=1024)
    backend, forward, calls = llm.backend, llm.backend.forward, []

    def timed(q, k, v, cache, meta, scale, *args, **kw):  # the engine's clock on CPU: CPU time
        t = time.process_time()
        out = forward(q, k, v, cache, meta, scale, *args, **kw)
        calls.append((len(meta.batch.seq_lens), meta.batch.max_query_len > 1, time.process_time() - t))
        return out

    backend.forward = timed
    vocab, rng = llm.runner.config.vocab_size, np.random.default_rng(0)
    spreads = {"no": [False], "yes": [True], "both": [False, True]}[a.spread]
    cells = [(b, c, sp) for b in map(int, a.requests.split(",")) for c in map(int, a.cached.split(",")) for sp in spreads]
    got: dict[tuple[int, int, bool], list[tuple[float, float]]] = {cell: [] for cell in cells}
    for _ in range(a.rounds):
        for i in rng.permutation(len(cells)):
            b, c, spread = cells[i]
            lengths = [c] * b if not spread or b == 1 else spread_lengths(b, c)
            calls.clear()
            before = llm.engine.steps
            first = len(before)
            llm.generate([rng.integers(3, vocab, n).tolist() for n in lengths],
                         SamplingParams(max_tokens=-(-b * c // 1024) + 8, ignore_eos=True, temperature=0.0),
                         use_tqdm=False)
            steps = llm.engine.steps
            rows = profile_rows(list(steps) if steps is not before else list(steps)[first:])
            dec = [(n, ca, t, lg) for n, ca, t, lg in rows if len(n) == b and max(n) == 1]
            step = np.median([cost.step_time(n, ca, lg) / t for n, ca, t, lg in dec])
            model_att = []
            for n, ca, _, lg in dec:
                s = StepSums.of(n, ca, lg)
                model_att.append(cost.layer_attention(cost.step_fixed(s.num_seqs, s.new, s.num_logits, s.num_prefills),
                                                      s.attention_pairs, s.cached))
            real_att = np.median([t for k, pre, t in calls if k == b and not pre])
            got[(b, c, spread)].append((float(step), float(np.median(model_att) / real_att)))
    print(f"model/real per cell, median over {a.rounds} rounds [range]: whole decode step | one layer's attention")
    for (b, c, spread), r in got.items():
        s, att = np.array(r).T
        print(f"  {b} requests x {c:4d} cached{' (spread)' if spread else '         '}: step {np.median(s):.2f} [{s.min():.2f}-{s.max():.2f}] | "
              f"attention {np.median(att):.2f} [{att.min():.2f}-{att.max():.2f}]")


if __name__ == "__main__":
    main()
