"""Plug-ins by name. A name is a file of a config group, `conf/<group>/<name>.yaml`, whose
`_target_` is the class: nothing else lists plug-ins, so a new one is its module and its yaml, and
the CLIs (Hydra's defaults lists), `LLM(...)`, the simulator and the tests all see it.

A class outside the package needs no yaml: give its dotted path (`mypkg.policies.MyPolicy`) where a
name goes, or `scheduler._target_=mypkg.policies.MyPolicy` on a command line.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from conf import conf_dir

# The plug points and the simulator's pluggable parts; each is a folder of conf/.
GROUPS = ("scheduler", "allocator", "backend", "router", "cost")


def names(group: str) -> list[str]:
    """The names `group` knows: its yaml files' stems, sorted."""
    folder = conf_dir(_check_group(group))
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def spec(group: str, choice: str | Mapping[str, Any]) -> DictConfig:
    """The config of a choice: a name of `group`, a dotted class path, or a mapping with `_target_`."""
    if isinstance(choice, (Mapping, DictConfig)):
        cfg = OmegaConf.create(dict(choice) if not isinstance(choice, DictConfig) else choice)
        if "_target_" not in cfg:
            raise ValueError(f"{group}={dict(choice)!r}: a {group} config needs a _target_ (the class's dotted path)")
        return cfg
    if not isinstance(choice, str) or not choice:
        raise ValueError(f"{group}={choice!r}: give a {group} name ({', '.join(names(group))}) or a class's dotted path")
    path = conf_dir(_check_group(group), f"{choice}.yaml")
    if "/" not in choice and path.is_file():
        cfg = OmegaConf.load(path)
        if not isinstance(cfg, DictConfig) or "_target_" not in cfg:
            raise ValueError(f"{path}: a {group} config needs a _target_ (the class's dotted path)")
        return cfg
    if "." in choice:  # a user's class, e.g. mypkg.policies.MyPolicy
        return OmegaConf.create({"_target_": choice})
    raise ValueError(f"unknown {group} {choice!r}; choose one of {', '.join(names(group))} "
                     f"(conf/{group}/*.yaml), or give a class's dotted path (mypkg.module.Class)")


def target(group: str, choice: str | Mapping[str, Any]) -> Any:
    """The class (or callable) a choice names, imported but not called."""
    dotted = str(spec(group, choice)._target_)
    module, _, attr = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{group}: cannot import {dotted!r} ({type(e).__name__}: {e}); check the module is "
                         f"importable (on sys.path) and the class name") from None


def build(group: str, choice: str | Mapping[str, Any], /, *, context: Mapping[str, Any] | None = None,
          **overrides: Any) -> Any:
    """Instantiate a choice of `group` with `overrides` merged over its yaml. `context` is the
    config the yaml's interpolations read (e.g. {"engine": {"max_model_len": 4096}})."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    cfg = spec(group, choice)
    target(group, cfg)  # a bad class path fails here, with the name in the message
    if overrides:
        cfg = OmegaConf.merge(cfg, overrides)
    root = OmegaConf.create({**(dict(context) if context else {}), "__plugin__": cfg})
    try:
        resolved = OmegaConf.to_container(root.__plugin__, resolve=True)
    except Exception as e:  # an interpolation the context does not hold
        raise ValueError(f"{group} {_label(choice)}: {' '.join(str(e).split())}") from None
    try:
        return instantiate(resolved, _convert_="all")
    except InstantiationException as e:
        cause = e.__cause__ or e
        given = ", ".join(k for k in resolved if not k.startswith("_"))
        raise ValueError(f"{group} {_label(choice)}: {type(cause).__name__}: {' '.join(str(cause).split())} "
                         f"(settings given: {given or 'none'})") from None


def _label(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else repr(dict(choice).get("_target_"))


def _check_group(group: str) -> str:
    if group not in GROUPS:
        raise ValueError(f"unknown plug-in group {group!r}; one of {', '.join(GROUPS)}")
    return group
