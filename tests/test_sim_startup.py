"""sim.run's start-up shortcut: Hydra's composition only to read hydra.mode is skipped when
nothing on the command line can set hydra.mode, and kept otherwise; and what Hydra would have
found there is indeed None for this command's config (so skipping it changes nothing)."""

import pytest
from hydra import initialize_config_dir
from hydra._internal.hydra import Hydra
from hydra.core.global_hydra import GlobalHydra

import sim.run as sim_run


@pytest.fixture
def restore_get_mode():
    orig = Hydra.get_mode
    yield orig
    Hydra.get_mode = orig


@pytest.mark.parametrize("args, skipped", [
    ([], True),
    (["hydra.run.dir=/tmp/x", "-m", "scheduler=static,chunked", "workload.rate=1"], True),
    (["hydra.mode=RUN"], False),
    (["hydra/launcher=basic"], False),
    (["+hydra.foo=1"], False),
    (["-cd", "/elsewhere"], False),
    (["--config-name", "other"], False),
])
def test_mode_probe_skipped_only_when_nothing_can_set_it(restore_get_mode, args, skipped):
    sim_run._skip_mode_probe(["sim.run", *args])
    assert (Hydra.get_mode is not restore_get_mode) == skipped


def test_the_probe_would_find_no_mode(restore_get_mode):
    with initialize_config_dir(sim_run.CONF, version_base="1.3"):
        h = GlobalHydra.instance().hydra
        assert h.get_mode("sim", []) is None
        assert h.get_mode("sim", ["scheduler=static,chunked"]) is None
