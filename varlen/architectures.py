"""Which decoder-only architectures of the installed transformers varlen runs, on which backends.

Read from `varlen.tiny_model`'s configs the way the model runner reads attention; "default" is what
`backend=auto` picks on CPU in fp32 where every backend's kernels are installed (varlen/backend_choice.py);
tests/engine/test_model_coverage.py proves each row and checks README.md carries this table:

    python -m varlen.architectures            # print the table
    python -m varlen.architectures --write    # rewrite it in README.md (between the markers)
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import torch

BEGIN, END = "<!-- architectures table: python -m varlen.architectures --write -->", "<!-- end of architectures table -->"
BACKEND_CLASSES = {"torch_ref": "backends.torch_ref:TorchRefBackend", "torch_sdpa": "backends.torch_sdpa:TorchSdpaBackend",
                   "torch_paged": "backends.torch_paged:TorchPagedBackend",
                   "triton": "backends.triton_paged:TritonPagedBackend",
                   "flash_attn": "backends.flash_attn:FlashAttnBackend",
                   "flashinfer": "backends.flashinfer:FlashInferBackend"}


def backend_features() -> dict[str, frozenset[str]]:
    out = {}
    for name, target in BACKEND_CLASSES.items():
        module, cls = target.split(":")
        out[name] = getattr(importlib.import_module(module), cls).features
    return out


def describe_layers(layers: list, head_dim: int) -> str:
    """One cell: the features the layers use, e.g. 'sliding window (1 of 2 layers), logit soft-cap'."""
    n, parts = len(layers), []
    if any(abs(spec.scale - head_dim ** -0.5) > 1e-12 for spec in layers):
        parts.append("query scale")
    windowed = sum(spec.sliding_window is not None for spec in layers)
    if windowed:
        parts.append("sliding window" + ("" if windowed == n else f" ({windowed} of {n} layers)"))
    if any(spec.softcap is not None for spec in layers):
        parts.append("logit soft-cap")
    if any(spec.sinks is not None for spec in layers):
        parts.append("sinks")
    return ", ".join(parts) or "plain causal"


def rows() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(supported rows, refused rows), from the tiny configs."""
    from varlen.model_attention import UnsupportedModel, read_model_attention
    from varlen.model_runner import ATTN_NAME, register_varlen_attention
    from varlen.tiny_model import ARCHITECTURES, REFUSED_ARCHITECTURES, tiny_model

    from varlen.backend_choice import choose, declared

    register_varlen_attention()
    features = backend_features()
    supported, refused = [], []
    for arch in ARCHITECTURES:
        model = tiny_model(arch, attn_implementation=ATTN_NAME)
        attn = read_model_attention(model, "varlen_ctx")
        layers = attn.layers
        used = frozenset().union(*(spec.features for spec in layers))
        row = {"architecture": arch, "class": type(model).__name__, "attention": describe_layers(layers, attn.head_dim),
               "default": choose("cpu", torch.float32, 16, used, declared)[0]}
        for name, have in features.items():
            missing = sorted(used - have)
            row[name] = "yes" if not missing else "refused: " + ", ".join(missing)
        supported.append(row)
    for arch in REFUSED_ARCHITECTURES:
        model = tiny_model(arch, attn_implementation=ATTN_NAME)
        try:
            read_model_attention(model, "varlen_ctx")
            reason = "NOT REFUSED"
        except UnsupportedModel as err:
            reason = str(err).split(": ", 1)[1]
        refused.append({"architecture": arch, "class": type(model).__name__, "reason": reason})
    return supported, refused


def markdown_table() -> str:
    supported, refused = rows()
    backends = list(BACKEND_CLASSES)
    lines = ["| architecture | HF class | attention features | default (CPU fp32) | " + " | ".join(backends) + " |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in backends) + " |"]
    lines += [f"| {r['architecture']} | `{r['class']}` | {r['attention']} | {r['default']} | "
              + " | ".join(r[b] for b in backends) + " |" for r in supported]
    lines += ["", "| refused | HF class | why |", "| --- | --- | --- |"]
    lines += [f"| {r['architecture']} | `{r['class']}` | {r['reason']} |" for r in refused]
    return "\n".join(lines)


def readme_table(readme: str) -> str:
    """The table as README.md currently has it (between the markers)."""
    if BEGIN not in readme or END not in readme:
        raise ValueError(f"README.md has no architectures table markers ({BEGIN} ... {END})")
    return readme.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", nargs="?", const="README.md", metavar="README",
                   help="replace the table in this README (default README.md)")
    a = p.parse_args()
    table = markdown_table()
    if a.write is None:
        print(table)
        return
    path = Path(a.write)
    text = path.read_text()
    old = readme_table(text)
    head, rest = text.split(BEGIN, 1)
    path.write_text(f"{head}{BEGIN}\n{table}\n{END}{rest.split(END, 1)[1]}")
    print(f"{path}: architectures table {'unchanged' if old == table else 'rewritten'}")


if __name__ == "__main__":
    main()
