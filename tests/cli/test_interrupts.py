"""Ctrl-C stops every command within about a second, on the compiled and the pure-Python core,
with one line saying what was (not) written. Real subprocesses get a real SIGINT; the bound is on
the CPU time they spend after it (0.1-0.5 s measured), so a loaded machine cannot fail it.

The compiled core (mypyc) never enters the interpreter's eval loop, where Python runs signal
handlers, so before sim.simulator polled (varlen/interrupt.py) a simulation ran to its end
(tens of seconds here) before Ctrl-C took effect."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pandas as pd
import pytest

import varlen.compiled as compiled

ROOT = Path(__file__).resolve().parents[2]
# CPU seconds the command may spend after SIGINT (a quiet machine: well under one). CPU time, not wall
# time, so a loaded machine does not fail the test; a loop that ignored Ctrl-C would spend ~10 s more.
STOP_WITHIN_CPU_S = 2.0
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) spent so far by the live processes of process group `pgid` (Linux /proc)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[2]) == pgid:  # fields after the name: state ppid pgrp ... utime(11) stime(12)
            total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def cpu_after_sigint(pgid: int, send: Callable[[], None], wait: Callable[[], None]) -> float:
    """CPU seconds the process group spends from `send()` (the SIGINT) to its end, as reaped by `wait()`:
    the children's rusage, which then includes the group's processes, less what they had spent before."""
    before_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    spent = group_cpu_s(pgid)
    send()
    wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    reaped = (after.ru_utime + after.ru_stime) - (before_children.ru_utime + before_children.ru_stime)
    return reaped - spent


pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(),
                                reason="measures a command's CPU time after SIGINT through Linux /proc")

CORES = [
    pytest.param({"VARLEN_PURE": "1"}, id="pure"),
    pytest.param({}, id="compiled", marks=pytest.mark.skipif(
        not compiled.is_compiled(), reason=f"no compiled core: {compiled.status()}")),
]


def interrupt_when(cmd: list[str], ready: str, env: dict[str, str], after_s: float = 0.3,
                   ready_err: Callable[[str], bool] | None = None):
    """Start cmd, send SIGINT `after_s` after it prints a line containing `ready` (and then, if
    given, a stderr line for which `ready_err` is true); return (exit code, CPU seconds it spent from
    SIGINT to exit, stdout, stderr)."""
    e = dict(os.environ, OMP_NUM_THREADS="1", **env)
    p = subprocess.Popen(cmd, cwd=ROOT, env=e, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True)  # its own process group, to count its CPU time by
    seen, seen_err = [], []
    for line in p.stdout:
        seen.append(line)
        if ready in line:
            break
    else:
        p.wait()
        pytest.fail(f"never printed {ready!r}: {''.join(seen)} {p.stderr.read()}")
    if ready_err is not None:
        for line in p.stderr:  # text mode: a progress bar's "\r" ends a line too
            seen_err.append(line)
            if ready_err(line):
                break
        else:
            p.wait()
            pytest.fail(f"never printed the awaited stderr line: {''.join(seen_err)[-2000:]}")
    time.sleep(after_s)
    assert p.poll() is None, "finished before the interrupt: make the workload longer"
    got: dict[str, str] = {}

    def wait() -> None:
        try:
            got["out"], got["err"] = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            pytest.fail(f"still running 600 s after SIGINT: {err[-2000:]}")

    took = cpu_after_sigint(p.pid, lambda: p.send_signal(signal.SIGINT), wait)
    return p.returncode, took, "".join(seen) + got["out"], "".join(seen_err) + got["err"]


@pytest.mark.parametrize("core", CORES)
def test_sim_run_stops_within_a_second(core, tmp_path):
    out_dir = tmp_path / "run"
    # Long enough (~10 s compiled on a quiet machine) that a loop ignoring Ctrl-C is caught.
    cmd = [sys.executable, "-m", "sim.run", "workload=synthetic", "workload.limit=60000",
           "workload.rate=50", "workload.output_len=uniform:400:800", "fast_forward=false", f"hydra.run.dir={out_dir}"]
    code, took, out, err = interrupt_when(cmd, "simulating", core)
    assert code == 130, err
    assert took < STOP_WITHIN_CPU_S, f"spent {took:.1f} CPU s after SIGINT"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted: simulation stopped") and "no results" in lines[0], err
    assert not (out_dir / "summary.json").exists() and not (out_dir / "requests.csv").exists()


@pytest.mark.parametrize("core", CORES)
def test_varlen_run_writes_the_finished_requests_marked_partial(core, tmp_path):
    out_dir = tmp_path / "run"
    n = 400
    cmd = [sys.executable, "-m", "varlen.run", "progress=true", "engine.threads=1", f"workload.limit={n}",
           "workload.prompt_len=uniform:16:64", "workload.output_len=uniform:32:128", "scheduler.max_num_seqs=8",
           f"hydra.run.dir={out_dir}", f"+VARLEN_HOME_UNUSED={tmp_path}"]
    bar = re.compile(rf"^requests: .*\| *(\d+)/{n} \[")

    def a_request_finished(line: str) -> bool:  # the progress bar has counted one
        m = bar.match(line.strip())
        return m is not None and int(m.group(1)) > 0

    code, took, out, err = interrupt_when(cmd, "serving", core, after_s=0, ready_err=a_request_finished)
    assert code == 130, err
    assert took < STOP_WITHIN_CPU_S, f"spent {took:.1f} CPU s after SIGINT"
    bars = [int(m.group(1)) for ln in err.splitlines() if (m := bar.match(ln.strip()))]
    lines = [ln for ln in err.strip().splitlines()
             if ln.strip() and not bar.match(ln.strip()) and not ln.startswith("backend: auto -> ")]
    assert len(lines) == 1 and lines[0].startswith("interrupted: wrote the") and "partial" in lines[0], err
    summary = json.loads((out_dir / "summary.json").read_text())
    reqs = pd.read_csv(out_dir / "requests.csv")
    assert summary["partial"] is True and summary["requests"] == n == len(reqs)
    done = reqs[reqs.finish_reason.isin(["length", "stop"])]
    assert 0 < summary["finished"] == len(done) < n and summary["unfinished"] == n - len(done)
    assert f"wrote the {summary['finished']} requests finished of {n}" in lines[0]
    # the bar stops where the run stopped: at the requests that ended, not filled to n
    assert bars[-1] == summary["finished"] < n
    # every other request ended aborted by the interrupt, none is left without an end
    assert (done.output_tokens > 0).all() and (reqs.drop(done.index).finish_reason == "aborted").all()


@pytest.mark.parametrize("core", CORES[:1])
def test_sim_capacity_stops_and_says_what_it_wrote(core, tmp_path):
    out_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "sim.capacity", "workload=synthetic", "workload.limit=20000",
           "workload.output_len=uniform:400:800", "fast_forward=false", f"hydra.run.dir={out_dir}"]
    code, took, out, err = interrupt_when(cmd, "capacity search", core, after_s=1.0)
    assert code == 130 and took < STOP_WITHIN_CPU_S, (code, took, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted: search stopped after"), err
    assert not (out_dir / "capacity.json").exists()


def test_a_sweep_stops_with_its_jobs(tmp_path):
    """Ctrl-C in a terminal reaches the whole process group: the launcher (joblib) and its jobs."""
    e = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "sim.run", "-m", "workload=synthetic", "workload.limit=60000",
           "workload.output_len=uniform:400:800", "fast_forward=false", "workload.rate=40,50",
           f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=e, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True)
    started = 0
    for line in p.stdout:
        started += line.count("simulating")  # two jobs' lines may share one write
        if started >= 2:
            break
    time.sleep(0.3)
    assert p.poll() is None
    got: dict[str, str] = {}

    def wait() -> None:
        try:
            _, got["err"] = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            pytest.fail("sweep still running 600 s after SIGINT")

    t0 = time.perf_counter()
    took = cpu_after_sigint(p.pid, lambda: os.killpg(p.pid, signal.SIGINT), wait)
    err = got["err"]
    # the launcher's CPU and that of the jobs it reaped (each job's own stop is what the other tests bound)
    assert p.returncode == 130 and took < 2 * STOP_WITHIN_CPU_S, (p.returncode, took, err[-2000:])
    # the launcher's one line (joblib's worker pool may add its own warnings on the way out)
    assert any(ln.startswith("interrupted: stopped") for ln in err.strip().splitlines()), err[-2000:]
    assert "Traceback" not in err
    for _ in range(600):  # no job left running on its own (waits for the event; the bound only ends a hang)
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("a job of the sweep still runs 60 s after the launcher stopped")
    print(f"group gone {time.perf_counter() - t0:.2f} s after SIGINT")
    assert not list((tmp_path / "sweep").rglob("summary.json"))


def test_the_cpu_measure_counts_the_work_after_sigint_only():
    """The instrument of the tests above: a child that idles, then on SIGINT burns 1 CPU s and exits."""
    code = ("import signal, sys, time\n"
            "def burn(*_):\n"
            "    t = time.process_time()\n"
            "    while time.process_time() - t < 1.0: pass\n"
            "    sys.exit(130)\n"
            "signal.signal(signal.SIGINT, burn)\n"
            "t = time.process_time()\n"
            "while time.process_time() - t < 0.5: pass\n"  # CPU spent before the signal: not counted
            "print('ready', flush=True)\n"
            "while True: time.sleep(1)\n")
    p = subprocess.Popen([sys.executable, "-c", code], text=True, stdout=subprocess.PIPE, start_new_session=True)
    assert p.stdout.readline().strip() == "ready"
    took = cpu_after_sigint(p.pid, lambda: p.send_signal(signal.SIGINT), lambda: p.communicate(timeout=600))
    assert p.returncode == 130
    assert 0.9 < took < 1.4, took
