#!/usr/bin/env bash
# Installs varlen and its test tools into the project's Python (scripts/py: the active venv, else
# .venv/ where the system Python is externally managed, else python3), and builds the compiled
# scheduling core.
# torch comes first and pinned: on these CPU machines `torch==2.13.0` is a CPU build on local
# disk, while an unpinned torch (asked for by any dependency) would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
# Which Python: scripts/py decides (the run and test commands use it too). Where python3 refuses
# installs (an externally managed system Python, PEP 668, or one without pip) and no virtual
# environment is active, the project gets its own venv, .venv/, reused by later runs.
can_install='import importlib.util, os, sys, sysconfig
managed = sys.prefix == sys.base_prefix and os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))
sys.exit(1 if managed or importlib.util.find_spec("pip") is None else 0)'
if [ -z "${PYTHON:-}" ] && [ -z "${VIRTUAL_ENV:-}" ] && [ ! -x .venv/bin/python ] && ! python3 -c "$can_install"; then
  echo "setup: $(command -v python3) does not take installs (externally managed, PEP 668); creating the project venv .venv"
  if ! python3 -m venv .venv; then
    rm -rf .venv
    echo "error: python3 -m venv failed; install the venv module (Debian/Ubuntu: apt install python3-venv) and rerun" >&2
    exit 2
  fi
fi
PY=$(scripts/py -c 'import sys; print(sys.executable)')
echo "setup: installing into $PY"
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
# triton: the tests run the triton backend's kernels in Triton's CPU interpreter (Linux wheels).
# cluster: Hydra's submitit and Ray launchers, whose sweeps tests/cli/test_launchers.py runs.
# serve: the OpenAI-compatible server (FastAPI, uvicorn), python -m varlen.serve.
"$PY" -m pip install -q -e ".[test,fast,triton,cluster,serve]"
# The simulator's scheduling core compiled with mypyc (~2x faster, same decisions; see
# varlen/compiled.py). Optional: without it the pure-Python core runs.
if ! "$PY" -m varlen.compile; then
  echo "WARNING: the compiled core did not build; the pure-Python core will run (slower, same results)" >&2
fi
# torch_paged's attention kernel (plain C + OpenMP, ~2 s); otherwise it is built at first use.
if ! "$PY" -m backends.torch_paged; then
  echo "WARNING: torch_paged's kernel did not build; that backend will run torch_sdpa's code (slower, same results)" >&2
fi
# The fused per-layer kernels (RMSNorm, residual add + RMSNorm, SiLU·mul; plain C + OpenMP, ~1 s);
# otherwise built at first use, or their torch ops run (said at load).
if ! "$PY" -m varlen.layer_kernels; then
  echo "WARNING: the layer kernels did not build; their torch ops will run (slower, same results)" >&2
fi
