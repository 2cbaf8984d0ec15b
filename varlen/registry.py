"""Plug-ins by name: a name is `conf/<group>/<name>.yaml`, whose `_target_` is the class; nothing
else lists them. The folders of `VARLEN_CONFIG_PATH` add a user's names (never reusing one: that
would pick one of two plug-ins silently); a class's dotted path works where a name goes."""

from __future__ import annotations

import copy
import importlib
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Mapping

from omegaconf import DictConfig, MissingMandatoryValue, OmegaConf

GROUPS = ("scheduler", "allocator", "backend", "router", "cost", "criterion")

#: os.pathsep-separated folders of the user's own configs, each holding <group>/<name>.yaml.
CONFIG_PATH_ENV = "VARLEN_CONFIG_PATH"


#: The shipped configs (the repository's conf/), a package on Hydra's search path as pkg://varlen.conf.
CONFIGS = "varlen.conf"


def conf_dir(*parts: str) -> Path:
    """A folder of the shipped configs, e.g. conf_dir("hardware"), wherever varlen is installed."""
    return Path(str(resources.files(CONFIGS).joinpath(*parts)))


def user_config_dirs() -> list[Path]:
    """The folders `VARLEN_CONFIG_PATH` names, in order; a ValueError for one that is not a folder."""
    dirs = []
    for entry in os.environ.get(CONFIG_PATH_ENV, "").split(os.pathsep):
        if not entry.strip():
            continue
        folder = Path(entry).expanduser()
        if not folder.is_dir():
            raise ValueError(f"{CONFIG_PATH_ENV}: {entry!r} is not a folder; give folders holding "
                             f"<group>/<name>.yaml, separated by {os.pathsep!r}")
        dirs.append(folder.resolve())
    return dirs


def search_path_urls() -> list[str]:
    """The user's config folders as Hydra search path entries, after the shipped groups."""
    return [f"file://{d}" for d in user_config_dirs()]


def files(group: str) -> dict[str, Path]:
    """Each name of `group` and its yaml file: the shipped ones, then the user's folders'."""
    found: dict[str, Path] = {}
    for root in (conf_dir(), *user_config_dirs()):
        folder = Path(root) / _check_group(group)
        if not folder.is_dir():
            continue
        for p in sorted(folder.iterdir()):
            if not p.name.endswith(".yaml"):
                continue
            name = p.name[:-5]
            if name in found:
                raise ValueError(f"{group} {name!r} is defined twice: {found[name]} and {p}; rename the "
                                 f"user's one (a name picks exactly one plug-in)")
            found[name] = p
    return found


def names(group: str) -> list[str]:
    return sorted(files(group))


def spec(group: str, choice: str | Mapping[str, Any]) -> DictConfig:
    """The config of a choice: a name of `group`, a dotted class path, or a mapping with `_target_`."""
    if isinstance(choice, (Mapping, DictConfig)):
        cfg = OmegaConf.create(dict(choice) if not isinstance(choice, DictConfig) else choice)
        if "_target_" not in cfg:
            raise ValueError(f"{group}={dict(choice)!r}: a {group} config needs a _target_ (the class's dotted path)")
        return cfg
    if not isinstance(choice, str) or not choice:
        raise ValueError(f"{group}={choice!r}: give a {group} name ({', '.join(names(group))}) or a class's dotted path")
    path = files(group).get(choice)
    if path is not None:
        cfg = OmegaConf.load(path)
        if not isinstance(cfg, DictConfig) or "_target_" not in cfg:
            raise ValueError(f"{path}: a {group} config needs a _target_ (the class's dotted path)")
        return cfg
    if "." in choice:
        return OmegaConf.create({"_target_": choice})
    raise ValueError(f"unknown {group} {choice!r}; choose one of {', '.join(names(group))} "
                     f"(conf/{group}/*.yaml, or {group}/*.yaml in a folder of {CONFIG_PATH_ENV}), "
                     f"or give a class's dotted path (mypkg.module.Class)")


def target(group: str, choice: str | Mapping[str, Any]) -> Any:
    dotted = str(spec(group, choice)._target_)
    module, _, attr = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{group}: cannot import {dotted!r} ({type(e).__name__}: {e}); check the module is "
                         f"importable (on sys.path) and the class name") from None


def build(group: str, choice: str | Mapping[str, Any], /, *, context: Mapping[str, Any] | None = None,
          **overrides: Any) -> Any:
    """Instantiate a choice with `overrides` over its yaml; its interpolations read `context`."""
    return builder(group, choice, context=context, **overrides)()


def builder(group: str, choice: str | Mapping[str, Any], /, *, context: Mapping[str, Any] | None = None,
            **overrides: Any) -> Callable[[], Any]:
    """build(group, choice, ...) as a maker of new, equal instances (a fleet's replicas each build
    the same policy): the config resolved once; the first call instantiates it (Hydra), later calls
    call the class it made with a fresh copy of the same settings where the config is plain
    keywords (no `_args_`, `_partial_`, nested `_target_`), else instantiate again."""
    cfg = spec(group, choice)
    cls = target(group, cfg)
    if overrides:
        cfg = OmegaConf.merge(cfg, overrides)
    full = dict(context) if context else {}
    named = _named(cfg, full)
    try:
        resolved = _resolve(group, choice, cfg, full if named is None else named)
    except ValueError:
        if named is None:
            raise
        resolved = _resolve(group, choice, cfg, full)  # its entries may interpolate others: as it always was
    kwargs = {k: v for k, v in resolved.items() if k != "_target_"}
    plain = isinstance(cls, type) and not any(k.startswith("_") for k in kwargs) and not _has_target(kwargs)
    made: list[bool] = []

    def make() -> Any:
        if made:
            return cls(**copy.deepcopy(kwargs))
        obj = _instantiate(group, choice, resolved)
        if plain and type(obj) is cls:
            made.append(True)
        return obj

    return make


def _instantiate(group: str, choice: Any, resolved: Any) -> Any:
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(resolved, _convert_="all")
    except InstantiationException as e:
        cause = e.__cause__ or e
        given = ", ".join(k for k in resolved if not k.startswith("_"))
        raise ValueError(f"{group} {_label(choice)}: {type(cause).__name__}: {' '.join(str(cause).split())} "
                         f"(settings given: {given or 'none'})") from None


def _has_target(value: Any) -> bool:
    """Whether a nested setting is itself something to instantiate (a mapping with _target_)."""
    if isinstance(value, dict):
        return "_target_" in value or any(_has_target(v) for v in value.values())
    return isinstance(value, list) and any(_has_target(v) for v in value)


def _named(cfg: DictConfig, context: dict[str, Any]) -> dict[str, Any] | None:
    """The context's top-level entries `cfg`'s interpolations name (an engine builds its policy once
    a replica: a whole run's config made an OmegaConf object each time), or None when a resolver, a
    relative or a nested interpolation leaves it unclear."""
    names: set[str] = set()
    stack: list[Any] = [OmegaConf.to_container(cfg, resolve=False)]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str) and "${" in v:
            for expr in re.findall(r"\$\{([^}]*)\}", v):
                if ":" in expr or expr.startswith(".") or "$" in expr or not expr:
                    return None
                names.add(re.split(r"[.\[]", expr, maxsplit=1)[0])
            if v.count("${") != len(re.findall(r"\$\{([^}]*)\}", v)):
                return None
    return {k: context[k] for k in names if k in context}


def _resolve(group: str, choice: Any, cfg: DictConfig, context: Mapping[str, Any]) -> Any:
    """`cfg` as a plain container, its interpolations read from `context`; a ValueError naming the plug-in."""
    root = OmegaConf.create({**context, "__plugin__": cfg})
    try:
        return OmegaConf.to_container(root.__plugin__, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as e:  # a ??? in its yaml that nothing set
        key = str(e.full_key).removeprefix("__plugin__.")
        raise ValueError(f"{group} {_label(choice)}: {key} must be set (??? in its yaml); give {key}=...") from None
    except Exception as e:  # an interpolation the context does not hold
        raise ValueError(f"{group} {_label(choice)}: {' '.join(str(e).split())}") from None


def _label(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else repr(dict(choice).get("_target_"))


def _check_group(group: str) -> str:
    if group not in GROUPS:
        raise ValueError(f"unknown plug-in group {group!r}; one of {', '.join(GROUPS)}")
    return group
