"""`python -m varlen.run`: serve a workload with a chosen backend, scheduler and KV allocator.

Composed by Hydra (`conf/config.yaml`): `python -m varlen.run backend=torch_ref scheduler=chunked
allocator=paged workload=azure_conv`. `--help` lists the groups and their options. Prints a
summary table and writes requests.csv, steps.csv, summary.json and the resolved config to the
run's output directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

CONF = str(Path(__file__).resolve().parent.parent / "conf")


def format_summary(row: dict, title: str) -> str:
    lines = [title]
    head = [("requests", "requests"), ("finished", "finished"), ("rejected", "rejected"), ("aborted", "aborted"),
            ("duration_s", "duration (s)"), ("requests_per_s", "requests/s"),
            ("output_tokens_per_s", "output tokens/s"), ("preemptions", "preemptions"),
            ("peak_kv_usage", "peak KV usage"), ("mean_batch_size", "mean batch size")]
    for key, label in head:
        v = row[key]
        lines.append(f"  {label:<18} {v:>12.3f}" if isinstance(v, float) else f"  {label:<18} {v:>12}")
    lines.append(f"  {'latency (ms)':<18} {'p50':>12} {'p90':>12} {'p99':>12}")
    for m in ("ttft", "tpot", "itl", "e2e"):
        lines.append(f"  {m.upper():<18} " + " ".join(f"{row[f'{m}_p{q}'] * 1e3:>12.2f}" for q in (50, 90, 99)))
    if "goodput_requests_per_s" in row:
        lines.append(f"  {'goodput (req/s)':<18} {row['goodput_requests_per_s']:>12.3f}")
    return "\n".join(lines)


def serve(cfg: DictConfig) -> dict:
    import torch
    from hydra.utils import instantiate

    from varlen.llm import LLM
    from varlen.metrics import request_table, step_table, summarize
    from varlen.sampling_params import SamplingParams
    from varlen.settings import CLI_NAMES, check_cli_settings
    from varlen.workload import load_workload, trace_requests

    settings = check_cli_settings(cfg)  # every engine setting, one clear line each, before anything is built
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    e = cfg.engine
    llm = LLM(model=cfg.model.path, backend=instantiate(cfg.backend), scheduler=instantiate(cfg.scheduler),
              allocator=instantiate(cfg.allocator), block_size=e.block_size, num_blocks=e.num_blocks,
              kv_cache_memory=e.kv_cache_memory, max_model_len=e.max_model_len, dtype=e.dtype,
              device=e.device, seed=e.seed, batch_invariant=e.batch_invariant, setting_names=CLI_NAMES)
    print(f"model {llm.model_path} | backend {llm.backend.name} | scheduler {llm.engine.policy.name} | "
          f"allocator {type(llm.engine.kv).__name__}\n{llm.sizing}")
    trace, opts = load_workload(OmegaConf.to_container(cfg.workload, resolve=True))
    s = cfg.sampling
    sampling = SamplingParams(max_tokens=opts.get("max_tokens", 16), temperature=s.temperature, top_k=s.top_k,
                              top_p=s.top_p, ignore_eos=s.ignore_eos)
    if trace is None:
        prompts = [ln for ln in Path(opts["path"]).read_text().splitlines() if ln.strip()]
        reqs = llm.make_requests(prompts, sampling)
    else:
        print(trace.stats.summary())
        reqs = trace_requests(trace, llm.runner.config.vocab_size, sampling, offline=opts["replay"] == "offline")
    llm.run(reqs, use_tqdm=cfg.progress)
    eng = llm.engine
    row = summarize(reqs, eng.steps, eng.kv.capacity_tokens, cfg.slo.ttft_s, cfg.slo.tpot_s)
    out = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    request_table(reqs).to_csv(out / "requests.csv", index=False)
    step_table(eng.steps).to_csv(out / "steps.csv", index=False)
    (out / "summary.json").write_text(json.dumps(row, indent=2))
    (out / "config_resolved.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    title = (f"summary: {llm.engine.policy.name} + {type(eng.kv).__name__} + {llm.backend.name}, "
             f"{len(reqs)} requests")
    print(format_summary(row, title))
    print(f"tables and config written to {out}")
    return row


@hydra.main(config_path=CONF, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from backends.base import BackendUnavailable
    from varlen.traces import TraceFormatError

    try:
        serve(cfg)
    except (ValueError, BackendUnavailable, FileNotFoundError, TraceFormatError) as err:
        # A setting or input problem: one clear line, not a traceback.
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
