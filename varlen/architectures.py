"""Which decoder-only architectures of the installed transformers varlen runs, on which backends.

Read from `varlen.tiny_model`'s configs the way the model runner reads attention: the optional
attention features each architecture's layers use, and per backend whether it runs the model
(every feature it uses declared by the backend's `features`) or refuses it at load. "default" is
what `backend=auto` picks on CPU in fp32 where every backend's kernels are installed
(varlen/backend_choice.py). A second table lists what each backend declares (on CPU, `triton`
runs in Triton's interpreter only).
tests/engine/test_model_coverage.py proves each row and checks README.md carries these tables:

    python -m varlen.architectures            # print the tables
    python -m varlen.architectures --write    # rewrite them in README.md (between the markers)
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import torch

from varlen.attention_api import BATCH_INVARIANT, FEATURES

BEGIN, END = "<!-- architectures table: python -m varlen.architectures --write -->", "<!-- end of architectures table -->"
BACKENDS_BEGIN = "<!-- backend features table: python -m varlen.architectures --write -->"
BACKENDS_END = "<!-- end of backend features table -->"
BACKEND_CLASSES = {"torch_ref": "backends.torch_ref:TorchRefBackend", "torch_sdpa": "backends.torch_sdpa:TorchSdpaBackend",
                   "torch_paged": "backends.torch_paged:TorchPagedBackend",
                   "triton": "backends.triton_paged:TritonPagedBackend",
                   "flash_attn": "backends.flash_attn:FlashAttnBackend",
                   "flashinfer": "backends.flashinfer:FlashInferBackend"}
#: A column per optional feature (varlen.attention_api.FEATURES), in that order.
FEATURE_TITLES = {"sliding_window": "sliding window", "softcap": "logit soft-cap", "sinks": "sinks"}
FEATURE_COLUMNS = ["query scale", *FEATURE_TITLES.values()]


def backend_classes() -> dict[str, type]:
    out = {}
    for name, target in BACKEND_CLASSES.items():
        module, cls = target.split(":")
        out[name] = getattr(importlib.import_module(module), cls)
    return out


def backend_features() -> dict[str, frozenset[str]]:
    return {name: cls.features for name, cls in backend_classes().items()}


def feature_cells(layers: list, head_dim: int) -> dict[str, str]:
    """Per column, how the layers use it: 'all layers', 'k of n layers' or '-' (unused); the query
    scale column says whether it differs from head_dim ** -0.5."""
    n = len(layers)
    cells = {"query scale": "yes" if any(abs(spec.scale - head_dim ** -0.5) > 1e-12 for spec in layers) else "-"}
    for feature in FEATURES:
        k = sum(feature in spec.features for spec in layers)
        cells[FEATURE_TITLES[feature]] = "-" if k == 0 else "all layers" if k == n else f"{k} of {n} layers"
    return cells


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
        row = {"architecture": arch, "class": type(model).__name__, **feature_cells(layers, attn.head_dim),
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
    head = ["architecture", "HF class", *FEATURE_COLUMNS, "default (CPU fp32)", *backends]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    lines += ["| " + " | ".join([r["architecture"], f"`{r['class']}`", *(r[c] for c in FEATURE_COLUMNS), r["default"],
                                 *(r[b] for b in backends)]) + " |" for r in supported]
    lines += ["", "| refused | HF class | why |", "| --- | --- | --- |"]
    lines += [f"| {r['architecture']} | `{r['class']}` | {r['reason']} |" for r in refused]
    return "\n".join(lines)


def backends_table() -> str:
    """What each shipped backend declares: devices, optional features, batch-invariant mode."""
    head = ["backend", "devices", *FEATURE_TITLES.values(), "batch-invariant mode"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for name, cls in backend_classes().items():
        have = ["yes" if f in cls.features else "-" for f in (*FEATURES, BATCH_INVARIANT)]
        lines.append("| " + " | ".join([f"`{name}`", ", ".join(cls.devices), *have]) + " |")
    return "\n".join(lines)


def _between(readme: str, begin: str, end: str, what: str) -> str:
    if begin not in readme or end not in readme:
        raise ValueError(f"README.md has no {what} markers ({begin} ... {end})")
    return readme.split(begin, 1)[1].split(end, 1)[0].strip()


def readme_table(readme: str) -> str:
    """The architectures table as README.md currently has it (between the markers)."""
    return _between(readme, BEGIN, END, "architectures table")


def readme_backends_table(readme: str) -> str:
    """The backend features table as README.md currently has it (between the markers)."""
    return _between(readme, BACKENDS_BEGIN, BACKENDS_END, "backend features table")


def _replace(text: str, begin: str, end: str, table: str) -> str:
    head, rest = text.split(begin, 1)
    return f"{head}{begin}\n{table}\n{end}{rest.split(end, 1)[1]}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", nargs="?", const="README.md", metavar="README",
                   help="replace both tables in this README (default README.md)")
    a = p.parse_args()
    tables = [(BACKENDS_BEGIN, BACKENDS_END, backends_table(), readme_backends_table),
              (BEGIN, END, markdown_table(), readme_table)]
    if a.write is None:
        print("\n\n".join(table for _, _, table, _ in tables))
        return
    path = Path(a.write)
    text = new = path.read_text()
    for begin, end, table, current in tables:
        current(text)  # the markers are there
        new = _replace(new, begin, end, table)
    path.write_text(new)
    print(f"{path}: backend and architectures tables {'unchanged' if new == text else 'rewritten'}")


if __name__ == "__main__":
    main()
