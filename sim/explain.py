"""`python -m sim.explain`: one step's predicted time, part by part.

    python -m sim.explain sim_model=llama2_70b hardware=a100_80gb_sxm parallel.tensor=4 \
        cost.model=measured step.new=[512,1,1] step.cached=[0,100,2000]

Prints a table and writes explain.json: seconds per part for the whole step as one GPU of the TP
group sees it; a part the cost model cannot separate is null (counted in the one it sits in). The
overhead is also shown by term (`overhead_terms`: per step, per request, per prefill request).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import hydra
from omegaconf import DictConfig, OmegaConf

from sim.cost.base import PARTS, formula_holds
from sim.run import CONF


def breakdown(model: Any, new: Sequence[int], cached: Sequence[int], num_logits: int | None = None) -> dict[str, Any]:
    """One step's time by part under `model`, and total_s: the formula's own terms."""
    from sim.cost.base import StepSums

    if len(new) != len(cached):
        raise ValueError(f"step.new has {len(new)} requests but step.cached has {len(cached)}; give one of each per request")
    if not new or any(n < 1 for n in new) or any(c < 0 for c in cached):
        raise ValueError(f"step.new={list(new)} step.cached={list(cached)}: each request needs >= 1 new and >= 0 cached tokens")
    s = StepSums.of(new, cached, num_logits)
    parts: dict[str, Any] = dict.fromkeys(PARTS)
    if formula_holds(type(model)):  # replay's recorded durations split nothing
        parts.update(model.parts(s))
    total = model.step_time(new, cached, num_logits)
    split = [v for v in parts.values() if v is not None]
    if split:
        # The parts are the formula's terms summed in another order: equal up to float rounding.
        assert abs(sum(split) - total) <= 1e-9 * max(total, 1e-12), (parts, total)
    parts["total_s"] = total
    return parts


def overhead_terms(model: Any, new: Sequence[int], num_logits: int | None = None) -> dict[str, Any] | None:
    """The overhead part by term (base, per request, per prefill request, and profiled's offset for
    this exact step size), for models with that form."""
    form = getattr(model, "overhead_form", None)
    if form is None:
        return None
    base, per_seq, per_prefill = (float(x) for x in form)
    seqs, prefills = len(new), sum(1 for n in new if n > 1)
    terms: dict[str, Any] = {"per_step_s": base, "per_request_s": per_seq, "requests": seqs,
                             "requests_s": per_seq * seqs, "per_prefill_s": per_prefill, "prefills": prefills,
                             "prefills_s": per_prefill * prefills}
    if hasattr(model, "size_offset"):  # profiled: decode_batch_K / chunk_sampled_K
        logits = seqs if num_logits is None else int(num_logits)
        terms["size_offset"] = model.size_offset_name(seqs, logits, prefills)
        terms["size_offset_s"] = model.size_offset(seqs, logits, prefills)
    return terms


def explain_config(c: Mapping[str, Any]) -> dict[str, Any]:
    """explain.json's content for a resolved config (conf/sim/explain.yaml)."""
    from sim.cost.hardware import HardwareSpec, load_model_config
    from sim.parallel import Parallelism, capacity
    from sim.run import build_cost_model

    model_config = load_model_config(c["sim_model"]["config"])
    hardware = HardwareSpec.from_dict(c["hardware"])
    par = Parallelism.of(c.get("parallel"))
    cap = capacity(model_config, hardware, par, c["engine"]["gpu_memory_utilization"], name=c["sim_model"]["name"])
    model = build_cost_model(c["cost"], model_config, hardware, c.get("parallel"))
    step = c["step"]
    parts = breakdown(model, list(step["new"]), list(step["cached"]), step.get("num_logits"))
    notes = list(getattr(model, "notes", []))
    return {**parts, "model": c["sim_model"]["name"], "hardware": hardware.name, "cost_model": c["cost"]["model"],
            "tensor": par.tensor, "pipeline": par.pipeline, "step_new": list(step["new"]),
            "step_cached": list(step["cached"]), "num_logits": step.get("num_logits"),
            "kv_tokens_per_replica": cap.kv_tokens, "weight_gb_per_gpu": cap.weight_bytes_per_gpu / 1e9,
            "overhead_terms": overhead_terms(model, list(step["new"]), step.get("num_logits")), "notes": notes}


def format_table(d: Mapping[str, Any]) -> str:
    total = d["total_s"]
    lines = [f"{d['model']} on {d['hardware']} (tensor={d['tensor']}, pipeline={d['pipeline']}), cost.model="
             f"{d['cost_model']}: step of {len(d['step_new'])} requests, {sum(d['step_new'])} new tokens",
             f"{'part':<16}{'ms':>10}{'share':>8}"]
    for k in (*PARTS, "total_s"):
        v = d[k]
        ms = "null" if v is None else f"{v * 1e3:.4f}"
        share = "" if v is None or not total else f"{v / total:.1%}"
        lines.append(f"{k:<16}{ms:>10}{share:>8}")
        terms = d.get("overhead_terms")
        if k == "overhead_s" and terms:
            lines += [f"{'  per step':<16}{terms['per_step_s'] * 1e3:>10.4f}",
                      f"{'  x ' + str(terms['requests']) + ' requests':<16}{terms['requests_s'] * 1e3:>10.4f}"
                      f"  ({terms['per_request_s'] * 1e3:.4g} ms each)",
                      f"{'  x ' + str(terms['prefills']) + ' prefills':<16}{terms['prefills_s'] * 1e3:>10.4f}"
                      f"  ({terms['per_prefill_s'] * 1e3:.4g} ms each)"]
            if terms.get("size_offset"):
                lines.append(f"{'  ' + terms['size_offset']:<16}{terms['size_offset_s'] * 1e3:>10.4f}  (this exact size)")
    lines += [f"  {n}" for n in d["notes"]]
    lines.append(f"KV pool per replica: {d['kv_tokens_per_replica']} tokens; weights per GPU {d['weight_gb_per_gpu']:.1f} GB")
    return "\n".join(lines)


@hydra.main(config_path=CONF, config_name="explain", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from varlen.cli import check_missing, errors_to_exit, fail

    try:
        check_missing(cfg)
        c = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(c, dict)
        d = explain_config(c)
    except errors_to_exit() as err:
        fail(str(err))
    out = Path(HydraConfig.get().runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "explain.json").write_text(json.dumps(d, indent=2) + "\n")
    print(format_table(d))
    print(f"written to {out / 'explain.json'}")


if __name__ == "__main__":
    from varlen.cli import run_cli

    run_cli(main)
