"""Every command-line mistake gives one line naming the setting (or file), its bad value and the
fix, exit code 2, before any work starts. The CLIs' mains run in this process (a Hydra start-up
in a subprocess costs about a second each)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data"


def run_main(module: str, args: list[str], monkeypatch, capsys, through_cli: bool = False) -> tuple[int, str, str]:
    """`python -m module args...` in this process: (exit code, stdout, stderr); through_cli: by
    varlen.cli.run_cli, as the commands' `__main__` does."""
    import importlib

    from hydra.core.global_hydra import GlobalHydra

    from varlen.cli import run_cli

    main = importlib.import_module(module).main
    GlobalHydra.instance().clear()
    monkeypatch.setattr(sys, "argv", [module, *args])
    code = 0
    try:
        if through_cli:
            run_cli(main)
        else:
            main(args) if module in ("sim.report", "varlen.demo") else main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        GlobalHydra.instance().clear()
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("inputs")
    f = {"dir": d / "a_dir", "file": d / "a_file", "empty": d / "empty.txt", "header": d / "header.csv",
         "gz_csv": d / "packed.csv", "csv": DATA / "azure_conv_small.csv", "bad_hash": d / "bad.jsonl"}
    f["dir"].mkdir()
    f["file"].write_text("x")
    f["empty"].write_text("\n  \n")
    f["header"].write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    f["gz_csv"].write_bytes(gzip.compress(f["csv"].read_bytes()))
    f["bad_hash"].write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [%d]}\n' % 2**64)
    return f


SIM = ["sim_model=tiny", "hardware=cpu_2core", "engine.num_blocks=256", "engine.max_model_len=1024"]
SYNTHETIC = ["workload=synthetic", "workload.limit=20"]  # unless a case picks its workload

# (module, arguments with {placeholders} from `files`, what the one line must name)
CASES = {
    # varlen.run: all fail before the model is loaded
    "run-workload-path-is-a-dir": ("varlen.run", ["workload=prompts", "workload.path={dir}"], "workload.path"),
    "run-workload-path-missing": ("varlen.run", ["workload=prompts"], "workload.path"),
    "run-model-local-without-path": ("varlen.run", ["model=local"], "model.path"),
    "run-dir-under-a-file": ("varlen.run", ["hydra.run.dir={file}/out"], "hydra.run.dir"),
    "run-linear-kernel-unknown": ("varlen.run", ["engine.linear_kernel=fast"], "engine.linear_kernel=fast"),
    "run-slo-not-a-number": ("varlen.run", ["slo.ttft_s=abc"], "slo.ttft_s"),
    "run-slo-negative": ("varlen.run", ["slo.tpot_s=-0.1"], "slo.tpot_s"),
    "run-empty-prompt-file": ("varlen.run", ["workload=prompts", "workload.path={empty}"], "no requests"),
    "run-no-synthetic-requests": ("varlen.run", ["workload.limit=0"], "no requests"),
    "run-header-only-trace": ("varlen.run", ["workload=azure_conv", "workload.source={header}"], "no requests"),
    "run-limit-0": ("varlen.run", ["workload=azure_conv", "workload.source={csv}", "workload.limit=0"], "no requests"),
    "run-gzip-bytes-in-csv": ("varlen.run", ["workload=azure_conv", "workload.source={gz_csv}"], "packed.csv"),
    # sim.run
    "sim-block-size-0": ("sim.run", [*SIM, "engine.block_size=0"], "engine.block_size"),
    "sim-block-size-negative": ("sim.run", [*SIM, "engine.block_size=-16"], "engine.block_size"),
    "sim-gpu-memory-utilization": ("sim.run", [*SIM, "engine.num_blocks=null", "engine.gpu_memory_utilization=2"],
                                   "engine.gpu_memory_utilization"),
    "sim-csv-as-cost-path": ("sim.run", [*SIM, "cost.model=profiled", "cost.path={csv}"], "cost.path"),
    "sim-dir-as-cost-path": ("sim.run", [*SIM, "cost.model=replay", "cost.path={dir}"], "cost.path"),
    "sim-csv-as-model-config": ("sim.run", [*SIM, "sim_model=local", "sim_model.config={csv}"], "sim_model.config"),
    "sim-model-config-missing": ("sim.run", [*SIM, "sim_model=local"], "sim_model.config"),
    "sim-slo-not-a-number": ("sim.run", [*SIM, "slo.ttft_s=abc"], "slo.ttft_s"),
    "sim-limit-0": ("sim.run", [*SIM, "workload=synthetic", "workload.limit=0"], "no requests"),
    "sim-header-only-trace": ("sim.run", [*SIM, "workload=azure_conv", "workload.source={header}"], "no requests"),
    "sim-trace-is-a-dir": ("sim.run", [*SIM, "workload=azure_conv", "workload.source={dir}"], "workload.source"),
    "sim-gzip-bytes-in-csv": ("sim.run", [*SIM, "workload=azure_conv", "workload.source={gz_csv}"], "packed.csv"),
    "sim-hash-id-out-of-range": ("sim.run", [*SIM, "workload=mooncake_conv", "workload.source={bad_hash}"],
                                 "bad.jsonl: line 1"),
    "sim-replicas-0": ("sim.run", [*SIM, "cluster.replicas=0"], "cluster.replicas"),
    "sim-unknown-router": ("sim.run", [*SIM, "cluster.router=random"], "cluster.router"),
    "sim-unknown-link": ("sim.run", [*SIM, "cluster.mode=disaggregated", "cluster.link=wifi"], "cluster.link"),
    "sim-decode-pool-too-small": ("sim.run", [*SIM, "sim_model=llama2_70b", "hardware=h100_sxm", "engine.num_blocks=null",
                                              "cluster.mode=disaggregated", "cluster.prefill.tensor=4"], "cluster.decode"),
    "sim-dir-under-a-file": ("sim.run", [*SIM, "hydra.run.dir={file}/out"], "hydra.run.dir"),
    "sim-sweep-jobs-sharing-a-dir": ("sim.run", ["-m", *SIM, "hydra.sweep.subdir=same", "hydra.sweep.dir={dir}/sw",
                                                 "workload.rate=1,2"], "hydra.sweep.subdir"),
    # sim.capacity: settings checked before the first simulation
    "capacity-rel-tol-0": ("sim.capacity", [*SIM, "capacity.rel_tol=0"], "capacity.rel_tol"),
    "capacity-low-above-high": ("sim.capacity", [*SIM, "capacity.low=8", "capacity.high=2"], "capacity.high"),
    "capacity-attainment-above-1": ("sim.capacity", [*SIM, "capacity.attainment=1.5"], "capacity.attainment"),
    "capacity-negative-slo": ("sim.capacity", [*SIM, "slo.ttft_s=-1"], "slo.ttft_s"),
    "capacity-no-slo": ("sim.capacity", [*SIM, "slo.ttft_s=null", "slo.tpot_s=null"], "slo.ttft_s"),
    # sim.report and varlen.demo
    "report-corrupt-summary": ("sim.report", ["{corrupt}"], "summary.json"),
    "report-varlen-run-dir": ("sim.report", ["{varlen_run}"], "not a sim.run summary"),
    "report-no-such-dir": ("sim.report", ["{dir}/nope"], "nope"),
    "demo-unknown-backend": ("varlen.demo", ["--backend", "foo"], "--backend 'foo'"),
    "demo-block-size-0": ("varlen.demo", ["--block-size", "0"], "--block-size"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_clear_line_and_exit_2(case, files, tmp_path, monkeypatch, capsys):
    module, args, names = CASES[case]
    paths = {k: str(v) for k, v in files.items()}
    if module == "sim.report":
        from varlen.metrics import summarize

        corrupt, varlen_run = tmp_path / "corrupt", tmp_path / "varlen_run"
        corrupt.mkdir(), varlen_run.mkdir()
        (corrupt / "summary.json").write_text('{"scheduler": "chunked", ')
        (varlen_run / "summary.json").write_text(json.dumps(summarize([], [], 1)))  # varlen.run's row
        paths.update(corrupt=str(corrupt), varlen_run=str(varlen_run))
    args = [a.format(**paths) for a in args]
    if module not in ("sim.report", "varlen.demo") and not any(a.startswith("hydra.run.dir") for a in args):
        args.append(f"hydra.run.dir={tmp_path / 'out'}")
    if module == "varlen.run":
        args += ["progress=false", "engine.threads=1"]
    if module.startswith("sim.") and module != "sim.report" and not any(a.startswith("workload=") for a in args):
        args += SYNTHETIC
    code, out, err = run_main(module, args, monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert names in lines[0], lines[0]
    # Nothing was started: no model loaded, no simulation, no results.
    assert "serving" not in out and "simulating" not in out and not list(tmp_path.rglob("requests.csv"))


@pytest.mark.parametrize("module, own, others", [
    ("varlen.run", ["model", "backend", "scheduler", "allocator", "workload"], ["hardware", "sim_model", "sim_workload", "workload_defaults"]),
    ("sim.run", ["hardware", "sim_model", "workload", "scheduler", "allocator"], ["model", "backend", "sim_workload", "workload_defaults"]),
])
def test_help_lists_only_the_groups_the_command_uses(module, own, others, monkeypatch, capsys):
    """varlen.run --help listed hardware, sim_model and sim_workload, which it cannot use: each
    command has its own config root (conf/run, conf/sim) linking only its groups."""
    code, out, _ = run_main(module, ["--help"], monkeypatch, capsys)
    groups = out.split("== Configuration groups ==")[1].split("== Config ==")[0]
    listed = {ln.split(":")[0].strip() for ln in groups.splitlines() if ":" in ln and "(group=option)" not in ln}
    assert code == 0 and listed == set(own), groups
    assert not listed & set(others)
