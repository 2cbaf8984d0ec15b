"""`python -m sim.profile`: time the real layers of a stock HF model on this machine and write
operator tables in the layout `cost.model=measured` reads (sim/profiles/README.md).

    python -m sim.profile --model tiny --out profiles/            # the embedded tiny Qwen3, on CPU
    python -m sim.profile --model /path/to/hf-folder --device cuda --dtype bfloat16 --gpu h200_sxm --out profiles/

Also writes attention.csv (`--backend`; by default what `backend=auto`, the engine's default, picks for the
model here, printed), overhead.csv (the engine's per-step cost the operators
leave unexplained) and, with `--collectives N`, network tables (sim/profile_network.py).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

# Every row count to 16: at a few rows a GEMM library switches kernels from one count to the next (a
# step of 2 decodes can take longer than one of 3), so decode batch sizes are timed, not interpolated.
DEFAULT_TOKENS = (*range(1, 17), 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
OPS = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
       "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
STATS = ("min", "max", "mean", "median", "std")


def model_folder(name: str) -> Path:
    """tiny (the embedded default), big (benchmarks/throughput.py's 50M shape) or an HF folder."""
    from varlen.tiny_model import ensure_tiny_model, write_tiny_model

    if name == "tiny":
        return ensure_tiny_model("qwen3")
    if name == "big":
        # = benchmarks/throughput.py's BIG, in the folder it writes it to
        big: dict[str, Any] = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                   head_dim=64, intermediate_size=1536)
        path = Path(os.environ.get("VARLEN_HOME", Path.home() / ".cache" / "varlen")) / "bench-qwen3-50m"
        if not (path / "model.safetensors").exists():
            write_tiny_model(path, "qwen3", vocab_size=32000, initializer_range=0.02, **big)
        return path
    p = Path(name).expanduser()
    if not (p / "config.json").is_file():
        raise ValueError(f"--model {name!r}: not tiny, big or a folder with a config.json")
    return p


def op_clock(device: str) -> Callable[[], float]:
    """The clock operators are timed by: on CPU with one torch thread this process's CPU time, as the
    engine's steps are (profile_engine, benchmarks/sim_fidelity.py): another process on the core
    stretches wall-clock timings at random and the tables would disagree with the steps they predict."""
    import torch

    if device == "cpu" and torch.get_num_threads() == 1:
        return time.process_time
    return time.perf_counter


def _timer(fn: Callable[[], Any], repeats: int, sync: Callable[[], None],
           clock: Callable[[], float] = time.perf_counter, before: Callable[[], Any] | None = None,
           untimed: int = 2) -> list[float]:
    """`fn`'s time in ms, `repeats` times after `untimed` calls; `before` runs ahead of each timed call, off the clock."""
    for _ in range(untimed):
        fn()
    sync()
    out = []
    for _ in range(repeats):
        if before is not None:
            before()
            sync()
        t0 = clock()
        fn()
        sync()
        out.append((clock() - t0) * 1e3)
    return out


def engine_model(folder: Path, device: str = "cpu", dtype: str = "float32", linear_kernel: str = "auto") -> Any:
    """The HF model with the kernels the engine swaps in (varlen/model_runner.py): packed oneDNN
    linears (`linear_kernel` as LLM's) and the fused norms, add+norm and SiLU·mul; timing stock
    modules instead put MKL's slower GEMMs in the tables, and every prefill came out slow."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from varlen.layer_kernels import fuse_layers
    from varlen.linear_kernels import MIN_PACKED_ELEMENTS, pack_linears

    if linear_kernel not in ("auto", "onednn", "torch"):
        raise ValueError(f"--linear-kernel {linear_kernel!r}: must be auto, onednn or torch (as the engine's)")
    hf_logging.disable_progress_bar()
    tdtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=tdtype).to(device).eval()
    if linear_kernel != "torch":
        pack_linears(model, torch.device(device), tdtype,
                     min_elements=0 if linear_kernel == "onednn" else MIN_PACKED_ELEMENTS)
    fuse_layers(model, torch.device(device), tdtype)
    return model


def _fused_ops(module: Any) -> Any:
    """The fused-kernel ops object a module's swapped forward calls (varlen.layer_kernels), or None."""
    f = module.__dict__.get("forward")
    args = getattr(f, "args", ())
    return args[1] if len(args) > 1 else None


# Token counts up to SMALL_TOKENS (decode batch sizes) are timed SMALL_VISITS times in each round of profile_model.
SMALL_TOKENS, SMALL_VISITS = 16, 4


def profile_model(folder: Path, tokens: tuple[int, ...], repeats: int, device: str = "cpu",
                  dtype: str = "float32", linear_kernel: str = "auto", passes: int = 3) -> list[dict[str, Any]]:
    """One row per token count: the operators' time statistics (ms) and the shape columns, each
    operator timed as the engine runs it (engine_model), in `passes` x `repeats` rounds that each time every
    count once (the first round in order, the others shuffled), each round's samples over that round's speed
    (round_speeds). On a shared or quiet VM the layers' sum at one count moved 10-40% from one second to the
    next: timed in blocks (a count's repeats back to back), each count carried a few seconds' speed, and two
    tables disagreed 10-20% per count; a round visits every count within about a second, so they share it."""
    import numpy as np
    import torch

    model = engine_model(folder, device, dtype, linear_kernel)
    cfg = model.config
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    clock = op_clock(device)
    rows = []

    def setup(t: int) -> tuple[list[dict[str, Callable[[], Any]]], Callable[[], Any]]:
        """A step's inputs at t tokens and each layer's operators on them."""
        ids = torch.randint(0, cfg.vocab_size, (1, t), device=device)
        x = model.model.embed_tokens(ids)
        pos = torch.arange(t, device=device)[None]
        cos, sin = model.model.rotary_emb(x, pos)
        q = attn.q_proj(x).view(1, t, heads, head_dim)
        k = attn.k_proj(x).view(1, t, kv_heads, head_dim)
        attn_out = torch.randn(1, t, heads * head_dim, device=device, dtype=x.dtype)
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        inner = mlp.act_fn(gate) * up
        resid = x.clone()
        layer_ops = [_layer_ops(lyr, rotary, x, q, k, cos, sin, attn_out, gate, up, inner, resid)
                     for lyr in model.model.layers]
        return layer_ops, partial(model.model.embed_tokens, ids)

    with torch.inference_mode():
        # Every count's inputs held for the whole table (activations only: ~50 MB for a 50M model to 512 tokens).
        made = {t: setup(t) for t in tokens}
        for t in tokens:  # untimed: first calls at a row count create their kernels, fault pages in
            _time_in_step_order(made[t][0], 0, sync, clock)
        order = np.random.default_rng(2)
        rounds = max(1, passes) * max(1, repeats)
        # Decode batch sizes visited SMALL_VISITS times a round: a visit costs a few ms (a large count's, tens),
        # and the table's noise at these counts is a few percent of every decode step the model predicts.
        visits = list(tokens) + [t for t in tokens if t <= SMALL_TOKENS] * (SMALL_VISITS - 1)
        timed: list[dict[int, list[dict[str, float]]]] = []
        for r in range(rounds):
            got: dict[int, list[dict[str, float]]] = {}
            for t in (visits if r == 0 else [visits[i] for i in order.permutation(len(visits))]):
                layer_ops, emb = made[t]
                one = {op: ms[0] for op, ms in _time_in_step_order(layer_ops, 1, sync, clock, untimed=0).items()}
                one["emb"] = _timer(emb, 1, sync, clock, untimed=0)[0]
                got.setdefault(t, []).append(one)
            timed.append(got)
        speeds = round_speeds([{t: statistics.fmean(sum(one.values()) for one in ones) for t, ones in got.items()}
                               for got in timed])
        for t in tokens:
            row: dict[str, Any] = {}
            for op in OPS:
                row.update({f"time_stats.{op}.{k}": v for k, v in _stats(
                    [one[op] / v for got, v in zip(timed, speeds) for one in got[t]]).items()})
            row.update(n_head=heads, n_kv_head=kv_heads, n_embd=cfg.hidden_size,
                       n_expanded_embd=cfg.intermediate_size, vocab_size=cfg.vocab_size, use_gated_mlp=True,
                       num_tokens=t, num_tensor_parallel_workers=1, head_dim=head_dim)
            rows.append(row)
    return rows


def round_speeds(rounds: list[dict[Any, float]]) -> list[float]:
    """Each round's speed: the median over its entries of the entry's time over that entry's median across the
    rounds (1.0: a typical round). A table's samples divided by it keep their shape across entries (what the
    measured model reads: the engine fit's operator scale sets the level) without the seconds that ran slow."""
    import numpy as np

    keys = list(rounds[0])
    typical = {k: float(np.median([r[k] for r in rounds])) for k in keys}
    return [float(np.median([r[k] / typical[k] for k in keys if typical[k] > 0] or [1.0])) for r in rounds]


def _layer_ops(layer: Any, rotary: Callable[..., Any], x: Any, q: Any, k: Any, cos: Any, sin: Any, attn_out: Any,
               gate: Any, up: Any, inner: Any, resid: Any) -> dict[str, Callable[[], Any]]:
    """One decoder layer's operators on its own weights, as the engine's kernels run them; with the
    layer's add+norm fused, "post_attention_layernorm" times that kernel (the add is taken off later)."""
    attn, mlp, post = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)

    def rope() -> Any:
        qq, kk = (qn(q) if qn else q).transpose(1, 2), (kn(k) if kn else k).transpose(1, 2)
        return rotary(qq, kk, cos, sin)

    ops: dict[str, Callable[[], Any]] = {
        "input_layernorm": lambda: layer.input_layernorm(x),
        "attn_pre_proj": lambda: (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)),
        "attn_rope": rope,
        "attn_post_proj": lambda: attn.o_proj(attn_out),
        "post_attention_layernorm": lambda: post(x),
        "mlp_up_proj": lambda: (mlp.gate_proj(x), mlp.up_proj(x)),
        "mlp_act": lambda: mlp.act_fn(gate) * up,
        "mlp_down_proj": lambda: mlp.down_proj(inner),
        "add": lambda: x + resid,
    }
    if (fused := _fused_ops(mlp)) is not None:
        ops["mlp_act"] = lambda: fused.silu_mul(gate, up)
    if (fused_layer := _fused_ops(layer)) is not None:
        ops["post_attention_layernorm"] = lambda: fused_layer.add_rmsnorm(x, resid, post.weight, post._varlen_eps)
        ops["fused_add"] = lambda: None  # marks the add inside the kernel
    return ops


def _time_in_step_order(layer_ops: list[dict[str, Callable[[], Any]]], repeats: int, sync: Callable[[], None],
                        clock: Callable[[], float], untimed: int = 2) -> dict[str, list[float]]:
    """Each operator's ms per layer: every layer's operators in the order a step runs them, each timed,
    summed over the layers. A step reads each layer's weights once: one operator timed over and over on
    the same weights finds them in cache (decode GEMMs 3-7x fast), while a flushed cache before each
    call made them ~40% slow; in step order the caches hold what they hold in the engine."""
    names = [op for op in OPS if op != "emb"]
    out: dict[str, list[float]] = {op: [] for op in names}
    for rep in range(repeats + untimed):  # the untimed passes first
        acc = dict.fromkeys(names, 0.0)
        for ops in layer_ops:
            for op in names:
                t0 = clock()
                ops[op]()
                sync()
                acc[op] += clock() - t0
        if rep >= untimed:
            for op in names:
                out[op].append(acc[op] / len(layer_ops) * 1e3)
    if "fused_add" in layer_ops[0]:
        # The engine adds the attention's output into the residual and norms in one kernel: less one
        # add, the table's two adds per layer sum to what it runs. At a few tokens the fused kernel can
        # time below a lone add: floored above 0, as a table with a zero time is refused when read.
        out["post_attention_layernorm"] = [max(b - a, 1e-3 * b, 1e-9)
                                           for b, a in zip(out["post_attention_layernorm"], out["add"])]
    return out


def resolve_backend(name: str, folder: Path, device: str = "cpu", dtype: str = "float32",
                    block_size: int = 16) -> tuple[str, str]:
    """(the backend to time, the line that says so): `name` itself, or for "auto" the backend a run with
    `backend=auto` (the engine's default) picks for this model here (varlen/backend_choice.py), so the
    tables time what a user's run computes. Reads the model's layers (its windows, soft-caps, sinks) by
    loading it once with the engine's attention."""
    if name != "auto":
        return name, f"backend: {name}"
    import torch

    from varlen.backend_choice import announcement, choose
    from varlen.model_attention import read_model_attention
    from varlen.model_runner import load_model

    tdtype = getattr(torch, dtype)
    layers = read_model_attention(load_model(folder, tdtype, device), "varlen_ctx").layers
    chosen, passed = choose(device, tdtype, block_size, frozenset().union(*(spec.features for spec in layers)))
    return chosen, announcement(chosen, passed, device, tdtype)


# The most a profile reads between timed attention calls (above any CPU's L3 cache).
EVICT_MAX_BYTES = 256 << 20
# The most KV caches the timed attention calls take turns over (one per layer, as the engine's).
KV_COPIES = 8


def layer_weight_bytes(cfg: Any, dtype: Any) -> int:
    """About how many bytes of weights one decoder layer reads (its projections and its MLP, the experts a
    token runs in an MoE layer): what the engine streams between one layer's attention call and the next's."""
    import torch

    from sim.cost.hardware import ModelShape

    shape = ModelShape.from_config(cfg.to_dict())
    mlp = shape.moe_active_mlp_params if shape.is_moe else shape.mlp_matrices * shape.hidden * shape.intermediate
    return (shape.attention_params + mlp) * torch.empty(0, dtype=dtype).element_size()


DECODE_GRID = ((1, 64), (1, 512), (1, 2048), (8, 64), (8, 512), (8, 2048), (32, 256), (32, 1024), (64, 512))
# (requests, new tokens, cached). Both sides of a backend that sends prompts of >= backends.torch_paged.LONG_SDPA_MIN
# (64) new tokens to SDPA and shorter ones (a chunk's tail) to its own kernel: 16, 32 and 48 new tokens are the kernel's.
# SDPA charges a chunk after a cached context its whole n x (cached + n) rectangle: (1, 128, 512) and (1, 192, 128)
# are such chunks at a chunked engine's budget, beside the fresh prompts (cached 0).
PREFILL_GRID = ((1, 16, 0), (1, 64, 0), (1, 256, 0), (1, 1024, 0), (1, 256, 512), (1, 512, 1024), (4, 128, 0),
                (4, 256, 256), (1, 128, 512), (1, 192, 128), (1, 48, 512), (4, 32, 256))


def profile_attention(folder: Path, backend_name: str, repeats: int, device: str = "cpu", dtype: str = "float32",
                      block_size: int = 16, passes: int = 3, evict_bytes: int | None = None) -> list[dict[str, Any]]:
    """One layer of the attention backend (prepare + forward) over decodes and prefills, ms per layer: each
    case `repeats` times in each of `passes` passes (the first in grid order, the others shuffled), pooled.
    evict_bytes: a buffer this large is read before each timed forward, off the clock, as the engine streams one
    layer's weights between two attention calls, and the calls take turns over one KV cache per layer (default
    on CPU: layer_weight_bytes, at most EVICT_MAX_BYTES; elsewhere 0, not validated there). Timed back to back
    instead, the KV and the kernel's data stay in cache and small decodes came out at ~0.4x their time in the
    engine; how much of one KV cache stays in L3 then depends on what else the machine runs."""
    import numpy as np
    import torch
    from transformers import AutoConfig

    from varlen import registry
    from varlen.batch import SeqSlice, build_batch

    cfg = AutoConfig.from_pretrained(folder)
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    backend = registry.build("backend", backend_name)
    tdtype = getattr(torch, dtype)
    backend.bind(hq, hkv, d, tdtype, block_size, device)  # as the model runner does, before any step
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    clock = op_clock(device)
    if evict_bytes is None:
        evict_bytes = min(layer_weight_bytes(cfg, tdtype), EVICT_MAX_BYTES) if device == "cpu" else 0
    # As in a step, a layer's KV was last read a whole cycle of layers ago: with eviction, the calls take turns
    # over `copies` caches (the model's layers, at most KV_COPIES), so the KV comes from memory, not a cache.
    copies = min(cfg.num_hidden_layers, KV_COPIES) if evict_bytes > 0 else 1
    evict = None
    if evict_bytes > 0:
        flush = torch.ones(evict_bytes // 4, dtype=torch.float32, device=device)
        evict = flush.sum  # a read, not a write: dirty lines would add a write-back the engine does not pay
    cases = [("decode", b, 1, c) for b, c in DECODE_GRID] + [("prefill", b, n, c) for b, n, c in PREFILL_GRID]
    fwd: list[list[float]] = [[] for _ in cases]
    prep: list[list[float]] = [[] for _ in cases]
    with torch.inference_mode():
        # Several passes, each in its own order: one sweep takes seconds, and a machine whose speed moves
        # from one second to the next would hand the whole table one moment's speed.
        order = np.random.default_rng(1)
        for p in range(max(1, passes)):
            for i in (range(len(cases)) if p == 0 else order.permutation(len(cases))):
                _, batch_size, new, cached = cases[i]
                need = -(-(cached + new) // block_size)
                pool = need * batch_size
                perm = np.random.default_rng(0).permutation(pool)
                seqs = [SeqSlice(np.zeros(new, np.int64), cached, perm[j * need:(j + 1) * need], req_id=j)
                        for j in range(batch_size)]
                batch = build_batch(seqs, block_size, pool)
                caches = backend.allocate_kv_cache(copies, pool, block_size, hkv, d, tdtype, device)
                for cache in caches:
                    cache.normal_()
                n = batch.num_tokens
                q, k, v = (torch.randn(n, h, d, device=device, dtype=tdtype) for h in (hq, hkv, hkv))
                meta = backend.prepare(batch, device)
                turn = itertools.cycle(caches)  # each call the next layer's cache, as a step's layers take turns
                fwd[i] += _timer(lambda: backend.forward(q, k, v, next(turn), meta, d ** -0.5), repeats, sync, clock,
                                 before=evict)
                prep[i] += _timer(lambda: backend.prepare(batch, device), repeats, sync, clock)
    rows = []
    for (kind, batch_size, new, cached), f, pr in zip(cases, fwd, prep):
        rows.append({"kind": kind, "batch_size": batch_size, "new_tokens": new, "cached_tokens": cached,
                     **{f"time_stats.attention.{k}": v for k, v in _stats(f).items()},
                     "time_stats.attention_prepare.median": statistics.median(pr),
                     "n_head": hq, "n_kv_head": hkv, "head_dim": d, "block_size": block_size,
                     "dtype_bytes": torch.empty(0, dtype=tdtype).element_size(),
                     "backend": backend_name,
                     # Its long-prompt path's threshold, if it has one: the calibration fits each path's own rate.
                     "long_query_min": int(getattr(backend, "long_query_min", 0))})
    return rows


ENGINE_BATCHES = ((1, 32, 24), (4, 64, 24), (16, 128, 16), (32, 200, 8), (8, 400, 4), (2, 900, 24))  # requests, prompt, output
# The engine profile_engine runs unless told the simulated engine's: its token budget and seats set how prompts
# are chunked and how many decodes share a step, so the overhead is fitted on the steps that engine makes.
ENGINE_SETTINGS = {"max_num_seqs": 64, "max_num_batched_tokens": 512, "max_model_len": 2048}


def engine_settings(given: dict[str, int] | None = None) -> dict[str, int]:
    """ENGINE_SETTINGS with `given` over them; a name LLM does not size by, or a value below 1, is refused."""
    out = dict(ENGINE_SETTINGS)
    for key, value in (given or {}).items():
        if key not in (*ENGINE_SETTINGS, "num_blocks"):
            raise ValueError(f"engine setting {key!r}: profile_engine sizes the engine by "
                             f"{', '.join((*ENGINE_SETTINGS, 'num_blocks'))}")
        if value is None:
            continue
        if int(value) < 1:
            raise ValueError(f"engine setting {key}={value}: must be >= 1")
        out[key] = int(value)
    return out


def profile_engine(folder: Path, backend: str, repeats: int, device: str = "cpu", dtype: str = "float32",
                   linear_kernel: str = "auto", temperature: float = 0.0,
                   between: Callable[[], None] | None = None, passes: int | None = None,
                   groups_out: list[int] | None = None, settings: dict[str, int] | None = None,
                   on_step: Callable[[int], Callable[[Any], None]] | None = None) -> list[Any]:
    """The real engine's step log over a few synthetic batches (sim.cost.fitted.profile_rows), each
    batch run once untimed first: a GEMM's first call at a new row count creates its oneDNN
    primitive, a one-off the operator tables (timed after warm calls) and a long run do not pay.
    temperature: the sampling the fitted overhead includes, as the simulated engine samples (0: greedy,
    one argmax over the batch; above 0 each request draws from its own softmax, a per-request cost).
    between: called after each timed batch, outside every step.
    on_step: given a pass number, an Engine.run on_step callback for that pass's timed steps (called after
    each step, outside it: e.g. a machine-speed sample taken among the steps, as inside a served run). On the
    CPU its own CPU time is taken off the engine's clock: profile_rows charges each step the gap to the next,
    and a sample's few ms there had made every 4th step ~9 ms slow (the measured model's decode steps 3-5% slow).
    passes: timed passes over ENGINE_BATCHES (default max(1, repeats // 3)), each in its own order: the
    machine's speed moves from one call to the next, and a batch size timed in one call only carries that
    call's speed into the fit. groups_out: gets each returned row's pass number (fit_engine_overhead's groups).
    settings: the simulated engine's max_num_seqs, max_num_batched_tokens, max_model_len, num_blocks over
    ENGINE_SETTINGS (engine_settings): the budget sets the prompt chunks' sizes and the seats the decode batches."""
    import numpy as np

    from sim.cost.fitted import profile_rows
    from varlen import LLM, SamplingParams

    sizes = engine_settings(settings)
    llm = LLM(str(folder), backend=backend, device=device, dtype=dtype, linear_kernel=linear_kernel, **sizes)
    if device == "cpu":
        # CPU time: on a shared machine other processes stretch wall-clock steps at random.
        llm.engine.clock = _CpuClock()
    rng = np.random.default_rng(0)
    vocab = llm.runner.config.vocab_size

    def run(b: int, prompt: int, out: int, after_step: Callable[[Any], None] | None = None) -> list[Any]:
        prompt = max(1, min(prompt, sizes["max_model_len"] - out))  # a shorter engine's longest request
        # Random prompts: repeated ones would be prefix-cache hits, and the prefills not computed.
        prompts = rng.integers(3, vocab, (b, prompt)).tolist()
        params = SamplingParams(max_tokens=out, ignore_eos=True, temperature=temperature)
        if after_step is not None:  # the engine's own replay loop: the only one that calls back between steps
            reqs = [r for g in llm._request_groups(prompts, params) for r in g]
            llm.engine.run(reqs, on_step=_off_clock(after_step, llm.engine.clock))
            return profile_rows(list(llm.engine.steps))
        before = llm.engine.steps
        first = len(before)
        llm.generate(prompts, params, use_tqdm=False)
        # The engine loop starts a new log when it leaves idle (each call here): slicing that one
        # by the old log's length dropped most of every batch's steps.
        steps = llm.engine.steps
        return profile_rows(list(steps) if steps is not before else list(steps)[first:])

    run(2, 40, 4)
    for batch in ENGINE_BATCHES:
        run(*batch)
    rows: list[Any] = []
    order = np.random.default_rng(1)
    for p in range(passes if passes is not None else max(1, repeats // 3)):
        for i in (range(len(ENGINE_BATCHES)) if p == 0 else order.permutation(len(ENGINE_BATCHES))):
            got = run(*ENGINE_BATCHES[i], after_step=on_step(p) if on_step is not None else None)
            rows += got
            if groups_out is not None:
                groups_out += [p] * len(got)
            if between is not None:  # e.g. a machine-speed reading spread over the pass, outside its steps
                between()
    return rows


class _CpuClock:
    def __init__(self) -> None:
        self._t0, self._idle = time.process_time(), 0.0

    def now(self) -> float:
        return time.process_time() - self._t0 + self._idle

    def sleep_until(self, t: float) -> None:
        self._idle += max(0.0, t - self.now())

    def exclude(self, seconds: float) -> None:
        """Take `seconds` of CPU time spent outside the engine's work off the clock."""
        self._idle -= seconds


def _off_clock(callback: Callable[[Any], None], clock: Any) -> Callable[[Any], None]:
    """`callback` with its own CPU time taken off `clock` where the clock can (_CpuClock); on another clock
    (wall time, a GPU) the callback's time stays in the gap to the next step."""
    if not isinstance(clock, _CpuClock):
        return callback

    def after(finished: Any) -> None:
        t = time.process_time()
        callback(finished)
        clock.exclude(time.process_time() - t)
    return after


def fit_engine_overhead(rows: list[Any], config: dict[str, Any], gpu: str, out: Path,
                        scaled: bool = True, temperature: float = 0.0,
                        groups: list[int] | None = None) -> dict[str, Any]:
    """Per-step engine cost (const + per request + per prefill) the measured operators leave unexplained.
    scaled: fitted with the operators' sum as one more feature (its coefficient multiplies every table:
    ops_scale in steps with a prompt chunk, decode_ops_scale in decode-only steps): the tables and the
    engine runs are timed a minute apart, and a machine that ran one faster than the other otherwise
    leaves the difference in the constant, different on every profile.
    The decode scale is pinned to the chunk steps' where the decode-only steps cannot tell it from the
    per-step and per-request terms (`decode_scale_pinned`, `decode_scale_note`): their operators grow
    about linearly with the requests, as those terms do, and the three then trade off from one build to
    the next (a constant of 0-15 ms, a decode scale of 0.8-1.4 on the same machine).
    groups: each row's engine pass (profile_engine's groups_out); with two or more, `spread_pct` is how
    far fits on alternate halves of the passes predict the steps apart, and pass_speed_min/max the
    slowest and fastest pass's steps over the fit's, relative to the median pass's (the machine's drift)."""
    import numpy as np

    from sim.cost.measured import MeasuredCostModel

    if not rows:
        raise ValueError("fit_engine_overhead: no engine steps to fit")
    ops = MeasuredCostModel(config, gpu, profiles=out, overhead_s=0.0, engine_overhead=False)
    X = np.array([[1.0, len(r[0]), sum(1 for n in r[0] if n > 1)] for r in rows])
    op = np.array([ops.step_time(r[0], r[1], r[3]) for r in rows])
    real = np.array([r[2] for r in rows])
    g = np.asarray(groups if groups is not None else [0] * len(rows))
    if len(g) != len(rows):
        raise ValueError(f"fit_engine_overhead: {len(g)} groups for {len(rows)} rows")
    decode = X[:, 2] == 0
    pinned, note = _decode_scale_unidentified(X[decode], op[decode], real[decode]) if scaled else (False, "")
    fit = _overhead_fit(X, op, real, scaled, pinned)

    def predict(f: dict[str, Any]) -> Any:
        return np.where(decode, f["decode_ops_scale"], f["ops_scale"]) * op + X @ f["coef"]

    pred = predict(fit)
    res: dict[str, Any] = {
        "const_ms": fit["coef"][0] * 1e3, "per_seq_ms": fit["coef"][1] * 1e3, "per_prefill_ms": fit["coef"][2] * 1e3,
        "ops_scale": fit["ops_scale"], "decode_ops_scale": fit["decode_ops_scale"], "steps": len(rows),
        "step_mape_pct": float(np.mean(np.abs(pred / real - 1)) * 100), "temperature": temperature,
        "decode_scale_pinned": int(pinned), "spread_pct": float("nan"), "pass_speed_min": 1.0, "pass_speed_max": 1.0}
    if pinned:
        res["decode_scale_note"] = note
    passes = sorted(set(g.tolist()))
    if len(passes) >= 2:
        speed = np.array([np.median(real[g == p] / pred[g == p]) for p in passes])
        res["pass_speed_min"], res["pass_speed_max"] = float(speed.min() / np.median(speed)), float(
            speed.max() / np.median(speed))
        # Alternate passes in each half, so drift over the build falls in both.
        half = np.isin(g, passes[::2])
        p1, p2 = (predict(_overhead_fit(X[m], op[m], real[m], scaled, pinned)) for m in (half, ~half))
        # Per step kind (decode-only by batch size, steps with a prompt chunk), the halves' median gap.
        kinds = np.where(decode, X[:, 1], -1.0)
        res["spread_pct"] = float(max(np.median(np.abs(p1[kinds == k] / p2[kinds == k] - 1))
                                      for k in np.unique(kinds)) * 100)
    return res


def _overhead_fit(X: Any, op: Any, real: Any, scaled: bool, pinned: bool) -> dict[str, Any]:
    """The overhead form's non-negative least absolute deviations in relative error (L1_ROUNDS): each step
    alike, as in absolute terms the few long prompt steps set the constant and their few percent of noise lands
    on every short decode step. pinned: the chunk steps' operator scale for the decode-only steps too."""
    import numpy as np

    from sim.cost.fitted import _nnls

    w = 1.0 / np.maximum(real, 1e-12)
    decode = X[:, 2] == 0
    kinds = [m for m in (~decode, decode) if m.any()]

    def solve(A: Any, b: Any) -> Any:
        A, b = A * w[:, None], b * w
        norms = np.linalg.norm(A, axis=0)
        norms[norms == 0] = 1.0
        A = A / norms
        x = _nnls(A, b)
        for _ in range(L1_ROUNDS):  # each step weighed by 1/|its residual|: least absolute deviations
            u = 1.0 / np.sqrt(np.maximum(np.abs(A @ x - b), 1e-3))
            x = _nnls(A * u[:, None], b * u)
        return x / norms

    # A scale for steps with a prompt chunk and one for decode-only steps: the tables time each operator
    # alone, and a compute-bound chunk step and a weight-streaming decode step depart from that differently.
    if scaled:
        c = solve(np.column_stack([op * m for m in kinds] + [X]), real)
        scales, coef = [float(x) for x in c[:len(kinds)]], c[len(kinds):]
        if pinned and len(kinds) == 2 and scales[0] > 0:
            # The chunk steps' scale (their operators dominate them) for every step, the rest refitted.
            scales, coef = [scales[0]] * 2, solve(X, real - scales[0] * op)
        if min(scales) <= 0:  # the operators explain nothing in a kind: one scale for all, as timed if none
            c = solve(np.column_stack([op, X]), real)
            scales, coef = [float(c[0])] * len(kinds), c[1:]
            if scales[0] <= 0:
                scales, coef = [1.0] * len(kinds), solve(X, np.maximum(real - op, 0.0))
    else:
        scales, coef = [1.0] * len(kinds), solve(X, np.maximum(real - op, 0.0))
    chunk_scale = scales[0] if (~decode).any() else scales[-1]
    decode_scale = scales[-1] if decode.any() else scales[0]
    return {"coef": coef, "ops_scale": chunk_scale, "decode_ops_scale": decode_scale}


# Reweighting rounds that turn the overhead fit's least squares into least absolute (relative) deviations: a
# machine's slow and fast seconds make a step's time skewed, and least squares left the engine's own decode
# steps 3-12% under their median by size; the median step is what the simulated steps should be.
L1_ROUNDS = 30


# A decode scale whose standard error is above this is not kept apart from the per-step and per-request terms.
DECODE_SCALE_MAX_SE = 0.02


def _decode_scale_unidentified(X: Any, op: Any, real: Any) -> tuple[bool, str]:
    """Whether decode-only steps can tell the operators' scale from const + per request: regressing the
    operators' time on [1, requests] over these steps, what is left (the attention's growth with the
    cached tokens, the tables' bends) must carry the scale to DECODE_SCALE_MAX_SE against the steps' noise."""
    import numpy as np

    if len(real) < 4:
        return True, f"{len(real)} decode-only steps"
    w = 1.0 / np.maximum(real, 1e-12)
    A = np.column_stack([op, X[:, 0], X[:, 1]]) * w[:, None]
    b = real * w
    norms = np.linalg.norm(A, axis=0)
    A = A / norms
    if np.linalg.matrix_rank(A, tol=1e-6) < 3:
        return True, "the decode-only steps' operator time is a straight line in their requests (degenerate design)"
    c, *_ = np.linalg.lstsq(A, b, rcond=None)
    r = A @ c - b
    sigma = 1.4826 * float(np.median(np.abs(r - np.median(r))))
    se = sigma * float(np.sqrt(np.linalg.inv(A.T @ A)[0, 0])) / norms[0]  # in units of the scale
    if se > DECODE_SCALE_MAX_SE:
        return True, f"decode scale standard error {se:.3f} > {DECODE_SCALE_MAX_SE} (collinear with const + per request)"
    return False, ""


# Halves of the engine passes predicting steps further apart than this: the fit is called unsteady.
SPREAD_WARN_PCT = 5.0


def overhead_confidence(fit: dict[str, Any]) -> str:
    """One line on how far to trust an engine overhead fit: its halves' spread and a pinned decode scale."""
    import math

    spread = fit.get("spread_pct", float("nan"))
    if math.isnan(spread):
        line = "fit spread: unknown (one engine pass; --engine-passes 2 or more to measure it)"
    elif spread > SPREAD_WARN_PCT:
        line = (f"WARNING: unsteady fit: halves of the engine passes predict steps {spread:.1f}% apart (over "
                f"{SPREAD_WARN_PCT:g}%); rerun on a quieter machine or with more --engine-passes")
    else:
        line = f"fit spread: halves of the engine passes predict steps within {spread:.1f}%"
    lo, hi = fit.get("pass_speed_min", 1.0), fit.get("pass_speed_max", 1.0)
    if hi > lo:
        line += f"; the passes' steps ran {lo:.2f}-{hi:.2f}x the median pass's (the machine's drift)"
    if fit.get("decode_scale_pinned"):
        line += f"; decode-only steps' operator scale pinned to the chunk steps' ({fit.get('decode_scale_note', '')})"
    return line


def _stats(ms: list[float]) -> dict[str, float]:
    return {"min": min(ms), "max": max(ms), "mean": statistics.fmean(ms), "median": statistics.median(ms),
            "std": statistics.pstdev(ms)}


def write_table(rows: list[dict[str, Any]], out: Path, gpu: str, name: str, table: str = "mlp") -> Path:
    import csv

    path = out / "compute" / gpu / "local" / name / f"{table}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.profile", description=" ".join(__doc__.split("\n\n")[0].split()))  # the whole first paragraph
    ap.add_argument("--model", default="tiny", help="tiny, big, or an HF model folder")
    ap.add_argument("--out", default="profiles", help="profile folder (cost.profiles=)")
    ap.add_argument("--gpu", default=None, help="the device's name in the tables (a hardware name, e.g. cpu_2core)")
    ap.add_argument("--device", default="cpu", help="torch device to time on: cpu, cuda, cuda:1")
    ap.add_argument("--dtype", default="float32", help="weights' and activations' dtype: float32, bfloat16, float16")
    ap.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="comma-separated token counts")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per operator and size (their min, max, mean, median, std are written)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    ap.add_argument("--linear-kernel", default="auto", choices=("auto", "onednn", "torch"),
                    help="the linear layers' kernel, as the engine you simulate runs them (LLM's linear_kernel)")
    ap.add_argument("--backend", default="auto",
                    help="attention backend to profile and run the engine on (default auto: what backend=auto, the "
                         "engine's default, picks for this model here; '' to skip attention)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of the engine runs the overhead is fitted on, as the engine you "
                         "simulate samples (0: greedy; above 0 adds each request's own softmax draw)")
    ap.add_argument("--engine-passes", type=int, default=3,
                    help="timed passes over the engine's synthetic batches, each in its own order (more: a "
                         "steadier overhead fit; its printed spread says how steady)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=ENGINE_SETTINGS["max_num_batched_tokens"],
                    help="the token budget of the engine you simulate: the engine runs the overhead is fitted on "
                         "chunk prompts to it (as engine.max_num_batched_tokens)")
    ap.add_argument("--max-num-seqs", type=int, default=ENGINE_SETTINGS["max_num_seqs"],
                    help="the seats of the engine you simulate (as engine.max_num_seqs): the most decodes in a step")
    ap.add_argument("--max-model-len", type=int, default=ENGINE_SETTINGS["max_model_len"],
                    help="the longest request of the engine you simulate (longer synthetic prompts are cut to it)")
    ap.add_argument("--no-engine", dest="engine", action="store_false",
                    help="skip the engine's per-step overhead (a few real engine runs)")
    ap.add_argument("--collectives", type=int, default=None,
                    help="profile all-reduce over up to N workers and send/recv (default: every GPU when there "
                         "are several, else none; on CPU N gloo processes)")
    ap.add_argument("--node", default=None, help="the node's name in the collective tables (default: --gpu's)")
    ap.add_argument("--sizes", default=None, help="collective message sizes in bytes, comma-separated")
    ap.add_argument("--only-collectives", action="store_true", help="skip the model's operators")
    a = ap.parse_args(argv)
    try:
        tokens = tuple(sorted({int(x) for x in a.tokens.split(",")}))
        if not a.temperature >= 0:
            raise ValueError(f"--temperature {a.temperature}: must be >= 0 (0 = greedy)")
        settings = engine_settings({"max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens,
                                    "max_model_len": a.max_model_len})
        if a.engine_passes < 1:
            raise ValueError(f"--engine-passes {a.engine_passes}: must be >= 1 (--no-engine skips the engine runs)")
        if not tokens or tokens[0] < 1 or a.repeats < 1:
            raise ValueError(f"--tokens {a.tokens!r} --repeats {a.repeats}: token counts and repeats must be >= 1")
        gpu = a.gpu or ("cpu_2core" if a.device == "cpu" else None)
        if gpu is None:
            raise ValueError("--gpu: name the device as the tables should (e.g. h200_sxm, the hardware config's name)")
        sizes = tuple(int(x) for x in a.sizes.split(",")) if a.sizes else None
        if sizes is not None and (not sizes or min(sizes) < 1):
            raise ValueError(f"--sizes {a.sizes!r}: message sizes must be >= 1 byte")
        if a.collectives is not None and a.collectives == 1:
            raise ValueError("--collectives 1: a collective needs 2 or more workers (0 skips them)")
        folder = None if a.only_collectives else model_folder(a.model)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch

    if a.device == "cpu":
        torch.set_num_threads(a.threads)
    workers = a.collectives
    if workers is None:
        workers = torch.cuda.device_count() if a.device.startswith("cuda") else 0
    if workers >= 2:
        from sim.profile_network import profile_collectives

        t0 = time.perf_counter()
        for kind, path in profile_collectives(Path(a.out), a.node or gpu, workers, a.device, sizes, a.repeats,
                                              a.dtype).items():
            print(f"{kind} over up to {workers} workers -> {path}")
        print(f"collectives profiled in {time.perf_counter() - t0:.1f} s")
    else:
        print("collectives: one device, not profiled (--collectives N with N >= 2 to force on CPU)")
    if folder is None:
        return 0
    rows = profile_model(folder, tokens, a.repeats, a.device, a.dtype, a.linear_kernel)
    name = {"tiny": "tiny", "big": "bench-qwen3-50m"}.get(a.model, folder.name)
    path = write_table(rows, Path(a.out), gpu, name)
    print(f"{len(rows)} token counts x {len(OPS)} operators -> {path}")
    if a.backend:
        try:
            backend, line = resolve_backend(a.backend, folder, a.device, a.dtype)
        except ValueError as err:  # auto finds no backend for this model here
            print(f"error: --backend {a.backend}: {err}", file=sys.stderr)
            return 2
        print(line)
        att = profile_attention(folder, backend, a.repeats, a.device, a.dtype)
        print(f"{len(att)} attention cases ({backend}) -> {write_table(att, Path(a.out), gpu, name, 'attention')}")
        if a.engine:
            import json

            groups: list[int] = []
            steps = profile_engine(folder, backend, a.repeats, a.device, a.dtype, a.linear_kernel, a.temperature,
                                   passes=a.engine_passes, groups_out=groups, settings=settings)
            fit = fit_engine_overhead(steps, json.loads((folder / "config.json").read_text()), gpu, Path(a.out),
                                      temperature=a.temperature, groups=groups)
            fit.update(settings)  # which engine the overhead was fitted at, kept beside it
            path = write_table([fit], Path(a.out), gpu, name, "overhead")
            print(f"engine overhead from {fit['steps']} real steps: operators x{fit['ops_scale']:.3g} "
                  f"(decode-only steps x{fit['decode_ops_scale']:.3g}) + "
                  f"{fit['const_ms']:.3g} ms + {fit['per_seq_ms']:.3g} ms per request + {fit['per_prefill_ms']:.3g} ms "
                  f"per prefill (step MAPE {fit['step_mape_pct']:.1f}%) -> {path}")
            print(overhead_confidence(fit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
