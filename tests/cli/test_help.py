"""--help explains every option in one line, from the config files' comments, under a header that
names the command; sim.profile's (argparse) ends with a whole sentence."""

from __future__ import annotations

import re

import pytest

from tests.cli.test_cli_errors import run_main

# (command, keys its --help must explain with text)
DOCUMENTED = {
    "varlen.run": ["engine.kv_cache_memory", "engine.max_model_len", "slo.ttft_s", "workload.rate",
                   "sampling.ignore_eos"],
    "sim.run": ["workload.rate", "slo.ttft_s", "engine.max_model_len", "cost.model", "capacity.rel_tol"],
    "sim.capacity": ["capacity.low", "capacity.criterion", "slo.tpot_s", "workload.rate"],
    "sim.search": ["search.target_rate", "workload.limit", "capacity.rel_tol", "slo.ttft_s"],
    "sim.explain": ["cost.model", "step.new", "engine.gpu_memory_utilization"],
    "varlen.serve": ["server.port", "server.host", "server.chat_template", "engine.max_model_len"],
}


def options(out: str) -> dict[str, str]:
    """The `key: value  — text` lines of the == Config == section: key -> text ('' when none)."""
    section = out.split("== Config ==")[1]
    found = {}
    for line in section.splitlines():
        m = re.match(r"^([\w.]+)(?::| *\.\*) ?(.*?)(?:  — (.*))?$", line)
        if m and "." in m.group(1) or m and m.group(2):
            found[m.group(1)] = (m.group(3) or "").strip()
    return found


@pytest.mark.parametrize("module", sorted(DOCUMENTED))
def test_help_names_its_command_and_explains_the_options(module, monkeypatch, capsys):
    code, out, _ = run_main(module, ["--help"], monkeypatch, capsys)
    assert code == 0
    assert out.splitlines()[0].startswith(f"{module}: "), out.splitlines()[0]
    explained = options(out)
    for key in DOCUMENTED[module]:
        assert explained.get(key), f"{module} --help: {key} has no explanation"


def test_help_shows_the_chosen_groups_options_with_their_values(monkeypatch, capsys):
    """A group choice on the command line changes the options listed (its yaml's keys and comments)."""
    _, out, _ = run_main("sim.run", ["workload=synthetic", "workload.rate=7", "--help"], monkeypatch, capsys)
    lines = {ln.split(":")[0]: ln for ln in out.split("== Config ==")[1].splitlines() if ":" in ln}
    assert lines["workload.rate"].startswith("workload.rate: 7 ") and "arrivals per second" in lines["workload.rate"]
    assert "workload.prompt_len" in lines and "workload.source" in lines


def test_comments_are_read_per_dotted_key():
    from varlen.cli import _yaml_comments

    text = ("# the file's own opening lines\nfirst: 1\na:          # section\n  b: 'x # y'   # after b\n"
            "  # above c\n  c: 2\nhydra:\n  job: x  # not an option\nd: 3\n")
    assert _yaml_comments(text) == {"a": "section", "a.b": "after b", "a.c": "above c"}


def test_sim_profile_help_ends_with_a_whole_sentence(capsys):
    from sim.profile import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    description = " ".join(out.split("\n\n")[1].split())
    assert e.value.code == 0 and out.startswith("usage: python -m sim.profile")
    assert description.startswith("`python -m sim.profile`:") and description.endswith("."), description


def test_help_explains_a_users_own_config_from_its_comments(tmp_path, monkeypatch, capsys):
    """A user's scheduler yaml (VARLEN_CONFIG_PATH) is read for its comments like a shipped one."""
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "my_fifo.yaml").write_text(
        "_target_: my_policies.Fifo\npatience: 3   # steps my policy waits\n")
    monkeypatch.setenv("VARLEN_CONFIG_PATH", str(tmp_path))
    code, out, _ = run_main("sim.run", ["scheduler=my_fifo", "--help"], monkeypatch, capsys)
    assert code == 0 and "scheduler.patience: 3  — steps my policy waits" in out.splitlines(), out
