"""Hydra finds this plug-in in its `hydra_plugins` namespace: every app whose config root is one of
varlen's (conf/run, conf/sim) gets the shipped groups, `pkg://varlen.conf`, on its search path, be
it a command or a test composing a config directly; other Hydra apps are left alone."""

from __future__ import annotations

from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class VarlenConfigs(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        if any(e.provider == "main" and _is_varlen_root(e.path) for e in search_path.get_path()):
            search_path.append("varlen", "pkg://varlen.conf")


def _is_varlen_root(path: str | None) -> bool:
    root = Path(str(path).removeprefix("file://"))
    if root.name not in ("run", "sim") or not (root.parent / "__init__.py").is_file():
        return False  # not ours: varlen is not even imported
    from varlen.registry import conf_dir

    return root.parent.resolve() == conf_dir().resolve()
