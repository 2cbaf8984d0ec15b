"""The engine's settings, checked in one place before anything is loaded or allocated
(`check_engine_settings`, then `size_kv_pool`). Every problem is one ValueError line naming the
setting as the caller spells it, the bad value and the fix; a setting given is never replaced."""

from __future__ import annotations

import math
import numbers
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported only to check a setting: the simulator builds engines without it.
DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}

#: How `python -m varlen.run` spells each setting (the scheduler's own two live in its group).
CLI_NAMES = {k: f"engine.{k}" for k in ("block_size", "num_blocks", "kv_cache_memory", "max_model_len", "dtype",
                                          "device", "seed", "threads", "linear_kernel")}
CLI_NAMES.update(max_num_seqs="scheduler.max_num_seqs", max_num_batched_tokens="scheduler.max_num_batched_tokens")

DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_KV_BUDGET = 2**30  # bytes, when neither num_blocks nor kv_cache_memory is given


@dataclass(frozen=True)
class EngineSettings:
    """Checked values: ints are ints, memory is bytes, dtype and device are torch's."""

    block_size: int
    num_blocks: int | None
    kv_cache_memory: int | None  # bytes
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    max_model_len: int | None  # None: the model's max_position_embeddings
    dtype: torch.dtype
    device: torch.device
    seed: int
    threads: int | None  # torch CPU threads; None leaves torch's setting alone
    linear_kernel: str  # LINEAR_KERNELS
    names: Mapping[str, str] = field(default_factory=dict)
    given: Mapping[str, Any] = field(default_factory=dict)  # the values as given, for messages

    def name(self, key: str) -> str:
        return self.names.get(key, key)

    def error(self, key: str, value: Any, problem: str) -> ValueError:
        return setting_error(self.names, key, value, problem)


@dataclass(frozen=True)
class EngineSizes:
    """What varlen.assembly.build_engine sizes an engine by (None: the policy config's own)."""

    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None

    def policy_sizes(self) -> dict[str, int]:
        return {k: v for k, v in (("max_num_seqs", self.max_num_seqs),
                                  ("max_num_batched_tokens", self.max_num_batched_tokens)) if v is not None}


def setting_error(names: Mapping[str, str], key: str, value: Any, problem: str) -> ValueError:
    shown = value if isinstance(value, str) and names.get(key, key) != key else repr(value)
    return ValueError(f"{names.get(key, key)}={shown}: {problem}")


def _int(names: Mapping[str, str], key: str, value: Any, low: int, optional: bool = False,
         high: int | None = None, fix: str = "") -> int | None:
    """`value` as an int >= low (and < high), refusing bools, floats and strings."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low or \
            (high is not None and value >= high):
        want = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high if high < 2**32 else '2**64'})"
        raise setting_error(names, key, value, f"must be {want}{' (or unset)' if optional else ''}"
                                                f"{'; ' + fix if fix else ''}")
    return int(value)


def parse_memory(value: int | str, names: Mapping[str, str] | None = None) -> int:
    """Bytes from an int or a string such as '512MiB', '2GB', '1.5GiB' (KiB = 1024, KB = 1000)."""
    bad = setting_error(names or {}, "kv_cache_memory", value, "is not a memory size; write e.g. 512MiB or 2GB")
    if isinstance(value, bool):
        raise bad
    if isinstance(value, numbers.Real):
        if not math.isfinite(value) or value < 0:
            raise bad
        return int(value)
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGTP]?)(i?)B?\s*", str(value), re.IGNORECASE)
    if not m or (m.group(3) and not m.group(2)):
        raise bad
    base = 1024 if m.group(3) or not m.group(2) else 1000
    return int(float(m.group(1)) * base ** " KMGTP".index(m.group(2).upper() or " "))


#: auto: oneDNN where it serves the device and dtype, else F.linear; onednn: that or an error; torch: F.linear.
LINEAR_KERNELS = ("auto", "onednn", "torch")


def _choice(names: Mapping[str, str], key: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise setting_error(names, key, value, f"must be one of {', '.join(choices)}")
    return value


def _dtype(names: Mapping[str, str], value: Any) -> torch.dtype:
    import torch

    if isinstance(value, torch.dtype) and value.is_floating_point:
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in DTYPES:
        return getattr(torch, DTYPES[value.removeprefix("torch.")])
    raise setting_error(names, "dtype", value, "is not a dtype the engine runs in; use float32, float16 or bfloat16")


def _device(names: Mapping[str, str], value: Any) -> torch.device:
    import torch

    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise setting_error(names, "device", value, "is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:  # ROCm speaks "cuda" too
            raise setting_error(names, "device", value, f"this torch ({torch.__version__}) is a CPU-only build; "
                                                        f"use device=cpu, or install a CUDA build of torch")
        if not torch.cuda.is_available():
            raise setting_error(names, "device", value, "no CUDA device is visible; use device=cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise setting_error(names, "device", value, f"only {torch.cuda.device_count()} CUDA device(s) are "
                                                        f"visible; use cuda:0..{torch.cuda.device_count() - 1}")
        return dev
    backend = getattr(torch.backends, dev.type, None) if dev.type == "mps" else getattr(torch, dev.type, None)
    if backend is None or not getattr(backend, "is_available", lambda: False)():
        raise setting_error(names, "device", value, f"no {dev.type} device is available here; use device=cpu")
    return dev


def check_engine_settings(*, names: Mapping[str, str] | None = None, block_size: Any = 16, num_blocks: Any = None,
                          kv_cache_memory: Any = None, max_num_seqs: Any = None, max_num_batched_tokens: Any = None,
                          max_model_len: Any = None, dtype: Any = "float32", device: Any = "cpu", seed: Any = 0,
                          threads: Any = None, linear_kernel: Any = "auto") -> EngineSettings:
    """Every engine setting checked; the first bad one raises its one-line ValueError."""
    names = dict(names or {})
    memory = None
    if kv_cache_memory is not None:
        memory = parse_memory(kv_cache_memory, names)
        if memory < 1:
            raise setting_error(names, "kv_cache_memory", kv_cache_memory,
                                "holds no KV block; give a size such as 256MiB")
    return EngineSettings(
        block_size=_int(names, "block_size", block_size, 1, fix="e.g. 16"),  # type: ignore[arg-type]
        num_blocks=_int(names, "num_blocks", num_blocks, 1, optional=True),
        kv_cache_memory=memory,
        max_num_seqs=_int(names, "max_num_seqs", max_num_seqs, 1, optional=True),
        max_num_batched_tokens=_int(names, "max_num_batched_tokens", max_num_batched_tokens, 1, optional=True),
        max_model_len=_int(names, "max_model_len", max_model_len, 1, optional=True),
        dtype=_dtype(names, dtype), device=_device(names, device),
        seed=_int(names, "seed", seed, 0, high=2**64),  # type: ignore[arg-type]
        threads=_int(names, "threads", threads, 1, optional=True, fix="the number of CPU threads torch may use"),
        linear_kernel=_choice(names, "linear_kernel", linear_kernel, LINEAR_KERNELS),
        names=names,
        given=dict(kv_cache_memory=kv_cache_memory, num_blocks=num_blocks, max_model_len=max_model_len))


def check_cli_settings(cfg: Any) -> EngineSettings:
    """`python -m varlen.run`'s engine.* settings and the scheduler group's two sizes."""
    e, sched = cfg.engine, cfg.get("scheduler") or {}
    return check_engine_settings(
        names=CLI_NAMES, block_size=e.block_size, num_blocks=e.num_blocks, kv_cache_memory=e.kv_cache_memory,
        max_num_seqs=sched.get("max_num_seqs"), max_num_batched_tokens=sched.get("max_num_batched_tokens"),
        max_model_len=e.max_model_len, dtype=e.dtype, device=e.device, seed=e.seed, threads=e.threads,
        linear_kernel=e.linear_kernel)


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on `device` (None: unknown)."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    try:  # a container's own limit (cgroup v2) is what the allocation meets first
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def size_kv_pool(s: EngineSettings, model_config: Any, bytes_per_block: int, max_num_seqs: int) -> EngineSizes:
    """The engine's sizes: max_model_len within the model's positions, a pool that fits the device."""
    positions = getattr(model_config, "max_position_embeddings", None)
    max_model_len = s.max_model_len
    if max_model_len is None:
        if positions is None:
            raise s.error("max_model_len", None, "the model's config has no max_position_embeddings; "
                                                 "set max_model_len")
        max_model_len = int(positions)
    elif positions is not None and max_model_len > positions:
        raise s.error("max_model_len", max_model_len, f"is more than the model's max_position_embeddings "
                                                      f"({positions}); set it <= {positions}")
    key = "num_blocks" if s.num_blocks is not None else "kv_cache_memory"
    if s.num_blocks is not None:
        num_blocks = s.num_blocks
    elif s.kv_cache_memory is not None:
        num_blocks = s.kv_cache_memory // bytes_per_block
        if num_blocks < 1:
            raise s.error(key, s.given.get(key), f"holds no KV block of {bytes_per_block} bytes; give at least that")
    else:
        num_blocks = max(1, min(max_num_seqs * -(-max_model_len // s.block_size), DEFAULT_KV_BUDGET // bytes_per_block))
    need = num_blocks * bytes_per_block
    free = available_memory(s.device)
    if free is not None and need > free:
        raise s.error(key, s.given.get(key), f"a KV pool of {num_blocks} blocks of {bytes_per_block} bytes needs "
                                             f"{need / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB free on "
                                             f"{s.device}; give a smaller {s.name(key)}")
    return EngineSizes(num_blocks, s.block_size, max_model_len, s.max_num_seqs, s.max_num_batched_tokens)
