"""What a simulated run assumed and how its trace was changed, in the lines sim.run, sim.capacity
(both modes), sim.search and the cells print before their figures (model, hardware, parallelism,
policy, allocator, cost model, SLOs, trace; lossy trace options; the cost model's parts not from
measurements), and the prefix hit rate they report."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from varlen.registry import conf_dir


def lossy_line(stats: Any) -> str | None:
    """One line saying what the trace options changed, or None when nothing was."""
    parts = []
    if stats.num_clipped:
        parts.append(f"{stats.num_clipped} clipped to max_model_len ({stats.num_prompt_clipped} of them in the prompt)")
    if stats.num_dropped:
        parts.append(f"{stats.num_dropped} dropped as longer than max_model_len")
    if stats.num_reordered:
        parts.append(f"{stats.num_reordered} out of arrival order (sorted)")
    if stats.num_zero_output:
        parts.append(f"{stats.num_zero_output} with output length 0 raised to 1")
    if not parts:
        return None
    return f"workload ({stats.num_returned} requests kept of {stats.num_read} read): " + ", ".join(parts)


LOSSY_KEYS = ("num_read", "num_returned", "num_clipped", "num_prompt_clipped", "num_dropped", "num_reordered", "num_zero_output")


def _choice(labels: Mapping[str, Any] | None, c: Mapping[str, Any], group: str) -> Any:
    """The option a run used for `group`: its Hydra choice, else its class."""
    return (labels or {}).get(group) or c[group].get("_target_")


def slo_text(c: Mapping[str, Any]) -> str:
    """The SLOs in force, saying which are conf/sim/sim.yaml's defaults (not set by the user)."""
    defaults = _slo_defaults()
    names = {"ttft_s": "TTFT", "tpot_s": "TPOT", "tbt_s": "TBT"}
    given = {k: c["slo"].get(k) for k in names if c["slo"].get(k) is not None}
    text = ", ".join(f"{names[k]} <= {v:g} s" for k, v in given.items())
    default = [k for k, v in given.items() if defaults.get(k) == v]
    if default and len(default) == len(given):
        return f"SLO {text} (defaults; set slo.ttft_s, slo.tpot_s)"
    if default:
        return f"SLO {text} ({', '.join(names[k] for k in default)} the default)"
    return f"SLO {text}"


def _slo_defaults() -> dict[str, Any]:
    """conf/sim/sim.yaml's `slo` section, read with OmegaConf's yaml loader (its values, as
    OmegaConf.load gives them) without making the whole file a config object."""
    import yaml
    from omegaconf._utils import get_yaml_loader

    with open(Path(conf_dir("sim")) / "sim.yaml", encoding="utf-8") as f:
        return dict(yaml.load(f, Loader=get_yaml_loader())["slo"])


def assumptions(c: Mapping[str, Any], labels: Mapping[str, Any] | None, caching: bool | None = None) -> str:
    """What a run assumed besides its trace: model, hardware, parallelism, policy, allocator, cost model, SLOs."""
    par = c.get("parallel") or {}
    cl = c["cluster"]
    where = f"{c['sim_model']['name']} on {c['hardware']['name']} TP{par.get('tensor', 1)} PP{par.get('pipeline', 1)}"
    if cl.get("mode") == "disaggregated":
        pools = "; ".join(f"{pool} " + ", ".join(f"{k}={v}" for k, v in cl[pool].items() if v is not None)
                          for pool in ("prefill", "decode") if any(v is not None for v in cl[pool].values()))
        where = (f"{cl['prefill_replicas']} prefill + {cl['decode_replicas']} decode instance(s) of {where}"
                 + (f" ({pools})" if pools else "") + f", link {cl['link']}")
    else:
        where = f"{cl['replicas']} replica(s) of {where}"
    alloc = str(_choice(labels, c, "allocator"))
    if caching is not None and "enable_prefix_caching" in c["allocator"]:
        alloc += f" (prefix caching {'on' if caching else 'off'})"
    return (f"{where}, scheduler {_choice(labels, c, 'scheduler')}, allocator {alloc}, "
            f"cost {c['cost']['model']}; {slo_text(c)}")


def trace_text(c: Mapping[str, Any]) -> str:
    wl = c["workload"]
    limit = wl.get("limit")
    return f"{wl.get('source')} ({'all requests' if limit is None else f'limit {limit}'})"


def headline(c: Mapping[str, Any], labels: Mapping[str, Any] | None, num_requests: int, caching: bool,
             cost_model: Any = None) -> str:
    """sim.run's first lines: what is simulated and everything the figures depend on."""
    return (f"simulating {num_requests} requests of {trace_text(c)} (Ctrl-C stops)\n"
            f"  {assumed(c, labels, unmeasured_notes(cost_model), caching)}")


def assumed(c: Mapping[str, Any], labels: Mapping[str, Any] | None, cost_notes: Sequence[str],
            caching: bool | None = None) -> str:
    """'on <assumptions>', and a second line naming the cost model's parts that are not from
    measurements (`cost_notes`: its unmeasured_notes) when it has any: what every entry point that
    reports figures prints before them."""
    line = not_measured_line(c, cost_notes)
    return f"on {assumptions(c, labels, caching)}" + (f"\n{line}" if line else "")


def assumed_fields(c: Mapping[str, Any], labels: Mapping[str, Any] | None, cost_notes: Sequence[str]) -> dict[str, Any]:
    """What capacity.json, slo_scale.json and search.json record of what their figures assumed: the
    headline's words and the cost model's parts not from measurements (`cost_notes`)."""
    return {"trace": trace_text(c), "assumptions": assumptions(c, labels), "cost_model": c["cost"]["model"],
            "cost_notes": list(cost_notes)}


def unmeasured_notes(cost_model: Any) -> list[str]:
    """The parts of a table-driven cost model's figures that are predictions or estimates, not
    measurements (its `notes`): a headline should not let them pass for measured."""
    notes = getattr(cost_model, "notes", None) or []
    return [n for n in notes if any(w in n for w in ("predicted", "estimated", "estimates"))]


def not_measured_line(c: Mapping[str, Any], notes: Sequence[str]) -> str | None:
    """'  cost NAME, not from measurements: ...' naming a cost model's parts that are predicted or
    estimated (`notes`: its unmeasured_notes), or None when there are none."""
    return f"  cost {c['cost']['model']}, not from measurements: {'; '.join(notes)}" if notes else None


def over_length_warning(stats: Any, c: Mapping[str, Any], limit: int | None) -> str | None:
    """A warning line when more than 10% of the requests looked at were clipped or dropped as longer
    than `limit` (the trace's max_model_len); stats: a TraceStats or the like."""
    configured = c["workload"].get("max_model_len")
    # Below the configured limit, it was what the KV pool holds (over_length=clip).
    raise_it = ("engine.num_blocks (the KV pool holds no more)" if limit != configured else
                "engine.max_model_len" if configured == c["engine"]["max_model_len"] else "workload.max_model_len")
    source = c["workload"].get("source")
    if stats.num_returned and stats.num_clipped / stats.num_returned > 0.1:
        return (f"warning: {stats.num_clipped / stats.num_returned:.0%} of {source}'s requests clipped to "
                f"max_model_len={limit}; raise {raise_it} or set workload.over_length=drop")
    looked = stats.num_dropped + stats.num_returned
    if looked and stats.num_dropped / looked > 0.1:
        return (f"warning: {stats.num_dropped / looked:.0%} of {source}'s requests dropped as longer than "
                f"max_model_len={limit}; raise {raise_it} or set workload.over_length=clip")
    return None


def prefix_hit_rate(requests: Any) -> float:
    """Prompt tokens served from the prefix cache over all prompt tokens (Requests or RequestResults)."""
    from varlen.metrics import RequestResults

    if isinstance(requests, RequestResults):
        prompt, hit = int(requests.prompt_tokens.sum()), int(requests.prefix_hit_tokens.sum())
    else:
        prompt = sum(r.num_prompt_tokens for r in requests)
        hit = sum(r.num_prefix_hit_tokens for r in requests)
    return hit / prompt if prompt else 0.0
