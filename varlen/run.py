"""`python -m varlen.run backend=torch_ref scheduler=chunked allocator=paged workload=azure_conv`
(conf/run/config.yaml): serve a workload; print a summary, write requests.csv, steps.csv,
summary.json and the resolved config to the run's directory."""

from __future__ import annotations

import json
from pathlib import Path

from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from varlen.cli import SettingError, check_missing, check_slo, errors_to_exit, existing_file, fail, interrupted, number

from varlen.registry import conf_dir

CONF = str(conf_dir("run"))


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


def check_settings(cfg: DictConfig) -> None:
    """This command's own settings, checked before the model loads (LLM checks the engine's)."""
    check_missing(cfg)
    check_slo(cfg)
    if "path" in cfg.workload:
        existing_file(cfg, "workload.path", "a text file with one prompt per line")
    else:
        number(cfg, "workload.limit", low=0, integer=True, optional=True)


def check_sweep_job(cfg: DictConfig) -> None:
    """What a sweep's job is checked for before any job starts (varlen.cli.CheckSweep): this
    command's settings and the engine's."""
    from varlen.settings import check_cli_settings

    check_settings(cfg)
    check_cli_settings(cfg)


def load_prompts(path: str) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise SettingError(f"workload.path={path!r} is not a UTF-8 text file; give one prompt per line") from None
    return [ln for ln in text.splitlines() if ln.strip()]


def serve(cfg: DictConfig) -> dict:
    from varlen.settings import CLI_NAMES, check_cli_settings
    from varlen.workload import load_workload

    check_settings(cfg)
    settings = check_cli_settings(cfg)
    # The workload before the model: a bad one fails in a second, not after loading.
    trace, opts = load_workload(OmegaConf.to_container(cfg.workload, resolve=True))
    prompts = load_prompts(opts["path"]) if trace is None else None
    n = len(prompts) if trace is None else len(trace)
    if n == 0:
        src = f"workload.path={opts['path']!r}" if trace is None else \
            f"workload {trace.stats.source} (limit={cfg.workload.get('limit')}, {trace.stats.num_read} read)"
        raise SettingError(f"no requests: {src} gave none; nothing to serve")

    import pandas  # noqa: F401  (now, not when Ctrl-C asks for the tables: importing it takes ~1 s)
    import torch

    from varlen.llm import LLM
    from varlen.sampling_params import SamplingParams
    from varlen.workload import trace_requests

    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    e = cfg.engine
    # Unresolved, so that the scheduler's ${engine.max_model_len} is the engine's, as for LLM(...).
    llm = LLM(model=cfg.model.path, backend=_group(cfg, "backend"), scheduler=_group(cfg, "scheduler"),
              allocator=_group(cfg, "allocator"), block_size=e.block_size, num_blocks=e.num_blocks,
              kv_cache_memory=e.kv_cache_memory, max_model_len=e.max_model_len, dtype=e.dtype,
              device=e.device, seed=e.seed, linear_kernel=settings.linear_kernel, setting_names=CLI_NAMES)
    print(f"model {llm.model_path} | backend {llm.backend.name} | scheduler {llm.engine.policy.name} | "
          f"allocator {type(llm.engine.kv).__name__} | layer kernels {llm.runner.layer_kernels} | "
          f"linear layers {llm.runner.linear_kernel}\n{llm.sizing}")
    s = cfg.sampling
    sampling = SamplingParams(max_tokens=opts.get("max_tokens", 16), temperature=s.temperature, top_k=s.top_k,
                              top_p=s.top_p, ignore_eos=s.ignore_eos)
    if trace is None:
        reqs = llm.make_requests(prompts, sampling)
    else:
        print(trace.stats.summary())
        reqs = trace_requests(trace, llm.runner.config.vocab_size, sampling, offline=opts["replay"] == "offline")
    out = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    print(f"serving {len(reqs)} requests (Ctrl-C stops and writes the finished ones)", flush=True)
    try:
        llm.run(reqs, use_tqdm=cfg.progress)
    except KeyboardInterrupt:
        row = write_results(cfg, llm, reqs, trace, out, partial=True)
        interrupted(f"wrote the {row['finished']} requests finished of {len(reqs)} to {out} "
                    "(partial: summary.json has \"partial\": true)")
    try:
        row = write_results(cfg, llm, reqs, trace, out, partial=False)
    except KeyboardInterrupt:
        interrupted(f"while writing {out}: its tables may be incomplete (summary.json is written last)")
    title = (f"summary: {llm.engine.policy.name} + {type(llm.engine.kv).__name__} + {llm.backend.name}, "
             f"{len(reqs)} requests")
    print(format_summary(row, title))
    print(f"tables and config written to {out}")
    return row


def _group(cfg: DictConfig, group: str) -> dict:
    return OmegaConf.to_container(cfg[group], resolve=False)  # type: ignore[return-value]


def write_results(cfg: DictConfig, llm: Any, reqs: list, trace: Any, out: Path, partial: bool) -> dict:
    """The tables, then summary.json last (a run without it did not finish writing); after Ctrl-C,
    unfinished requests are `aborted` and the summary says "partial": true."""
    from varlen.metrics import request_table, step_table, summarize

    eng = llm.engine
    row = summarize(reqs, eng.steps, eng.kv.capacity_tokens, cfg.slo.ttft_s, cfg.slo.tpot_s,
                    cfg.slo.get("tbt_s"))
    row["partial"] = partial
    row["backend"] = llm.backend.name  # the backend that ran (with backend=auto, the one it chose)
    # New tokens from which its prompts take another attention path: sim.fit prices the two paths apart.
    row["backend_long_query_min"] = int(getattr(llm.backend, "long_query_min", 0))
    row["unfinished"] = sum(r.finish_reason is None or r.finish_reason.value == "aborted" for r in reqs)
    if trace is not None:
        row.update({f"trace_{k}": getattr(trace.stats, k) for k in
                    ("num_read", "num_clipped", "num_prompt_clipped", "num_dropped", "num_reordered",
                     "num_zero_output")})
    request_table(reqs).to_csv(out / "requests.csv", index=False)
    step_table(eng.steps).to_csv(out / "steps.csv", index=False)
    if cfg.output.timeline:
        from varlen.timeline import write_timeline

        write_timeline(out / "timeline.json", [("engine", eng.steps, eng.kv.capacity_tokens)], reqs, {},
                       cfg.output.timeline_max_events)
    (out / "config_resolved.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    (out / "summary.json").write_text(json.dumps(row, indent=2))
    return row


@hydra.main(config_path=CONF, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from varlen.attention_api import BackendUnavailable

    try:
        serve(cfg)
    except errors_to_exit((BackendUnavailable,)) as err:
        fail(str(err))
    except KeyboardInterrupt:
        # Before serving started, or a second Ctrl-C while the partial tables were written.
        interrupted("no complete results written (a run's summary.json is written last)")


if __name__ == "__main__":
    from varlen.cli import run_cli

    run_cli(main)
