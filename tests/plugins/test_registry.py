"""Plug-ins are named only by their config group's yaml files (varlen/registry.py)."""

import importlib
import os
import subprocess
import sys
import textwrap

import pytest

from varlen import registry
from varlen.registry import conf_dir


@pytest.mark.parametrize("group", registry.GROUPS)
def test_names_are_the_groups_yaml_files(group):
    folder = conf_dir(group)
    assert folder.is_dir(), f"conf/{group} is missing: every plug-in group is a folder of yaml files"
    assert registry.names(group) == sorted(p.stem for p in folder.glob("*.yaml"))


def test_every_scheduler_yaml_builds_its_target_with_engine_context():
    for name in registry.names("scheduler"):
        policy = registry.build("scheduler", name, context={"engine": {"max_model_len": 4096}}, max_num_seqs=3)
        assert type(policy) is registry.target("scheduler", name), name
        assert policy.max_num_seqs == 3


def test_unknown_name_and_bad_class_path_say_what_to_do():
    with pytest.raises(ValueError, match=r"unknown scheduler 'nope'; choose one of .*chunked.*dotted path"):
        registry.build("scheduler", "nope")
    with pytest.raises(ValueError, match=r"cannot import 'no_such_pkg.Policy'.*sys.path"):
        registry.build("scheduler", "no_such_pkg.Policy")
    with pytest.raises(ValueError, match=r"unknown plug-in group"):
        registry.names("schedulers")


def test_missing_interpolation_and_bad_setting_name_the_plugin():
    with pytest.raises(ValueError, match=r"scheduler 'orca': .*engine.max_model_len"):
        registry.build("scheduler", "orca")
    with pytest.raises(ValueError, match=r"scheduler 'chunked': TypeError.*bogus"):
        registry.build("scheduler", "chunked", bogus=3)


def test_a_users_class_outside_the_package_by_dotted_path(tmp_path, monkeypatch):
    (tmp_path / "mypolicies.py").write_text(textwrap.dedent("""
        from schedulers.chunked import ChunkedPolicy

        class Mine(ChunkedPolicy):
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    policy = registry.build("scheduler", "mypolicies.Mine", max_num_seqs=2, max_num_batched_tokens=64)
    assert type(policy).__name__ == "Mine" and policy.max_num_batched_tokens == 64
    policy = registry.build("scheduler", {"_target_": "mypolicies.Mine"}, max_num_seqs=2, max_num_batched_tokens=32)
    assert policy.max_num_batched_tokens == 32
    sys.modules.pop("mypolicies", None)


def _folder(root, group, name, text="_target_: schedulers.ChunkedPolicy\n"):
    (root / group).mkdir(parents=True, exist_ok=True)
    (root / group / f"{name}.yaml").write_text(text)
    return root


def test_user_config_folders_add_names_in_path_order(tmp_path, monkeypatch):
    a = _folder(tmp_path / "a", "scheduler", "mine_a")
    b = _folder(tmp_path / "b", "allocator", "mine_b", "_target_: varlen.kv.PagedAllocator\n_partial_: true\n")
    monkeypatch.setenv(registry.CONFIG_PATH_ENV, f"{a}{os.pathsep}{os.pathsep}{b}")  # an empty entry is skipped
    assert "mine_a" in registry.names("scheduler") and "mine_a" not in registry.names("allocator")
    assert registry.files("allocator")["mine_b"] == b / "allocator" / "mine_b.yaml"
    assert registry.search_path_urls() == [f"file://{a.resolve()}", f"file://{b.resolve()}"]
    assert registry.build("allocator", "mine_b")(num_blocks=4, block_size=2).num_blocks == 4


def test_a_missing_folder_and_a_name_defined_twice_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.CONFIG_PATH_ENV, str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=r"VARLEN_CONFIG_PATH: '.*nope' is not a folder"):
        registry.names("scheduler")
    # A user's yaml named like a shipped one would be one of two plug-ins, silently.
    monkeypatch.setenv(registry.CONFIG_PATH_ENV, str(_folder(tmp_path / "u", "scheduler", "chunked")))
    with pytest.raises(ValueError, match=r"scheduler 'chunked' is defined twice: .*chunked.yaml and .*u/scheduler/"):
        registry.spec("scheduler", "chunked")


def test_the_clis_refuse_a_bad_config_path_in_one_line(tmp_path):
    env = dict(os.environ, VARLEN_CONFIG_PATH=str(_folder(tmp_path / "u", "allocator", "paged")))
    for module in ("varlen.run", "sim.run"):
        res = subprocess.run([sys.executable, "-m", module, "--cfg", "job"], capture_output=True, text=True,
                             env=env, timeout=600)
        assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
        assert res.stderr.startswith("error: allocator 'paged' is defined twice"), res.stderr


def test_a_mandatory_option_left_unset_is_named():
    with pytest.raises(ValueError, match=r"allocator 'paged_window': sliding_window must be set .*sliding_window="):
        registry.build("allocator", "paged_window")


def test_llm_refuses_a_class_of_the_wrong_kind(tiny_model_dirs):
    """Regression (compiled core): its ABCs share one subclass cache, so a positive
    issubclass(PagedAllocator, KVAllocator) made PagedAllocator pass as a SchedulerPolicy."""
    from varlen import LLM
    from varlen.kv import KVAllocator, PagedAllocator

    assert issubclass(PagedAllocator, KVAllocator)  # fills the cache the compiled ABCs share
    with pytest.raises(ValueError, match=r"scheduler 'varlen.kv.PagedAllocator' names .*not a SchedulerPolicy"):
        LLM(tiny_model_dirs["qwen3"], scheduler="varlen.kv.PagedAllocator")
    with pytest.raises(ValueError, match=r"backend=.*give a backend name"):
        LLM(tiny_model_dirs["qwen3"], backend="schedulers.ChunkedPolicy")


def test_llm_builds_the_policy_from_its_yaml_with_the_engines_max_model_len(tiny_model_dirs):
    """The rule: a setting given wins; else the yaml's value, ${engine.max_model_len} being the
    engine's (what the KV pool holds of it); the CLI passes its group config and gets the same."""
    from varlen import LLM

    model = tiny_model_dirs["qwen3"]
    llm = LLM(model, scheduler="continuous", block_size=4, max_model_len=64, num_blocks=10)  # pool: 40 tokens
    assert llm.engine.max_model_len == 40 and llm.engine.policy.max_num_batched_tokens == 40
    assert llm.engine.policy.max_num_seqs == 64
    llm = LLM(model, scheduler="chunked", block_size=4, max_model_len=64, max_num_seqs=3)
    assert (llm.engine.policy.max_num_seqs, llm.engine.policy.max_num_batched_tokens) == (3, 512)
    llm = LLM(model, scheduler={"_target_": "schedulers.StaticPolicy", "max_num_batched_tokens": "${engine.max_model_len}"},
              block_size=4, max_model_len=48)
    assert type(llm.engine.policy).__name__ == "StaticPolicy" and llm.engine.policy.max_num_batched_tokens == 48
    llm = LLM(model, allocator="paged_window", sliding_window=4096, block_size=4, max_model_len=64)
    assert type(llm.engine.kv).__name__ == "WindowedPagedAllocator"


def test_the_pool_caps_max_model_len_for_every_allocator():
    """One place caps max_model_len at what the pool holds: KVAllocator.max_request_tokens, which
    the engine, LLM and sim.run read. Regression: a contiguous `max` reservation used the uncapped
    max_model_len, longer than the whole pool, so no request could ever be admitted."""
    from varlen.kv import ContiguousAllocator
    from varlen.request import Request
    from varlen.sampling_params import SamplingParams

    kv = ContiguousAllocator(num_blocks=4, block_size=4, max_model_len=1000)
    req = Request("a", [1] * 5, SamplingParams(max_tokens=3))
    assert kv.max_request_tokens() == 16 and kv.reserve_tokens(req) == 16
    assert kv.allocate(req, 5)


def test_every_shipped_backend_is_in_a_property_suite():
    """The CPU suite takes its backends from the group (usable here); the GPU suite lists its own
    with their block sizes: together they cover every backend shipped."""
    from varlen.testing.equivalence import GPU_BLOCK_SIZES, INTERPRETED, cpu_backends

    CPU_BACKENDS, GPU_BACKENDS = cpu_backends(), list(GPU_BLOCK_SIZES)

    shipped = {p.stem for p in conf_dir("backend").glob("*.yaml")}
    assert shipped <= {*CPU_BACKENDS, *INTERPRETED, *GPU_BACKENDS}, shipped - {*CPU_BACKENDS, *GPU_BACKENDS}


@pytest.mark.parametrize("old, name, home", [
    ("backends.base", "AttentionBackend", "varlen.attention_api"),
    ("backends.base", "write_kv", "backends.kv_write"),
    ("backends", "BackendUnavailable", "varlen.attention_api"),
    ("schedulers.base", "SchedulerPolicy", "varlen.scheduler_api"),
    ("schedulers", "SchedulerOutput", "varlen.scheduler_api"),
])
def test_an_old_import_path_warns_and_names_the_new_one(old, name, home):
    """The README once documented backends.base and schedulers.base: a user's plug-in importing from
    there still runs, warned once per import where the interface lives now."""
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=f"import {name} from {home}: {old}.{name} is deprecated"):
        got = getattr(module, name)
    assert got is getattr(importlib.import_module(home), name)
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        getattr(module, "Nothing")


def test_the_shipped_groups_join_varlens_config_roots_only(tmp_path):
    """hydra_plugins/varlen_configs puts pkg://varlen.conf after a varlen config root (a command, or
    a test composing conf/sim directly) and leaves another Hydra app's search path alone."""
    from hydra import compose, initialize_config_dir

    (tmp_path / "app.yaml").write_text("x: 1\n")
    with initialize_config_dir(str(tmp_path), version_base="1.3"):
        cfg = compose("app", return_hydra_config=True)
        assert "varlen.conf" not in str(cfg.hydra.runtime.config_sources)
    with initialize_config_dir(str(conf_dir("sim")), version_base="1.3"):
        cfg = compose("sim", overrides=["scheduler=sarathi"], return_hydra_config=True)
        assert {"provider": "varlen", "path": "varlen.conf", "schema": "pkg"} in cfg.hydra.runtime.config_sources
        assert cfg.scheduler._target_ == registry.spec("scheduler", "sarathi")._target_


def test_interpolations_read_the_context_they_name_and_fall_back_to_all_of_it():
    """A plug-in's config resolves against the context entries it names (an engine per replica made
    a whole run's config an OmegaConf object each time); an entry that interpolates another, a
    resolver or a nested interpolation still resolves against the whole context, as before."""
    unheld = object()  # OmegaConf cannot hold it: only a context cut to the named entries builds
    got = registry.build("scheduler", {"_target_": "collections.OrderedDict", "n": "${engine.max_model_len}"},
                         context={"engine": {"max_model_len": 64}, "other": unheld})
    assert dict(got) == {"n": 64}
    chained = {"a": {"x": "${b.y}"}, "b": {"y": 3}}
    got = registry.build("scheduler", {"_target_": "collections.OrderedDict", "v": "${a.x}"}, context=chained)
    assert dict(got) == {"v": 3}
    got = registry.build("scheduler", {"_target_": "collections.OrderedDict", "v": "${b.${k}}"},
                         context={"b": {"y": 5}, "k": "y"})
    assert dict(got) == {"v": 5}
    with pytest.raises(ValueError, match="scheduler 'collections.OrderedDict'"):
        registry.build("scheduler", {"_target_": "collections.OrderedDict", "v": "${nope.x}"}, context=chained)
