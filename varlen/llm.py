"""The Python API, shaped like vLLM's: `LLM(...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

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

ALLOCATORS: dict[str, type[KVAllocator]] = {"paged": PagedAllocator, "contiguous": ContiguousAllocator}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


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


def parse_memory(value: int | str) -> int:
    """Bytes from an int or a string such as '512MiB', '2GB', '1.5GiB'."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?)B?\s*", str(value), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read a memory size from {value!r}; write e.g. 512MiB or 2GB")
    base = 1024 if m.group(3) or not m.group(2) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))


def resolve_model(model: str) -> str:
    if model in ("tiny", "tiny-qwen3", "tiny-llama"):
        from varlen.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model("llama" if model == "tiny-llama" else "qwen3"))
    return model


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
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        seed: int = 0,
        batch_invariant: bool = False,
        verbose: bool = False,
        **allocator_options,
    ):
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.backend = make_backend(backend) if isinstance(backend, str) else backend
        # Fail on an impossible setting before the model is loaded.
        self.backend.check(self.device, self.dtype, block_size)
        path = resolve_model(model)
        hf = load_model(path, self.dtype, self.device)
        cfg = hf.config
        per_block = ModelRunner.kv_bytes_per_block(cfg, block_size, self.dtype)
        max_model_len = max_model_len or getattr(cfg, "max_position_embeddings", 4096)
        if num_blocks is None:
            if kv_cache_memory is not None:
                num_blocks = parse_memory(kv_cache_memory) // per_block
            else:  # every seat at full length (never preempts), within 1 GiB
                num_blocks = min(max_num_seqs * -(-max_model_len // block_size), 2**30 // per_block)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={kv_cache_memory} holds no KV block of {per_block} bytes")
        self.sizing = (f"KV cache: {num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} "
                       f"token slots, {num_blocks * per_block / 2**20:.1f} MiB ({per_block} bytes per block: "
                       f"{cfg.num_hidden_layers} layers x 2 x {cfg.num_key_value_heads} KV heads x head_dim, "
                       f"{str(self.dtype).removeprefix('torch.')})")
        if verbose:
            print(self.sizing)
        max_model_len = min(max_model_len, num_blocks * block_size)
        if isinstance(scheduler, str):
            if scheduler not in POLICIES:
                raise ValueError(f"unknown scheduler {scheduler!r}; choose one of {sorted(POLICIES)}")
            policy_cls = POLICIES[scheduler]
            budget_tokens = max_num_batched_tokens or (
                512 if policy_cls.chunked_prefill or scheduler == "priority" else max_model_len)
            scheduler = policy_cls(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget_tokens)
        if isinstance(allocator, str):
            if allocator not in ALLOCATORS:
                raise ValueError(f"unknown allocator {allocator!r}; choose one of {sorted(ALLOCATORS)}")
            allocator = partial(ALLOCATORS[allocator], **allocator_options)
        kv = allocator(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len)
        self.runner = ModelRunner(hf, self.backend, block_size, num_blocks, self.dtype, self.device,
                                  batch_invariant=batch_invariant)
        self.executor = ModelExecutor(self.runner, scheduler.max_num_seqs, max_model_len, Sampler(seed))
        eos = getattr(cfg, "eos_token_id", None)
        self.engine = Engine(scheduler, kv, self.executor, max_model_len=max_model_len,
                             eos_token_id=eos[0] if isinstance(eos, list) else eos)
        self.model_path = path
        self._tokenizer = None
        self._next_id = 0

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        return self._tokenizer

    def make_requests(self, prompts: Sequence[str | Sequence[int]],
                      sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                      arrivals: Sequence[float] | None = None) -> list[Request]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, not a list of them
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            ids = self.tokenizer(p, add_special_tokens=False).input_ids if isinstance(p, str) else list(p)
            reqs.append(Request(str(self._next_id), [int(t) for t in ids], sp,
                                arrival=arrivals[i] if arrivals is not None else 0.0,
                                prompt=p if isinstance(p, str) else None))
            self._next_id += 1
        return reqs

    def generate(self, prompts: Sequence[str | Sequence[int]] | str,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in input order."""
        reqs = self.make_requests(prompts, sampling_params)
        self.run(reqs, use_tqdm)
        return [self.output(r) for r in reqs]

    def run(self, reqs: Sequence[Request], use_tqdm: bool = False) -> None:
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), unit="req", desc="requests")
        self.engine.run(reqs, on_step=(lambda done: bar.update(len(done))) if bar else None)
        if bar is not None:
            bar.update(bar.total - bar.n)  # rejected ones end before any step
            bar.close()

    def output(self, r: Request) -> RequestOutput:
        return RequestOutput(
            request_id=r.req_id, prompt=r.prompt, prompt_token_ids=r.prompt_token_ids,
            token_ids=list(r.output_token_ids),
            text=self.tokenizer.decode(r.output_token_ids, skip_special_tokens=True),
            finish_reason=r.finish_reason.value, finish_message=r.finish_message, metrics=RequestMetrics.of(r))
