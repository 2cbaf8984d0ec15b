#!/usr/bin/env bash
# Installs varlen and its test tools into the current Python environment, and builds the
# compiled scheduling core.
# torch comes first and pinned: on these CPU machines `torch==2.13.0` is a CPU build on local
# disk, while an unpinned torch (asked for by any dependency) would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
# triton: the tests run the triton backend's kernels in Triton's CPU interpreter (Linux wheels).
"$PY" -m pip install -q -e ".[test,fast,triton]"
# The simulator's scheduling core compiled with mypyc (~2x faster, same decisions; see
# varlen/compiled.py). Optional: without it the pure-Python core runs.
if ! "$PY" -m varlen.compile; then
  echo "WARNING: the compiled core did not build; the pure-Python core will run (slower, same results)" >&2
fi
# torch_paged's attention kernel (plain C + OpenMP, ~2 s); otherwise it is built at first use.
if ! "$PY" -m backends.torch_paged; then
  echo "WARNING: torch_paged's kernel did not build; that backend will run torch_sdpa's code (slower, same results)" >&2
fi
