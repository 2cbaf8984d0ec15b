"""The Python API, shaped like vLLM's: `LLM(...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from backends import AttentionBackend, make_backend
from schedulers import POLICIES, SchedulerPolicy
from varlen.engine import Engine
from varlen.executor import ModelExecutor
from varlen.kv import ContiguousAllocator, KVAllocator, PagedAllocator
from varlen.metrics import RequestMetrics
from varlen.model_runner import ModelRunner, load_model
from varlen.request import Request
from varlen.sampler import Sampler
from varlen.sampling_params import SamplingParams
from varlen.settings import DEFAULT_MAX_NUM_SEQS, check_engine_settings, size_kv_pool

ALLOCATORS: dict[str, type[KVAllocator]] = {"paged": PagedAllocator, "contiguous": ContiguousAllocator}


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    finish_message: str
    metrics: RequestMetrics


def resolve_model(model: str) -> str:
    if model in ("tiny", "tiny-qwen3", "tiny-llama"):
        from varlen.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model("llama" if model == "tiny-llama" else "qwen3"))
    return model


def eos_token_ids(hf: Any) -> list[int]:
    """Every id that ends a generation: the model config's and its generation config's, each one
    id or a list (Llama 3 ends on <|end_of_text|> and <|eot_id|>; stopping on the first alone
    would let a request run past its end)."""
    ids: list[int] = []
    for cfg in (hf.config, getattr(hf, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None)
        for t in (eos if isinstance(eos, (list, tuple)) else [eos]):
            if t is not None and int(t) not in ids:
                ids.append(int(t))
    return ids


class LLM:
    def __init__(
        self,
        model: str = "tiny",
        backend: str | AttentionBackend = "torch_sdpa",
        scheduler: str | SchedulerPolicy = "chunked",
        allocator: str | Callable[..., KVAllocator] = "paged",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | str | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        seed: int = 0,
        verbose: bool = False,
        setting_names: Mapping[str, str] | None = None,
        **allocator_options,
    ):
        """`max_num_seqs` (default 64) and `max_num_batched_tokens` (default 512 for a chunked
        policy, else max_model_len) size a policy named by `scheduler`; a policy object brings
        its own. `setting_names`: how errors name the settings (the CLI passes its dotted names).
        Every setting is checked before the model loads (varlen/settings.py)."""
        s = self.settings = check_engine_settings(
            names=setting_names, block_size=block_size, num_blocks=num_blocks, kv_cache_memory=kv_cache_memory,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            dtype=dtype, device=device, seed=seed)
        self.device, self.dtype = s.device, s.dtype
        if isinstance(scheduler, str):
            if scheduler not in POLICIES:
                raise ValueError(f"unknown scheduler {scheduler!r}; choose one of {sorted(POLICIES)}")
        elif not isinstance(scheduler, SchedulerPolicy):
            raise ValueError(f"scheduler={scheduler!r}: give a policy name ({', '.join(sorted(POLICIES))}) "
                             f"or a SchedulerPolicy instance")
        else:
            for key in ("max_num_seqs", "max_num_batched_tokens"):
                if getattr(s, key) is not None:  # it would be silently ignored
                    raise s.error(key, getattr(s, key), f"the policy object given as scheduler has its own "
                                                        f"({getattr(scheduler, key)}); set it on the policy")
        if isinstance(allocator, str):
            if allocator not in ALLOCATORS:
                raise ValueError(f"unknown allocator {allocator!r}; choose one of {sorted(ALLOCATORS)}")
            known = set(inspect.signature(ALLOCATORS[allocator]).parameters) - {"num_blocks", "block_size",
                                                                                "max_model_len"}
            for key in allocator_options:  # a misspelt LLM setting lands here too
                if key not in known:
                    raise ValueError(f"{key}={allocator_options[key]!r}: not a setting of LLM nor an option of the "
                                     f"{allocator} allocator ({', '.join(sorted(known)) or 'none'})")
        elif allocator_options:
            raise ValueError(f"{', '.join(allocator_options)}: allocator options go with an allocator name; "
                             f"the allocator given ({allocator!r}) is built as it is")
        self.backend = make_backend(backend) if isinstance(backend, str) else backend
        # Fail on an impossible setting before the model is loaded.
        self.backend.check(self.device, self.dtype, s.block_size)
        path = resolve_model(model)
        hf = load_model(path, self.dtype, self.device)
        cfg = hf.config
        block_size = s.block_size
        per_block = ModelRunner.kv_bytes_per_block(cfg, block_size, self.dtype)
        seats = scheduler.max_num_seqs if isinstance(scheduler, SchedulerPolicy) else \
            s.max_num_seqs if s.max_num_seqs is not None else DEFAULT_MAX_NUM_SEQS
        num_blocks, max_model_len = size_kv_pool(s, cfg, per_block, seats)
        self.sizing = (f"KV cache: {num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} "
                       f"token slots, {num_blocks * per_block / 2**20:.1f} MiB ({per_block} bytes per block: "
                       f"{cfg.num_hidden_layers} layers x 2 x {cfg.num_key_value_heads} KV heads x head_dim, "
                       f"{str(self.dtype).removeprefix('torch.')})")
        if verbose:
            print(self.sizing)
        max_model_len = min(max_model_len, num_blocks * block_size)  # what the pool can hold
        if isinstance(scheduler, str):
            policy_cls = POLICIES[scheduler]
            budget = s.max_num_batched_tokens if s.max_num_batched_tokens is not None else \
                512 if policy_cls.chunked_prefill or scheduler == "priority" else max_model_len
            scheduler = policy_cls(max_num_seqs=seats, max_num_batched_tokens=budget)
        if isinstance(allocator, str):
            allocator = partial(ALLOCATORS[allocator], **allocator_options)
        kv = allocator(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len)
        self.runner = ModelRunner(hf, self.backend, block_size, num_blocks, self.dtype, self.device)
        self.executor = ModelExecutor(self.runner, scheduler.max_num_seqs, max_model_len, Sampler(s.seed))
        self.engine = Engine(scheduler, kv, self.executor, max_model_len=max_model_len,
                             eos_token_id=eos_token_ids(hf),
                             vocab_size=hf.get_input_embeddings().num_embeddings)
        self.model_path = path
        self._tokenizer = None
        self._next_id = 0

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        return self._tokenizer

    def make_requests(self, prompts: Sequence[str | Sequence[int]] | str | Sequence[int],
                      sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                      arrivals: Sequence[float] | None = None) -> list[Request]:
        """One Request per prompt: text (tokenized), or a sequence of token ids taken as given;
        the engine rejects a request whose ids are not integers in [0, vocab) or whose sampling
        params are out of range. A prompt of neither kind raises ValueError (nothing has run)."""
        if _is_one_prompt(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if arrivals is not None and len(arrivals) != len(prompts):
            raise ValueError(f"{len(arrivals)} arrival times for {len(prompts)} prompts")
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling_params[{i}] is a {type(sp).__name__}, not a SamplingParams")
            if isinstance(p, (bytes, bytearray, Mapping)) or not isinstance(p, (str, Sequence, np.ndarray)) \
                    or (isinstance(p, np.ndarray) and p.ndim != 1):
                raise ValueError(f"prompt {i} is a {type(p).__name__}: give text (str) or a flat list of token ids")
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if isinstance(p, str):
                ids = self.tokenizer(p, add_special_tokens=False).input_ids
            else:  # as given: an int() here would turn 5.7 into 5 and True into 1
                ids = p if isinstance(p, np.ndarray) else list(p)
            reqs.append(Request(str(self._next_id), ids, sp,
                                arrival=arrivals[i] if arrivals is not None else 0.0,
                                prompt=p if isinstance(p, str) else None))
            self._next_id += 1
        return reqs

    def generate(self, prompts: Sequence[str | Sequence[int]] | str | Sequence[int],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in input order.

        A bad request ends `rejected` with the reason and the others run. If the call stops on an
        error or Ctrl-C, its requests end `aborted` and the error propagates; the next call
        starts on an idle engine (it never finishes the interrupted batch first)."""
        reqs = self.make_requests(prompts, sampling_params)
        self.run(reqs, use_tqdm)
        return [self.output(r) for r in reqs]

    def run(self, reqs: Sequence[Request], use_tqdm: bool = False) -> None:
        """Serve `reqs` to the end (Engine.run: by arrival time, 0 = at once). `engine.steps` then
        holds this call's steps; finished requests are not kept (the caller has them)."""
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), unit="req", desc="requests")
        try:
            self.engine.run(reqs, on_step=(lambda done: bar.update(len(done))) if bar else None)
        except BaseException as err:
            aborted = sum(r.finish_reason is not None and r.finish_reason.value == "aborted" for r in reqs)
            err.add_note(f"varlen: {aborted} of this call's {len(reqs)} requests ended aborted; "
                         f"the LLM is idle and ready for the next call")
            raise
        finally:
            if bar is not None:
                bar.update(bar.total - bar.n)  # rejected ones end before any step
                bar.close()

    def output(self, r: Request) -> RequestOutput:
        return RequestOutput(
            request_id=r.req_id, prompt=r.prompt, prompt_token_ids=list(r.prompt_token_ids),
            token_ids=list(r.output_token_ids),
            text=self.tokenizer.decode(r.output_token_ids, skip_special_tokens=True),
            finish_reason=r.finish_reason.value, finish_message=r.finish_message, metrics=RequestMetrics.of(r))


def _is_one_prompt(prompts: object) -> bool:
    """A str, or a flat sequence of ids (its first item not text nor a sequence), is one prompt."""
    if isinstance(prompts, str):
        return True
    if isinstance(prompts, np.ndarray):
        return prompts.ndim == 1
    if not isinstance(prompts, Sequence) or not prompts:
        return False
    first = prompts[0]
    return not isinstance(first, (str, Sequence, np.ndarray))
