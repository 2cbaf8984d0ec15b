"""The Hydra configs, shipped as package data so that an installed varlen finds them.

`conf/run` and `conf/sim` are the commands' config roots: each links (a symlink in the source
tree, a copy in a wheel) only the groups its command uses, so that `--help` lists only those.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def conf_dir(*parts: str) -> Path:
    """A folder of the configs (e.g. conf_dir("run"), conf_dir("hardware")), wherever installed."""
    return Path(str(files(__name__).joinpath(*parts)))
