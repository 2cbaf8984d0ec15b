"""Plug-ins are named only by their config group's yaml files (varlen/registry.py)."""

import sys
import textwrap

import pytest

from varlen import registry
from conf import conf_dir


@pytest.mark.parametrize("group", registry.GROUPS)
def test_names_are_the_groups_yaml_files(group):
    folder = conf_dir(group)
    if not folder.is_dir():
        pytest.skip(f"conf/{group} is not a group yet")  # router and cost groups land with their issues
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
