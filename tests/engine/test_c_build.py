"""The C build helper (varlen/c_build.py): the shared headers are on every build's include path and
in every library's cache key, so a changed header rebuilds each kernel that may include it."""

from __future__ import annotations

import ctypes
import re
import shutil

import torch

import backends.torch_paged as tp
from varlen import c_build
from varlen import layer_kernels as lk

KERNELS = {"paged-attn": (tp.SOURCE, (torch.__version__,)), "layer-kernels": (lk.SOURCE, ())}


def test_both_kernels_include_the_one_shared_header_and_define_no_exp_of_their_own():
    """The exp approximation has one home: vec_exp.h, found in INCLUDE_DIR (both sources include
    it; neither defines exp_neg/vexp_neg or the vector types itself)."""
    assert [h.name for h in c_build.headers()] == ["vec_exp.h"]
    for source, _ in KERNELS.values():
        text = source.read_text()
        assert '#include "vec_exp.h"' in text, source
        assert not re.search(r"\b(v?exp_neg)\s*\([^)]*\)\s*\{|typedef\s+\w+\s+v[fi]\b", text), source


def test_a_changed_header_gives_each_kernel_a_new_library(tmp_path, monkeypatch):
    monkeypatch.setenv("VARLEN_CACHE_DIR", str(tmp_path / "cache"))
    include = tmp_path / "include"
    shutil.copytree(c_build.INCLUDE_DIR, include, ignore=shutil.ignore_patterns("*.c"))
    monkeypatch.setattr(c_build, "INCLUDE_DIR", include)
    before = {p: c_build.library_path(src, p, key) for p, (src, key) in KERNELS.items()}
    assert before == {p: c_build.library_path(src, p, key) for p, (src, key) in KERNELS.items()}  # stable
    header = include / "vec_exp.h"
    header.write_text(header.read_text().replace("p = p * r + 0.5f;", "p = p * r + 0.5000001f;"))
    after = {p: c_build.library_path(src, p, key) for p, (src, key) in KERNELS.items()}
    assert all(after[p] != before[p] and after[p].parent.name.startswith(p) for p in KERNELS)


def test_a_build_reads_the_header_from_the_include_dir_and_rebuilds_when_it_changes(tmp_path, monkeypatch):
    """End to end on a small source: the header is found through INCLUDE_DIR, and after it changes the
    next build compiles a fresh library holding the new value (the old one stays where it was)."""
    monkeypatch.setenv("VARLEN_CACHE_DIR", str(tmp_path / "cache"))
    include, source = tmp_path / "include", tmp_path / "answer.c"
    include.mkdir()
    monkeypatch.setattr(c_build, "INCLUDE_DIR", include)
    source.write_text('#include "answer.h"\nint answer(void) { return ANSWER; }\n')
    libs = []
    for value in (1, 2):
        (include / "answer.h").write_text(f"#define ANSWER {value}\n")
        libs.append(c_build.build_cached(source, "answer"))
        assert ctypes.CDLL(str(libs[-1])).answer() == value
    assert libs[0] != libs[1] and libs[0].is_file()
