"""The Python API, shaped like vLLM's: `LLM(...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import inspect
import itertools
import warnings
from typing import Any, AsyncIterator, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from varlen import registry
from varlen.assembly import allocator_factory, build_engine, is_choice
from varlen.attention_api import AttentionBackend
from varlen.engine import _error_message
from varlen.engine_loop import EngineLoop, RequestStream, arrival_problem, wait_async
from varlen.executor import ModelExecutor
from varlen.kv.base import KVAllocator
from varlen.model_runner import ModelRunner, load_model
from varlen.outputs import Completion, CompletionOutput, RequestOutput, token_text_cache
from varlen.request import Request
from varlen.sampler import Sampler
from varlen.sampling_params import SamplingParams
from varlen.scheduler_api import SchedulerPolicy
from varlen.settings import DEFAULT_MAX_NUM_SEQS, EngineSettings, check_engine_settings, size_kv_pool


__all__ = ["LLM", "RequestOutput", "CompletionOutput", "CompletionStream"]


class CompletionStream:
    """A submitted prompt's n completions: `.result()` waits for the RequestOutput, iterating (or
    `async for`) yields one each time a completion has new tokens (the last one final), `.abort()`
    ends them. Each completion is its own engine request (`streams`)."""

    def __init__(self, request_id: str, prompt: str | None, streams: list[RequestStream[CompletionOutput]]):
        self.request_id, self.prompt, self.streams = request_id, prompt, streams

    @property
    def request(self) -> Request:
        return self.streams[0].request

    @property
    def error(self) -> BaseException | None:
        """The error of a failed step that ended one of its completions, if any."""
        return next((s.error for s in self.streams if s.error is not None), None)

    def done(self) -> bool:
        return all(s.done() for s in self.streams)

    def abort(self, message: str = "aborted by the caller") -> None:
        for s in self.streams:
            s.abort(message)

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The final output; raises TimeoutError if a completion has not ended within `timeout` s."""
        loop = self.streams[0]._loop
        if not loop.wait(self.streams, timeout=timeout):
            raise TimeoutError(f"request {self.request_id!r} has not ended within {timeout} s")
        return self._output([s.result() for s in self.streams])

    def _output(self, outs: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, list(self.request.prompt_token_ids), outs)

    def _snapshot(self) -> RequestOutput:
        outs = []
        for s in self.streams:
            tokens, done = s.state()
            outs.append(s._to_output(s.request, tokens, done))
        return self._output(outs)

    def __iter__(self) -> Iterator[RequestOutput]:
        cond = self.streams[0]._loop.cond
        seen: list[tuple[int, bool]] = []
        while True:
            with cond:
                while [(s._tokens, s._done) for s in self.streams] == seen:
                    cond.wait()
                seen = [(s._tokens, s._done) for s in self.streams]
            out = self._snapshot()
            yield out
            if all(done for _, done in seen):
                return

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """As iterating, for an asyncio task: waits without holding a thread (a server's streams)."""
        async for _ in wait_async(self.streams):
            yield self._snapshot()


def resolve_model(model: str) -> str:
    if model in ("tiny", "tiny-qwen3", "tiny-llama"):
        from varlen.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model("llama" if model == "tiny-llama" else "qwen3"))
    return model


def eos_token_ids(hf: Any) -> list[int]:
    """Every id that ends a generation, from the model's config and generation config (Llama 3 has two)."""
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
        backend: str | Mapping[str, Any] | AttentionBackend = "auto",
        scheduler: str | Mapping[str, Any] | SchedulerPolicy = "chunked",
        allocator: str | Mapping[str, Any] | Callable[..., KVAllocator] = "paged",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | str | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        seed: int = 0,
        linear_kernel: str = "auto",
        verbose: bool = False,
        setting_names: Mapping[str, str] | None = None,
        **allocator_options,
    ):
        """`backend`, `scheduler`, `allocator`: a name (conf/<group>/), a dotted class path, a config
        mapping with `_target_`, or a ready object; extra keywords are allocator options. Every setting is
        checked before the model loads."""
        s = self.settings = check_engine_settings(
            names=setting_names, block_size=block_size, num_blocks=num_blocks, kv_cache_memory=kv_cache_memory,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            dtype=dtype, device=device, seed=seed, linear_kernel=linear_kernel)
        self.device, self.dtype = s.device, s.dtype
        policy = _policy_choice(scheduler, s)
        alloc_spec = _allocator_spec(allocator, allocator_options)
        if is_choice(backend):
            backend = registry.build("backend", backend)
        if not isinstance(backend, AttentionBackend):
            raise ValueError(f"backend={backend!r}: give a backend name ({', '.join(registry.names('backend'))}), "
                             f"a class's dotted path or an AttentionBackend instance")
        self.backend = backend
        self.backend.check(self.device, self.dtype, s.block_size)
        self.model_path = resolve_model(model)
        hf = load_model(self.model_path, self.dtype, self.device)
        cfg = hf.config
        per_block = ModelRunner.kv_bytes_per_block(cfg, s.block_size, self.dtype)
        seats = policy.max_num_seqs if not is_choice(policy) else s.max_num_seqs or _policy_default(
            policy, "max_num_seqs", s.max_model_len or getattr(cfg, "max_position_embeddings", None))
        sizes = size_kv_pool(s, cfg, per_block, seats)
        self.sizing = (f"KV cache: {sizes.num_blocks} blocks x {s.block_size} tokens = "
                       f"{sizes.num_blocks * s.block_size} token slots, {sizes.num_blocks * per_block / 2**20:.1f} MiB "
                       f"({per_block} bytes per block: {cfg.num_hidden_layers} layers x 2 x {cfg.num_key_value_heads} "
                       f"KV heads x head_dim, {str(self.dtype).removeprefix('torch.')})")
        if verbose:
            print(self.sizing)
        if alloc_spec is not None:
            allocator = allocator_factory(alloc_spec, **allocator_options)

        def executor(policy: SchedulerPolicy, longest: int) -> ModelExecutor:
            self.runner = ModelRunner(hf, self.backend, s.block_size, sizes.num_blocks, self.dtype, self.device,
                                      linear_kernel=s.linear_kernel)
            return ModelExecutor(self.runner, policy.max_num_seqs, longest, Sampler(s.seed))

        self.engine = build_engine(sizes, policy, allocator, executor, eos_token_id=eos_token_ids(hf),  # type: ignore[arg-type]
                                   vocab_size=hf.get_input_embeddings().num_embeddings)
        self.executor: ModelExecutor = self.engine.executor  # type: ignore[assignment]
        self._tokenizer = None
        self._token_text: Callable[[int], str] | None = None
        self._ids = itertools.count()
        self.loop = EngineLoop(self.engine)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        return self._tokenizer

    def make_requests(self, prompts: Sequence[str | Sequence[int]] | str | Sequence[int],
                      sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                      arrivals: Sequence[float] | None = None) -> list[Request]:
        """`sampling_params.n` Requests per prompt (text, tokenized, or token ids as given; anything else
        raises ValueError), in prompt order."""
        return [r for group in self._request_groups(prompts, sampling_params, arrivals) for r in group]

    def _request_groups(self, prompts: Sequence[str | Sequence[int]] | str | Sequence[int],
                        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                        arrivals: Sequence[float] | None = None) -> list[list[Request]]:
        """Per prompt its n Requests: ids "7" for n = 1, else "7-0", "7-1", ... (seeded: seed + i)."""
        if _is_one_prompt(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if arrivals is not None and len(arrivals) != len(prompts):
            raise ValueError(f"{len(arrivals)} arrival times for {len(prompts)} prompts")
        for i, a in enumerate(arrivals or ()):
            problem = arrival_problem(float(a))
            if problem:
                raise ValueError(f"arrivals[{i}]: {problem}")
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling_params[{i}] is a {type(sp).__name__}, not a SamplingParams")
            if isinstance(p, (bytes, bytearray, Mapping)) or not isinstance(p, (str, Sequence, np.ndarray)) \
                    or (isinstance(p, np.ndarray) and p.ndim != 1):
                raise ValueError(f"prompt {i} is a {type(p).__name__}: give text (str) or a flat list of token ids")
        groups = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if isinstance(p, str):
                ids = self.tokenizer(p, add_special_tokens=False).input_ids
            else:  # as given: int() would turn 5.7 into 5
                ids = p if isinstance(p, np.ndarray) else list(p)
            rid = str(next(self._ids))
            arrival = arrivals[i] if arrivals is not None else 0.0
            text = p if isinstance(p, str) else None
            if sp.n == 1 or sp.problem():  # a bad one reaches the engine, which rejects it with the reason
                groups.append([Request(rid, ids, sp, arrival=arrival, prompt=text)])
            else:
                groups.append([Request(f"{rid}-{k}", ids, _one_of(sp, k), arrival=arrival, prompt=text)
                               for k in range(sp.n)])
        return groups

    def generate(self, prompts: Sequence[str | Sequence[int]] | str | Sequence[int],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); one RequestOutput per prompt, in input order,
        holding its `n` completions. Thread-safe: calls from several threads are batched together on
        one engine loop. A bad request ends `rejected` (a warning when all of them are); on an error or
        Ctrl-C the call's requests end `aborted`. `use_tqdm`: a progress bar when stderr is a terminal."""
        groups = self._request_groups(prompts, sampling_params)
        reqs = [r for g in groups for r in g]
        streams = self._serve(reqs, None if use_tqdm else False, [k for g in groups for k in range(len(g))])
        rejected = [r for r in reqs if r.finish_reason is not None and r.finish_reason.value == "rejected"]
        if reqs and len(rejected) == len(reqs):
            warnings.warn(f"all {len(reqs)} requests of this generate call were rejected; the first: "
                          f"{rejected[0].finish_message}", stacklevel=2)
        outputs, i = [], 0
        for g in groups:
            part = streams[i:i + len(g)]
            i += len(g)
            outputs.append(CompletionStream(_parent_id(g), g[0].prompt, part).result())
        return outputs

    def submit(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None,
               arrival: float = 0.0) -> CompletionStream:
        """Queue one prompt (its n completions) on the engine loop and return at once: `.result()` waits
        for its output, iterating (or `async for`) yields outputs as tokens come, `.abort()` ends it.
        `arrival`: seconds from now."""
        [group] = self._request_groups([prompt], sampling_params, None if not arrival else [arrival])
        return CompletionStream(_parent_id(group), group[0].prompt, self._submit(group, range(len(group))))

    def abort(self, request_id: str, message: str = "aborted by the caller") -> None:
        """End a submitted request (with n > 1: each of its completions) `aborted` after the current
        step, freeing its KV; a no-op if it has ended."""
        self.loop.abort(request_id, message)
        with self.loop.cond:
            children = [k for k in self.loop._live if k.startswith(f"{request_id}-")]
        for k in children:
            self.loop.abort(k, message)

    def _submit(self, reqs: Sequence[Request], index: Sequence[int] | None = None
                ) -> list[RequestStream[CompletionOutput]]:
        """Queue `reqs`, each with its Completion (text, stop strings, logprobs); `index`: each one's
        place among its prompt's completions (0 if not given)."""
        if self._token_text is None:
            self._token_text = token_text_cache(self._decode)
        states = [Completion(r, index[i] if index is not None else 0, self._decode, self._token_text)
                  for i, r in enumerate(reqs)]
        return self.loop.submit(reqs, [c.output for c in states],
                                [c.check_stop if r.sampling.stop else None for c, r in zip(states, reqs)])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def run(self, reqs: Sequence[Request], use_tqdm: bool = False) -> list[RequestStream[CompletionOutput]]:
        """Serve `reqs` to the end on the engine loop, each at its `arrival` (seconds from now); on an
        error or Ctrl-C the rest end `aborted` and the error propagates. Returns their streams
        (`.result()`: each one's CompletionOutput). `use_tqdm`: a progress bar."""
        return self._serve(reqs, use_tqdm)

    def _serve(self, reqs: Sequence[Request], bar_on: bool | None, index: Sequence[int] | None = None
               ) -> list[RequestStream[CompletionOutput]]:
        """run(); `bar_on` None: a progress bar only when stderr is a terminal."""
        bar = None
        if bar_on is not False:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), unit="req", desc="requests", disable=None if bar_on is None else False)
            bar = None if bar.disable else bar
        streams = self._submit(reqs, index)
        try:
            try:
                self.loop.wait(streams, on_done=bar.update if bar is not None else None)
            except BaseException as err:
                ended = [s.done() for s in streams]
                self._stop(streams, err)
                if bar is not None:  # count what ended on its own, the interrupted step's too: no update ran for it
                    bar.n = sum(was or (s.request.finish_reason is not None and s.request.finish_reason.value != "aborted")
                                for was, s in zip(ended, streams))
                raise
            failed = next((s.error for s in streams if s.error is not None), None)
            if failed is not None:
                self._stop(streams, failed)
                raise failed
        finally:
            if bar is not None:
                bar.close()  # where it stands: after Ctrl-C it says how many ended
        return streams

    def _stop(self, streams: list[RequestStream[CompletionOutput]], err: BaseException) -> None:
        """End every unfinished request of a call `aborted` (the loop does it after its step), note it on `err`."""
        for s in streams:
            if not s.done():
                s.abort(_error_message("the run stopped", err))
        while True:
            try:
                self.loop.wait(streams)
                break
            except KeyboardInterrupt:  # a second Ctrl-C: the requests must still end before returning
                continue
        aborted = sum(s.request.finish_reason is not None and s.request.finish_reason.value == "aborted"
                      for s in streams)
        err.add_note(f"varlen: {aborted} of this call's {len(streams)} requests ended aborted; "
                     f"the LLM is ready for the next call")



def _parent_id(group: list[Request]) -> str:
    """The prompt's id: its one request's, or its completions' ("7-0", "7-1") without the index."""
    rid = group[0].req_id
    return rid if len(group) == 1 else rid.rsplit("-", 1)[0]


def _one_of(sp: SamplingParams, k: int) -> SamplingParams:
    """Completion k's settings: n = 1 and, when seeded, seed + k (distinct, reproducible draws)."""
    return SamplingParams(max_tokens=sp.max_tokens, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p,
                          seed=None if sp.seed is None else (sp.seed + k) % 2**64,
                          stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos, n=1, stop=sp.stop,
                          logprobs=sp.logprobs)


def _is_one_prompt(prompts: object) -> bool:
    """A str, or a flat sequence of ids, is one prompt."""
    if isinstance(prompts, str):
        return True
    if isinstance(prompts, np.ndarray):
        return prompts.ndim == 1
    if not isinstance(prompts, Sequence) or not prompts:
        return False
    first = prompts[0]
    return not isinstance(first, (str, Sequence, np.ndarray))


def _subclass(cls: Any, base: type) -> bool:
    """issubclass by the MRO: compiled ABCs share one subclass cache, mixing up answers."""
    return isinstance(cls, type) and base in cls.__mro__


def _policy_choice(scheduler: Any, s: EngineSettings) -> SchedulerPolicy | DictConfig:
    """A policy object as it is (refusing sizes it would ignore), or a choice's config."""
    if _subclass(type(scheduler), SchedulerPolicy):
        for key in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(s, key) is not None:
                raise s.error(key, getattr(s, key), f"the policy object given as scheduler has its own "
                                                    f"({getattr(scheduler, key)}); set it on the policy")
        return scheduler
    if not is_choice(scheduler):
        raise ValueError(f"scheduler={scheduler!r}: give a policy name ({', '.join(registry.names('scheduler'))}), "
                         f"a class's dotted path or a SchedulerPolicy instance")
    spec = registry.spec("scheduler", scheduler)
    _check_class("scheduler", scheduler, registry.target("scheduler", spec), SchedulerPolicy)
    return spec


def _allocator_spec(allocator: Any, options: Mapping[str, Any]) -> DictConfig | None:
    """A choice's config, its options checked against the class; None for a factory given as it is."""
    if not is_choice(allocator):
        if options:
            raise ValueError(f"{', '.join(options)}: allocator options go with an allocator name; "
                             f"the allocator given ({allocator!r}) is built as it is")
        return None
    spec = registry.spec("allocator", allocator)
    cls = registry.target("allocator", spec)
    _check_class("allocator", allocator, cls, KVAllocator)
    params = inspect.signature(cls).parameters
    known = set(params) - {"num_blocks", "block_size", "max_model_len"}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        known |= {*options, *map(str, spec)}  # it takes any keyword: let it judge
    label = allocator if isinstance(allocator, str) else spec._target_
    for key in options:
        if key not in known:
            raise ValueError(f"{key}={options[key]!r}: not a setting of LLM nor an option of the "
                             f"{label} allocator ({', '.join(sorted(known)) or 'none'})")
    for key in spec:
        if not str(key).startswith("_") and key not in known:
            raise ValueError(f"allocator.{key}: not an option of the {label} allocator "
                             f"({', '.join(sorted(known)) or 'none'})")
    return spec


def _check_class(group: str, choice: object, cls: Any, base: type) -> None:
    if not _subclass(cls, base):
        shown = choice if isinstance(choice, str) else dict(choice).get("_target_")  # type: ignore[call-overload]
        raise ValueError(f"{group} {shown!r} names {cls!r}, not a {base.__name__} subclass; give a {group} "
                         f"class ({', '.join(registry.names(group))} are shipped)")


def _policy_default(policy_spec: DictConfig, key: str, max_model_len: int | None) -> int:
    """The `key` a policy built from `policy_spec` gets: its yaml's, else its class's default."""
    if key in policy_spec:
        root = OmegaConf.create({"engine": {"max_model_len": max_model_len}, "__plugin__": policy_spec})
        value = OmegaConf.select(root, f"__plugin__.{key}")
        return value if isinstance(value, int) and not isinstance(value, bool) else DEFAULT_MAX_NUM_SEQS
    param = inspect.signature(registry.target("scheduler", policy_spec)).parameters.get(key)
    if param is not None and isinstance(param.default, int):
        return param.default
    return DEFAULT_MAX_NUM_SEQS
