"""`python -m varlen.serve` as a user starts it: the default tiny model, one startup line saying
what it serves and where, chat working through the template the tiny model ships; bad options
and a taken port end in one line, exit 2, before the model loads."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("fastapi", reason="varlen.serve needs the serve extra (fastapi, uvicorn)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}


def start(*args: str, cwd: str = ROOT) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "varlen.serve", "engine.threads=1", *args], cwd=cwd, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # a fresh interpreter loading torch and the model: ~7 s on a quiet machine
def test_the_command_serves_the_default_model_with_its_chat_template(tmp_path):
    proc = start("server.port=0", "engine.max_model_len=256", cwd=str(tmp_path))
    try:
        line = proc.stdout.readline()  # blocks until the server says where it listens (or exits)
        assert line.startswith("serving 'tiny' ("), (line, proc.stderr.read() if proc.poll() is not None else "")
        assert "scheduler ChunkedPolicy" in line and "max_model_len 256" in line
        url = re.search(r"at (http://127\.0\.0\.1:\d+)/v1 ", line).group(1)
        deadline = time.monotonic() + 600
        while True:  # uvicorn starts accepting just after the line
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None, "the server never answered /health"
                time.sleep(0.05)
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
        resp = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 4
        assert body["usage"]["prompt_tokens"] > 3  # the template's role markers around "Hi"
    finally:
        proc.terminate()
        proc.wait(30)
    assert list(tmp_path.iterdir()) == []  # a server writes no run directory


def run_in_process(args: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """`python -m varlen.serve args...` in this process: (exit code, stderr)."""
    from hydra.core.global_hydra import GlobalHydra

    from varlen.serve import main

    GlobalHydra.instance().clear()
    monkeypatch.setattr(sys, "argv", ["varlen.serve", *args])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        GlobalHydra.instance().clear()
    return code, capsys.readouterr().err


def test_a_taken_port_and_a_bad_option_end_in_one_line_before_the_model_loads(monkeypatch, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, err = run_in_process([f"server.port={port}", "model.path=/no/such/model"], monkeypatch, capsys)
    assert code == 2
    assert err.strip().splitlines()[-1].startswith(f"error: cannot listen on 127.0.0.1:{port} (")
    assert "choose another server.port (0: any free one)" in err
    code, err = run_in_process(["server.port=70000"], monkeypatch, capsys)
    assert code == 2 and "server.port=70000 is not valid" in err.strip().splitlines()[-1]
    code, err = run_in_process(["server.port=0", "server.chat_template=/no/such.jinja"], monkeypatch, capsys)
    assert code == 2 and "server.chat_template='/no/such.jinja': no such file" in err
