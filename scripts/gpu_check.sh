#!/usr/bin/env bash
# Everything a session with a lent GPU runs, in one go: install the carried kernel wheels, run the
# GPU tests, run the attention benchmark, print one summary. Logs and the benchmark's JSON go to
# $OUT (the device tool brings that folder back), or /tmp/varlen-gpu-out elsewhere.
#
#   bash scripts/gpu_check.sh stage   # only collect carried wheel parts (see fetch_gpu_wheels.sh)
#   bash scripts/gpu_check.sh         # install, test, benchmark; designed to end within ~9 minutes
#
# Wheel parts arrive in wheels/c1, wheels/c2, ... over several calls; each call copies what it
# finds to /tmp/varlen-wheel-parts, which outlives a call while the machine stays warm. Without
# any parts the script still runs: the backends whose library is missing skip with their reason.
#
# Knobs (environment): BUDGET (seconds the whole script may take, default 540: the device tool
# stops a command at 600), GPU_DTYPES (default "bf16 fp16", in that order), BENCH_ARGS (extra
# benchmark arguments). Each phase gets what is left of BUDGET, minus a reserve for the later
# phases, so a slow first JIT compile cannot starve the summary.
# JIT caches (FlashInfer's nvcc builds) live in /tmp/varlen-jit, so a rerun on the same warm
# machine skips the compiles.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
deadline=$(( $(date +%s) + ${BUDGET:-540} ))
left() {  # seconds left before the deadline, minus a reserve ($1), at least 20
  local s=$(( deadline - $(date +%s) - $1 ))
  [ $s -lt 20 ] && s=20
  echo $s
}
OUT_DIR=${OUT:-/tmp/varlen-gpu-out}
STAGE=/tmp/varlen-wheel-parts
SITE=/tmp/varlen-site
mkdir -p "$OUT_DIR" "$STAGE"
shopt -s nullglob

# --- 1. wheel parts
for d in wheels/c[0-9]*/; do cp -f "$d"* "$STAGE"/; done
parts=("$STAGE"/bundle.tar.part-*)
want=$(sed -n 's/^parts=\([0-9]*\).*/\1/p' "$STAGE/MANIFEST" 2>/dev/null)
sum=$(sed -n 's/.*sha256=\([0-9a-f]*\).*/\1/p' "$STAGE/MANIFEST" 2>/dev/null)
echo "wheel parts collected: ${#parts[@]} of ${want:-0}"
if [ "${1:-}" = stage ]; then exit 0; fi

install_note="no wheels carried"
if [ -n "$want" ] && [ "${#parts[@]}" -eq "$want" ]; then
  if [ -f "$SITE/.installed-$sum" ]; then
    install_note="wheels already installed in $SITE"
  else
    cat "${parts[@]}" > /tmp/varlen-bundle.tar
    if [ "$(sha256sum /tmp/varlen-bundle.tar | cut -d' ' -f1)" != "$sum" ]; then
      install_note="wheel bundle checksum mismatch: not installed"
    else
      rm -rf /tmp/varlen-wheels "$SITE" && mkdir -p /tmp/varlen-wheels
      tar xf /tmp/varlen-bundle.tar -C /tmp/varlen-wheels
      if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target "$SITE" /tmp/varlen-wheels/*.whl > "$OUT_DIR/pip.log" 2>&1; then
        touch "$SITE/.installed-$sum"
        install_note="installed: $(cd /tmp/varlen-wheels && ls *.whl | sed 's/-py3.*//; s/-cp3.*//' | tr '\n' ' ')"
      else
        install_note="pip install failed (see pip.log): $(tail -1 "$OUT_DIR/pip.log")"
      fi
    fi
  fi
elif [ -n "$want" ]; then
  install_note="only ${#parts[@]} of $want wheel parts arrived: not installed"
fi
echo "$install_note"

# The project is not pip-installed there: import it from the tree. --target does not run .pth
# files, so add by hand the folder that nvidia-cutlass-dsl's .pth would put on sys.path.
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
[ -d "$SITE/nvidia_cutlass_dsl/dsl_packages" ] && export PYTHONPATH="$PYTHONPATH:$SITE/nvidia_cutlass_dsl/dsl_packages"
export FLASHINFER_WORKSPACE_BASE=/tmp/varlen-jit
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

python3 - <<'EOF' 2>&1 | tee "$OUT_DIR/env.txt"
import torch
print(f"torch {torch.__version__}, cuda {torch.version.cuda}, device "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'NONE'}")
for name in ("flashinfer", "flash_attn", "flash_attn.cute"):
    try:
        mod = __import__(name, fromlist=["_"])
        print(f"{name}: importable, version {getattr(mod, '__version__', '?')}")
    except Exception as e:
        print(f"{name}: not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
EOF

# --- 2. GPU tests, one dtype at a time so that a slow first JIT still leaves results
mapfile -t gpu_files < <(grep -l "pytest.mark.gpu" tests/*.py)
results=()
dtypes=(${GPU_DTYPES:-bf16 fp16})
for i in "${!dtypes[@]}"; do
  dt=${dtypes[$i]}
  log="$OUT_DIR/pytest-$dt.log"
  # Reserve ~100 s for the benchmark and ~150 s for each dtype still to come.
  t=$(left $(( 100 + 150 * (${#dtypes[@]} - i - 1) )))
  timeout -k 10 "$t" python3 -m pytest -m gpu -k "$dt" -q -rs -p no:cacheprovider \
    "${gpu_files[@]}" > "$log" 2>&1
  rc=$?
  last=$(grep -E "passed|failed|skipped|error" "$log" | tail -1)
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && last="TIMED OUT after ${t}s; $last"
  results+=("tests $dt: rc=$rc  $last")
  echo "${results[-1]}"
done

# --- 3. benchmark
bench_log="$OUT_DIR/bench.log"
timeout -k 10 "$(left 10)" python3 benchmarks/gpu_attention.py --json "$OUT_DIR/gpu_attention.json" \
  ${BENCH_ARGS:-} > "$bench_log" 2>&1
bench_rc=$?

# --- 4. one summary
echo
echo "================ GPU CHECK SUMMARY ================"
cat "$OUT_DIR/env.txt"
echo "$install_note"
printf '%s\n' "${results[@]}"
for dt in "${dtypes[@]}"; do cat "$OUT_DIR/pytest-$dt.log"; done \
  | grep -E "^(FAILED|ERROR|SKIPPED)" | sed 's/^SKIPPED \[[0-9]*\]/SKIPPED/' | cut -c1-240 | sort | uniq -c | head -20
echo "benchmark: rc=$bench_rc"
if grep -q "^SUMMARY" "$bench_log"; then
  head -1 "$bench_log"
  sed -n '/^SUMMARY/,$p' "$bench_log"
else
  grep -vE "^\s*$" "$bench_log" | tail -15
fi
