"""Do the C kernels of this tree compute bitwise what they computed at another git revision?

For a change to the C sources that must not change a number (moving code into a shared header,
renaming, comments): builds torch_paged's attention kernel and the fused layer kernels from REV's
sources and from this tree, then compares (1) their machine code (objdump of .text and the constants
in .rodata: identical code gives identical bits on every input) and (2) their outputs on
random inputs covering each specialisation (head sizes 64, 128 and another; windows, soft-caps,
sinks; bf16; rows with and without a tail). Exit 0 when everything is identical, 1 otherwise.

    python benchmarks/c_kernels_same_bits.py [--rev main]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import backends.torch_paged as tp
from varlen import c_build, layer_kernels as lk, registry
from varlen.attention_api import LayerAttention
from varlen.batch import SeqSlice, build_batch

ROOT = Path(__file__).resolve().parents[1]


def git_tree(rev: str, dest: Path) -> Path:
    """REV's varlen/csrc and backends/csrc, written under dest."""
    for folder in ("varlen/csrc", "backends/csrc"):
        names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{folder}"], cwd=ROOT, check=True,
                               capture_output=True, text=True).stdout.split()
        (dest / folder).mkdir(parents=True)
        for name in names:
            blob = subprocess.run(["git", "show", f"{rev}:{folder}/{name}"], cwd=ROOT, check=True,
                                  capture_output=True).stdout
            (dest / folder / name).write_bytes(blob)
    return dest


def machine_code(lib: Path) -> str:
    """The disassembled .text without addresses (a moved function shifts them, not the code), and
    the constants in .rodata (the polynomial's coefficients live there, not in the instructions)."""
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-j", ".text", str(lib)], check=True,
                          capture_output=True, text=True).stdout.split("Disassembly of section .text:", 1)[1]
    rodata = subprocess.run(["objdump", "-s", "-j", ".rodata", str(lib)], check=True, capture_output=True,
                            text=True).stdout.split("Contents of section .rodata:", 1)[1]
    return "\n".join(re.sub(r"^\s*[0-9a-f]+:\s*", "", re.sub(r"[0-9a-f]{6,}", "ADDR", line))
                     for line in text.splitlines()) + rodata


def layer_outputs() -> list[torch.Tensor]:
    lk._lib = None
    lib, why = lk.load_library()
    assert lib is not None, why
    ops, gen, outs = lk.COps(lib), torch.Generator().manual_seed(0), []
    for rows, width in ((1, 7), (3, 16), (64, 100), (130, 1536), (5, 33)):
        a, b = torch.randn(rows, width, generator=gen) * 4, torch.randn(rows, width, generator=gen)
        w = torch.randn(width, generator=gen)
        outs += [ops.rmsnorm(a, w, 1e-6), *ops.add_rmsnorm(a, b, w, 1e-5), ops.silu_mul(a * 30, b)]
    return outs


def paged_outputs() -> list[torch.Tensor]:
    tp._kernel = None
    assert tp.load_kernel() is not None
    gen, outs = torch.Generator().manual_seed(0), []
    seqs = [SeqSlice([1], 70, [0, 1, 2, 3, 4]), SeqSlice(list(range(40)), 9, [5, 6, 7, 8]),
            SeqSlice([2], 3, [9]), SeqSlice(list(range(100)), 0, list(range(10, 18)))]
    batch = build_batch(seqs, 16, 18)
    n = batch.num_tokens
    for d, hkv, group, dtype in ((64, 2, 2, torch.float32), (128, 1, 3, torch.float32), (80, 2, 2, torch.float32),
                                 (64, 2, 2, torch.bfloat16)):
        hq = hkv * group
        cache = torch.randn(2, 18, 16, hkv, d, generator=gen)
        q, k, v = (torch.randn(n, h, d, generator=gen) for h in (hq, hkv, hkv))
        for spec in (None, LayerAttention(d ** -0.5, sliding_window=21, softcap=3.0, sinks=torch.linspace(-1, 1, hq))):
            backend = registry.build("backend", "torch_paged")
            if spec is not None:
                backend.bind(hq, hkv, d, dtype, 16, "cpu", [spec])
            kw = {} if spec is None else {"layer": spec}
            outs.append(backend.forward(q.to(dtype), k.to(dtype), v.to(dtype), tp.from_nhd(cache.to(dtype)),
                                        backend.prepare(batch, "cpu"), d ** -0.5, **kw))
    return outs


def build_all(root: Path) -> dict[str, tuple[Path, list[torch.Tensor]]]:
    """Both kernels from the sources under root (its varlen/csrc on the include path)."""
    c_build.INCLUDE_DIR = root / "varlen/csrc"
    tp.SOURCE, lk.SOURCE = root / "backends/csrc/paged_attention.c", root / "varlen/csrc/layer_kernels.c"
    return {"paged_attention": (tp.build(), paged_outputs()), "layer_kernels": (lk.build(), layer_outputs())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="main", help="the git revision to compare with (default: main)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["VARLEN_CACHE_DIR"] = str(Path(tmp) / "cache")
        torch.set_num_threads(1)
        before = build_all(git_tree(args.rev, Path(tmp) / "rev"))
        after = build_all(ROOT)
        same = True
        for name, (lib0, outs0) in before.items():
            lib1, outs1 = after[name]
            code = machine_code(lib0) == machine_code(lib1)
            bits = len(outs0) == len(outs1) and all(torch.equal(a, b) for a, b in zip(outs0, outs1))
            print(f"{name}: machine code {'identical' if code else 'DIFFERS'}; "
                  f"{len(outs1)} outputs {'bitwise identical' if bits else 'DIFFER'}")
            same &= bits and code
        shutil.rmtree(Path(tmp) / "cache", ignore_errors=True)
    print(f"same as {args.rev}" if same else f"NOT the same as {args.rev}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
