"""What every command-line entry point shares (`varlen.run`, `sim.run`, `sim.capacity`): its own
run directory (`ClaimRunDir`), settings checked before any work (`CheckSweep`), one-line errors
(exit 2), trimmed plug-in tracebacks (exit 1), Ctrl-C that says what was written (exit 130). No torch.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, NoReturn

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

CLAIM = ".varlen-run"  # created exclusively in a run directory by the run that owns it
EXIT_USAGE = 2  # a setting or an input is wrong
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports it


def _config_path() -> list[str]:
    from varlen import registry

    return registry.search_path_urls()


def _help_groups() -> str:
    """--help's groups: those the command's defaults choose from, not every group of conf/."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    hc, loader = HydraConfig.get(), GlobalHydra.instance().config_loader()
    # "group@package" entries are a command's own per-choice defaults (workload_defaults), not a choice.
    groups = sorted(g for g in hc.runtime.choices if g != "hydra" and not g.startswith("hydra/") and "@" not in g)
    options = {g: loader.get_group_options(g, config_name=hc.job.config_name, overrides=list(hc.overrides.task))
               for g in groups}
    return "\n".join(f"{g}: {', '.join(sorted(o))}" for g, o in options.items())


def _yaml_comments(text: str) -> dict[str, str]:
    """Each dotted key of a config file and its comment: the one after it on its line, else the
    comment lines right above it. `defaults` and `hydra` are Hydra's, not options."""
    import re

    out: dict[str, str] = {}
    path: list[tuple[int, str]] = []  # (indent, key) of the enclosing mappings
    above: list[str] = []
    seen = False  # a key yet
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        m = re.match(r"^(\s*)([A-Za-z_][\w-]*)\s*:(?:\s+|$)(.*)$", line)
        if not m:
            above = []
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3)
        while path and path[-1][0] >= indent:
            path.pop()
        path.append((indent, key))
        # a quoted value may hold '#': only a '#' after whitespace outside quotes starts a comment
        c = re.search(r"""^(?:[^'"#]|'[^']*'|"[^"]*")*?\s#\s?(.*)$""", " " + rest)
        # comment lines above a key explain it, except the file's own opening lines
        comment = c.group(1).strip() if c else " ".join(above) if len(path) > 1 or seen else ""
        above, seen = [], True
        if path[0][1] not in ("defaults", "hydra") and comment:
            out[".".join(k for _, k in path)] = comment
    return out


def _config_text(name: str) -> str | None:
    """The text of config `name` (e.g. "sim", "workload/synthetic") from the first folder of the
    running command's search path that has it."""
    from importlib import resources

    from hydra.core.hydra_config import HydraConfig

    for source in HydraConfig.get().runtime.config_sources:
        scheme, where = source.schema, str(source.path)
        if scheme == "file":
            f: Any = Path(where) / f"{name}.yaml"
        elif scheme == "pkg":
            f = resources.files(where.replace("/", ".")).joinpath(f"{name}.yaml")
        else:
            continue
        if f.is_file():
            return f.read_text()
    return None


def _primary_chain(name: str, seen: set[str]) -> list[str]:
    """Config `name` and the configs of its own folder its defaults list includes (run -> sim), first to last."""
    text = _config_text(name)
    if text is None or name in seen:
        return []
    seen.add(name)
    defaults = OmegaConf.create(text).get("defaults") or []
    chain: list[str] = []
    for d in defaults:
        if isinstance(d, str) and d != "_self_" and not d.startswith(("override ", "optional ")):
            chain += _primary_chain(d, seen)
    return chain + [name]


def _help_options(*, _root_: Any = None) -> str:
    """--help's options: every key of the command's composed config (group choices and overrides
    included) with its value and the comment its config file gives it."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    comments: dict[str, str] = {}
    # Groups first (their package is the group's name; "group@package" a command's own defaults for a
    # choice), then the command's configs, so that a command's comment on a key wins.
    for group, choice in sorted(hc.runtime.choices.items()):
        if group == "hydra" or group.startswith("hydra/") or not isinstance(choice, str):
            continue
        folder, _, package = group.partition("@")
        text = _config_text(f"{folder}/{choice}")
        if text:
            comments.update({f"{package or folder}.{k}": c for k, c in _yaml_comments(text).items()})
    for name in _primary_chain(hc.job.config_name, set()):
        comments.update(_yaml_comments(_config_text(name) or ""))

    def shown(value: Any) -> str:
        import yaml

        plain = OmegaConf.to_container(value, resolve=False) if OmegaConf.is_config(value) else value
        return yaml.safe_dump(plain, default_flow_style=True, width=10**6).removesuffix("\n...\n").strip()

    lines: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        for key in node:
            dotted = f"{prefix}{key}"
            value = node._get_node(key)
            if OmegaConf.is_dict(value) and len(value) and not OmegaConf.is_missing(node, key):
                if dotted in comments:
                    lines.append(f"{dotted}.*  — {comments[dotted]}")
                walk(value, dotted + ".")
                continue
            raw = value._value() if not OmegaConf.is_config(value) else value
            text = f"{dotted}: {shown(raw)}"
            lines.append(f"{text}  — {comments[dotted]}" if dotted in comments else text)

    app = {k: v for k, v in _root_.items_ex(resolve=False) if k != "hydra"} if _root_ is not None else {}
    walk(OmegaConf.create(app), "")
    return "\n".join(lines).replace("$", "$$")  # Hydra fills the template with string.Template


def _help_for(job: str, text: str) -> str:
    """`text` when the running command's job (its module's last name, e.g. capacity) is `job`, else
    "": one config's --help header for each command that starts from it (sim.run, sim.capacity)."""
    from hydra.core.hydra_config import HydraConfig

    return text if HydraConfig.get().job.name == job else ""


OmegaConf.register_new_resolver("varlen_config_path", _config_path, replace=True)
OmegaConf.register_new_resolver("varlen_help_groups", _help_groups, replace=True)
OmegaConf.register_new_resolver("varlen_help_for", _help_for, replace=True)
OmegaConf.register_new_resolver("varlen_help_options", _help_options, replace=True)


def check_config_path() -> None:
    """VARLEN_CONFIG_PATH names folders, and no group name twice; else one line, exit 2."""
    from varlen import registry

    try:
        for group in registry.GROUPS:
            registry.files(group)
    except ValueError as e:
        fail(str(e))


class SettingError(ValueError):
    """A setting or input that cannot work; the message is one line naming it and the fix."""


EXIT_PLUGIN = 1  # a user's plug-in raised: its exception, not a setting, is the problem


def fail(message: str) -> NoReturn:
    """One line on stderr, exit 2; while handling a user plug-in's exception, that exception with its
    traceback trimmed to the user's frames instead, exit 1."""
    line = " ".join(str(message).split())
    raised = plugin_exception(sys.exc_info()[1])
    if raised is not None:
        kind = type(raised).__name__
        print(f"error in a plug-in: {line if kind in line else f'{kind}: {line}'}", file=sys.stderr)
        print(user_traceback(raised), file=sys.stderr, end="")
        sys.exit(EXIT_PLUGIN)
    print(f"error: {line}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


# Where an exception was raised: the framework's packages, libraries, or the user's code.
_FRAMEWORK = tuple(str(Path(__file__).resolve().parents[1] / d) + os.sep
                   for d in ("varlen", "sim", "schedulers", "backends", "hydra_plugins", "conf"))


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    import site
    import sysconfig

    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.update(site.getsitepackages() + [site.getusersitepackages()])
    return tuple(str(Path(p).resolve()) + os.sep for p in paths if p)


def is_user_file(filename: str) -> bool:
    """A frame's file is the user's: not the framework's and not a library's."""
    if filename.startswith("<"):  # <frozen ...>, <string>: the interpreter's
        return False
    f = str(Path(filename).resolve())
    return not f.startswith(_FRAMEWORK) and not f.startswith(_library_dirs())


def plugin_exception(exc: BaseException | None) -> BaseException | None:
    """The exception in `exc`'s chain raised in the user's code (innermost frame outside libraries), or None."""
    import traceback

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if not isinstance(exc, SettingError):
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if not _is_library(f.filename)]
            if frames and is_user_file(frames[-1].filename):
                return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _is_library(filename: str) -> bool:
    return filename.startswith("<") or str(Path(filename).resolve()).startswith(_library_dirs())


def user_traceback(exc: BaseException) -> str:
    """`exc` as Python prints it, its traceback trimmed to the frames in the user's files."""
    import traceback

    frames = traceback.StackSummary.from_list(
        [f for f in traceback.extract_tb(exc.__traceback__) if is_user_file(f.filename)])
    return ("Traceback (most recent call last; the framework's and libraries' frames left out):\n"
            + "".join(frames.format()) + "".join(traceback.format_exception_only(type(exc), exc)))


def interrupted(message: str) -> NoReturn:
    """After Ctrl-C: one line saying what was (not) written, exit 130."""
    print(f"interrupted: {message}", file=sys.stderr)
    sys.exit(EXIT_INTERRUPTED)


def run_cli(main: Callable[[], Any]) -> None:
    """A command's `__main__`: after Ctrl-C, flush and leave at once (teardown takes seconds with torch)."""
    from hydra.errors import ConfigCompositionException, OverrideParseException

    check_config_path()
    check_renamed(sys.argv[1:])
    # Hydra's own errors end here as one line, unless HYDRA_FULL_ERROR is set.
    own = "HYDRA_FULL_ERROR" not in os.environ
    if own:
        os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except (ConfigCompositionException, OverrideParseException) as e:
        if not own:
            raise
        fail(hydra_error_line(e))
    except SystemExit as e:
        if e.code != EXIT_INTERRUPTED:
            raise
        _leave_now()
    except KeyboardInterrupt:
        print("interrupted: stopped; runs that had finished kept their results, the others wrote none "
              "(a run's summary is written last)", file=sys.stderr)
        _leave_now()
    finally:
        if own:
            os.environ.pop("HYDRA_FULL_ERROR", None)


#: Old command-line names: before Hydra, whose own error would not say what they became.
RENAMED = {"sim_workload": "workload", "workload.target_rate": "workload.rate",
           "workload.num_requests": "workload.limit"}


def check_renamed(args: Iterable[str]) -> None:
    for arg in args:
        key, eq, value = arg.partition("=")
        new = RENAMED.get(key.lstrip("+~"))
        if eq and new:
            fail(f"{key.lstrip('+~')} was renamed to {new}: {new}={value}")


def _leave_now() -> NoReturn:
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)




def claim_dir(path: str | os.PathLike, setting: str = "hydra.run.dir") -> Path:
    """Create and own an empty directory at `path`, or at the first free `path-1`, `path-2`, ..."""
    base = Path(path)
    if base.name in ("", ".", ".."):
        base = base.resolve()
    for k in itertools.count():
        cand = base if k == 0 else base.with_name(f"{base.name}-{k}")
        if k and cand.exists() and not cand.is_dir():
            continue  # a file named like the next candidate: not ours to replace
        try:
            cand.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            blocker = next((p for p in [cand, *cand.parents] if p.exists() and not p.is_dir()), cand)
            raise SettingError(f"{setting}={str(base)!r}: cannot create the run directory, {str(blocker)!r} is "
                               f"a regular file; choose another directory") from None
        except PermissionError as e:
            raise SettingError(f"{setting}={str(base)!r}: cannot create the run directory ({e.strerror}); "
                               "choose a writable directory") from None
        if any(cand.iterdir()):
            continue  # another run's (or someone's) files: never write next to them
        try:
            fd = os.open(cand / CLAIM, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            continue  # another process claimed it a moment ago
        with os.fdopen(fd, "w") as f:
            f.write(f"pid {os.getpid()} on {socket.gethostname()} at {time.time():.6f}\n")
        if k:
            print(f"{setting} {str(base)!r} holds another run: this one writes to {str(cand)!r}")
        return cand
    raise AssertionError("unreachable")


def _override_value(s: str) -> str:
    """A string quoted for Hydra's override grammar."""
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


class ClaimRunDir(Callback):
    """Claims `hydra.run.dir` or `hydra.sweep.dir` before Hydra writes into it (and in the overrides, for launchers)."""

    def _claim(self, config: DictConfig, key: str) -> None:
        try:
            chosen = claim_dir(OmegaConf.select(config, key), key)
        except SettingError as e:
            fail(str(e))
        except Exception as e:
            fail(f"{key}: {e}")
        with read_write(config.hydra), open_dict(config.hydra):
            OmegaConf.update(config, key, str(chosen), merge=False)
            config.hydra.overrides.hydra.append(f"{key}={_override_value(str(chosen))}")

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._claim(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        subdir = OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir")
        if not any(k in str(subdir) for k in ("hydra.job.num", "hydra.job.id")):
            fail(f"hydra.sweep.subdir={subdir!r} could give several jobs one directory; include "
                 "${hydra.job.num} (e.g. hydra.sweep.subdir='${hydra.job.num}_${hydra.job.override_dirname}')")
        self._claim(config, "hydra.sweep.dir")


class CheckSweep(Callback):
    """Before any job of a multirun starts, compose every job's config and run its command's checks;
    one line per bad job, exit 2, so one bad value cannot fail mid-sweep. `checks`: job name -> check's path."""

    def __init__(self, checks: dict[str, str]) -> None:
        self.checks = dict(checks)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.utils import get_method

        path = self.checks.get(str(config.hydra.job.name))
        if path is None:
            return
        check = get_method(path)
        jobs = sweep_jobs(config)
        if jobs is None:
            return  # another sweeper chooses its jobs as it goes: each job checks its own settings
        from hydra.core.global_hydra import GlobalHydra

        from hydra.core.hydra_config import HydraConfig

        loader, hydra_cfg = GlobalHydra.instance().config_loader(), HydraConfig.instance().cfg
        varying = [k for k in dict.fromkeys(o.split("=", 1)[0] for job in jobs for o in job)
                   if len({o for job in jobs for o in job if o.split("=", 1)[0] == k}) > 1]
        from hydra.errors import HydraException

        bad = []
        try:
            for num, job in enumerate(jobs):
                label = " ".join(o for o in job if o.split("=", 1)[0] in varying) or " ".join(job)
                try:
                    job_cfg = _job_config(loader, config, job, num)
                except HydraException as e:
                    bad.append(f"error: job {num} ({label}): {hydra_error_line(e)}")
                    continue
                try:
                    check(job_cfg)
                except errors_to_exit() as e:
                    bad.append(f"error: job {num} ({label}): {' '.join(str(e).split())}")
        finally:
            HydraConfig.instance().cfg = hydra_cfg
        if bad:
            print("\n".join(bad), file=sys.stderr)
            sys.exit(EXIT_USAGE)


def _job_config(loader: Any, config: DictConfig, job: list[str], num: int) -> DictConfig:
    """Job `num`'s config as its task function will see it (without the `hydra` node)."""
    from hydra.core.hydra_config import HydraConfig

    cfg = loader.load_sweep_config(config, list(job))
    with open_dict(cfg):  # as the launcher sets them (hydra.sweep.subdir reads them)
        cfg.hydra.job.num, cfg.hydra.job.id = num, f"check_{num}"
    HydraConfig.instance().set_config(cfg)
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]
    return cfg


def sweep_jobs(config: DictConfig) -> list[list[str]] | None:
    """Each job's overrides, as Hydra's basic sweeper will launch them; None for another sweeper."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    target = str(OmegaConf.select(config, "hydra.sweeper._target_") or "")
    if not target.endswith("BasicSweeper"):
        return None
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    overrides = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(overrides), None)
    return [list(job) for batch in batches for job in batch]


def hydra_error_line(e: BaseException) -> str:
    """One line for Hydra's config error, with the closest name ("did you mean") or the options."""
    import difflib
    import re

    from hydra.errors import MissingConfigException, OverrideParseException

    def squash(text: str) -> str:
        return " ".join(text.split("\nConfig search path:")[0].split())

    if isinstance(e, MissingConfigException) and e.options and e.missing_cfg_file and "/" in e.missing_cfg_file:
        group, _, name = e.missing_cfg_file.rpartition("/")
        close = difflib.get_close_matches(name, e.options, n=1)
        mean = f"did you mean {group}={close[0]}? " if close else ""
        folders = os.environ.get("VARLEN_CONFIG_PATH") or "unset"
        return (f"{group}={name} is unknown: {mean}{group} is one of {', '.join(e.options)}; a plug-in of your own "
                f"is found as {group}/{name}.yaml in a folder on VARLEN_CONFIG_PATH (now {folders})")
    if isinstance(e, OverrideParseException):
        return f"{e.override}: cannot parse it ({squash(e.message.split(chr(10))[0])}); quote a value with spaces or brackets"
    cause = e.__cause__
    parent, key = getattr(cause, "parent_node", None), getattr(cause, "key", None)
    if isinstance(parent, DictConfig) and isinstance(key, str):
        full = str(getattr(cause, "full_key", None) or key)
        section = full.rpartition(".")[0]
        keys = [str(k) for k in parent.keys() if str(k) != "hydra" and not str(k).startswith("_")]
        given = re.search(r"use \+(\S+)", str(e))
        value = given.group(1).partition("=")[2] if given else "..."
        close = [f"{section + '.' if section else ''}{k}" for k in difflib.get_close_matches(key, keys, n=1)]
        if not close:  # a key of another section: engine.max_num_seqs for scheduler.max_num_seqs
            paths = _key_paths(OmegaConf.to_container(parent._get_root(), resolve=False))
            near = difflib.get_close_matches(key, [p.rpartition(".")[2] for p in paths], n=1, cutoff=0.8)
            close = [p for p in paths if near and p.rpartition(".")[2] == near[0]][:1]
        where = f"{section} has" if section else "the settings and groups are"
        fix = f"did you mean {close[0]}={value}? " if close else f"to add a key of your own: +{full}={value}; "
        return f"{full} is not a setting: {fix}{where} {', '.join(keys)}"
    return squash(str(e))


def _key_paths(node: Any, prefix: str = "") -> list[str]:
    """The dotted paths of a config's keys, the hydra node left out."""
    if not isinstance(node, dict):
        return []
    out = []
    for k, v in node.items():
        if (not prefix and k == "hydra") or str(k).startswith("_"):
            continue
        out += [f"{prefix}{k}", *_key_paths(v, f"{prefix}{k}.")]
    return out




def check_missing(cfg: DictConfig) -> None:
    """Every mandatory value ('???') is set."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        hint = {"model.path": " (a local Hugging Face folder)", "sim_model.config": " (a config.json or its folder)",
                "workload.path": " (a text file, one prompt per line)"}
        key = missing[0]
        more = f" (also unset: {', '.join(missing[1:])})" if len(missing) > 1 else ""
        raise SettingError(f"{key} is required but not set (???); set it on the command line: "
                           f"{key}=...{hint.get(key, '')}{more}")


def number(cfg: DictConfig, key: str, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, integer: bool = False, optional: bool = False, hint: str = "") -> float | int | None:
    """The value at `key` as a number in range, or a SettingError naming it, its value and the range."""
    v = OmegaConf.select(cfg, key)
    if v is None and optional:
        return None
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if ok and integer and (isinstance(v, float) and not v.is_integer()):
        ok = False
    if ok:
        if low is not None and (v < low or (low_open and v == low)):
            ok = False
        if high is not None and v > high:
            ok = False
    if ok:
        return int(v) if integer else v
    kind = "an integer" if integer else "a number"
    lo = "" if low is None else f"{'>' if low_open else '>='} {low:g}"
    hi = "" if high is None else f"<= {high:g}"
    rng = " and ".join(x for x in (lo, hi) if x)
    need = f"{kind}{' ' + rng if rng else ''}{' or null' if optional else ''}"
    raise SettingError(f"{key}={v!r} is not valid: it must be {need}{hint}")


def existing_file(cfg: DictConfig, key: str, what: str) -> Path:
    """`key` names a readable file (not a directory)."""
    p = Path(str(OmegaConf.select(cfg, key)))
    if p.is_dir():
        raise SettingError(f"{key}={str(p)!r} is a directory; give {what}")
    if not p.is_file():
        raise SettingError(f"{key}={str(p)!r} does not exist; give {what}")
    return p


def check_slo(cfg: DictConfig) -> None:
    for key in ("slo.ttft_s", "slo.tpot_s", "slo.tbt_s"):
        number(cfg, key, low=0, low_open=True, optional=True, hint=" (seconds)")


def errors_to_exit(exc_types: Iterable[type[BaseException]] = ()) -> tuple[type[BaseException], ...]:
    """The exceptions a CLI turns into one line and exit 2: bad settings and bad inputs."""
    from varlen.traces import TraceFormatError

    return (SettingError, ValueError, FileNotFoundError, IsADirectoryError, TraceFormatError, *exc_types)
