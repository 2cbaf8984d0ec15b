"""One place builds an engine (allocator, policy, executor) by one rule: `LLM(...)`, the simulator
(sim.run, its disaggregated pools, sim.validate) and the benchmarks call `build_engine`. No torch."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from omegaconf import DictConfig

from varlen import registry
from varlen.engine import Engine
from varlen.kv.base import KVAllocator
from varlen.scheduler_api import SchedulerPolicy
from varlen.settings import EngineSizes

#: (policy, max_model_len) -> the engine's executor: the model's, or a cost model's.
MakeExecutor = Callable[[SchedulerPolicy, int], Any]
MakeAllocator = Callable[..., KVAllocator]


def is_choice(x: object) -> bool:
    """A plug-in named rather than given: a name or dotted path, or a config mapping with _target_."""
    return isinstance(x, (str, Mapping, DictConfig))


def allocator_factory(choice: str | Mapping[str, Any], context: Mapping[str, Any] | None = None,
                      **options: Any) -> MakeAllocator:
    """An allocator choice (varlen/registry.py), `options` over its config, as a factory of pools."""
    return registry.build("allocator", choice, context=context, _partial_=True, **options)


def build_engine(sizes: EngineSizes, policy: SchedulerPolicy | str | Mapping[str, Any], allocator: MakeAllocator,
                 make_executor: MakeExecutor, *, engine_class: type[Engine] = Engine,
                 context: Mapping[str, Any] | None = None, policies: dict[int, Callable[[], Any]] | None = None,
                 **engine_options: Any) -> Engine:
    """The engine `sizes` describes: 1. the pool, `allocator(num_blocks=, block_size=, max_model_len=)`;
    2. max_model_len, the one asked for within what the pool holds; 3. the policy, an object as it
    is or a choice built with `sizes.policy_sizes()`, its `${engine.*}` the pool's and step 2's
    (`context`: the rest its config may read); 4. `make_executor(policy, max_model_len)`, the engine.
    `policies`: a dict the calls building like engines (a fleet's replicas: the same sizes, policy
    and context) share, so the policy's config is resolved once (registry.builder), not per engine."""
    kv = allocator(num_blocks=sizes.num_blocks, block_size=sizes.block_size, max_model_len=sizes.max_model_len)
    longest = min(kv.max_request_tokens(), sizes.max_model_len)
    if is_choice(policy):
        make = None if policies is None else policies.get(longest)
        if make is None:
            root = dict(context or {})
            root["engine"] = {**root.get("engine", {}), "max_model_len": longest, "block_size": sizes.block_size,
                              "num_blocks": sizes.num_blocks}
            make = registry.builder("scheduler", policy, context=root, **sizes.policy_sizes())
            if policies is not None:
                policies[longest] = make
        policy = make()
    executor = make_executor(policy, longest)  # type: ignore[arg-type]
    return engine_class(policy, kv, executor, max_model_len=longest, **engine_options)  # type: ignore[arg-type]
