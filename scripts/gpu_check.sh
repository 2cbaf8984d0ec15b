#!/usr/bin/env bash
# Everything a session with a lent GPU runs, in one go: install the carried kernel wheels, run the
# GPU tests, run `varlen.run` end to end on the triton backend, run the attention benchmark, profile
# the GPU's operators for the simulator's measured cost model, print one summary. Logs, the run's tables and the benchmark's JSON go to $OUT (the device tool brings
# that folder back), or /tmp/varlen-gpu-out elsewhere.
#
#   bash scripts/gpu_check.sh stage   # only collect carried wheel parts (see fetch_gpu_wheels.sh)
#   bash scripts/gpu_check.sh         # install, test, run, benchmark; designed to end within 9 minutes
#
# Wheel parts arrive in wheels/c1, wheels/c2, ... over several calls; each call copies what it
# finds to /tmp/varlen-wheel-parts, which outlives a call while the machine stays warm. Without
# any parts the script still runs: the backends whose library is missing skip with their reason
# (the triton backend needs nothing beyond the CUDA torch, which brings Triton).
#
# Time shares of BUDGET (seconds, default 530: 9 minutes less a timeout's 10 s kill grace):
#   GPU tests  SHARE_TESTS per dtype (default 120; GPU_DTYPES, default "bf16 fp16", in that order)
#   end to end SHARE_RUN (default 80): python -m varlen.run backend=triton engine.device=cuda
#   benchmark  SHARE_BENCH (default 120): decode B 1/16/64/256 x context 1k/8k vs the HBM
#              roofline, prefill throughput; BENCH_ARGS adds arguments
#   profile    SHARE_PROFILE (default 80): python -m sim.profile on the 50M shape in bf16 (its
#              layers, the torch_sdpa attention backend, the engine's per-step cost; collectives
#              over every GPU when there are several) into $OUT/profiles/, named PROFILE_GPU
#              (default h200_sxm), then sim.explain reads them back (cost.model=measured)
# Each part gets its share, or less when an earlier part overran, so that the later parts and the
# summary keep theirs; the benchmark also stops starting cases at its share (--budget).
# JIT caches (FlashInfer's nvcc builds, Triton's kernels) live in /tmp/varlen-jit, so a rerun on
# the same warm machine skips the compiles.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
deadline=$(( $(date +%s) + ${BUDGET:-530} ))
SHARE_TESTS=${SHARE_TESTS:-120}
SHARE_RUN=${SHARE_RUN:-80}
SHARE_BENCH=${SHARE_BENCH:-120}
SHARE_PROFILE=${SHARE_PROFILE:-80}
SUMMARY_RESERVE=10
share() {  # seconds for a part: its share ($1), or what is left after the later parts' reserve ($2), at least 20
  local s=$(( deadline - $(date +%s) - $2 - SUMMARY_RESERVE ))
  [ $s -gt $1 ] && s=$1
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
export TRITON_CACHE_DIR=/tmp/varlen-jit/triton
unset TRITON_INTERPRET  # compiled kernels here; the interpreter is for CPU tests
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

python3 - <<'EOF' 2>&1 | tee "$OUT_DIR/env.txt"
import torch
print(f"torch {torch.__version__}, cuda {torch.version.cuda}, device "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'NONE'}")
for name in ("triton", "flashinfer", "flash_attn", "flash_attn.cute", "pytest", "hypothesis", "transformers",
             "hydra"):
    try:
        mod = __import__(name, fromlist=["_"])
        print(f"{name}: importable, version {getattr(mod, '__version__', '?')}")
    except Exception as e:
        print(f"{name}: not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
EOF

# --- 2. GPU tests, one dtype at a time so that a slow first JIT still leaves results
mapfile -t gpu_files < <(grep -rl --include="*.py" "pytest.mark.gpu" tests | sort)
results=()
dtypes=(${GPU_DTYPES:-bf16 fp16})
for i in "${!dtypes[@]}"; do
  dt=${dtypes[$i]}
  log="$OUT_DIR/pytest-$dt.log"
  t=$(share "$SHARE_TESTS" $(( SHARE_RUN + SHARE_BENCH + SHARE_PROFILE + SHARE_TESTS * (${#dtypes[@]} - i - 1) )))
  timeout -k 10 "$t" python3 -m pytest -m gpu -k "$dt" -q -rs -p no:cacheprovider \
    "${gpu_files[@]}" > "$log" 2>&1
  rc=$?
  last=$(grep -E "passed|failed|skipped|error" "$log" | tail -1)
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && last="TIMED OUT after ${t}s; $last"
  results+=("tests $dt: rc=$rc  $last")
  echo "${results[-1]}"
done

# --- 3. end to end: the CLI on the triton backend (the tiny default model, the default fp32)
run_log="$OUT_DIR/run-triton.log"
t=$(share "$SHARE_RUN" $(( SHARE_BENCH + SHARE_PROFILE )))
run_start=$(date +%s)
timeout -k 10 "$t" python3 -m varlen.run backend=triton engine.device=cuda progress=false \
  "hydra.run.dir=$OUT_DIR/run-triton" > "$run_log" 2>&1
run_rc=$?
run_note="end to end (backend=triton engine.device=cuda): rc=$run_rc in $(( $(date +%s) - run_start ))s"
[ $run_rc -eq 124 ] || [ $run_rc -eq 137 ] && run_note="$run_note, TIMED OUT after ${t}s"
echo "$run_note"

# --- 4. benchmark
bench_log="$OUT_DIR/bench.log"
t=$(share "$SHARE_BENCH" "$SHARE_PROFILE")
# --budget: no new case starts in the last 30 s of the share (one case takes seconds).
timeout -k 10 "$t" python3 benchmarks/gpu_attention.py --budget "$(( t > 40 ? t - 30 : 10 ))" \
  --json "$OUT_DIR/gpu_attention.json" ${BENCH_ARGS:-} > "$bench_log" 2>&1
bench_rc=$?

# --- 5. operator profile for the simulator (cost.model=measured cost.profiles=$OUT/profiles)
prof_log="$OUT_DIR/profile.log"
t=$(share "$SHARE_PROFILE" 0)
prof_start=$(date +%s)
export VARLEN_HOME=/tmp/varlen-home  # where sim.profile writes the 50M model
timeout -k 10 "$t" bash -c '
  python3 -m sim.profile --model big --device cuda --dtype bfloat16 --gpu "$1" --out "$2/profiles" --repeats 5 &&
  python3 -m sim.explain cost.model=measured cost.profiles="$2/profiles" hardware="$1" sim_model=local \
    sim_model.config="$VARLEN_HOME/bench-qwen3-50m/config.json" "hydra.run.dir=$2/explain"
' _ "${PROFILE_GPU:-h200_sxm}" "$OUT_DIR" > "$prof_log" 2>&1
prof_rc=$?
prof_note="profile (sim.profile, 50M shape, bf16): rc=$prof_rc in $(( $(date +%s) - prof_start ))s"
[ $prof_rc -eq 124 ] || [ $prof_rc -eq 137 ] && prof_note="$prof_note, TIMED OUT after ${t}s"

# --- 6. one summary
echo
echo "================ GPU CHECK SUMMARY ================"
cat "$OUT_DIR/env.txt"
echo "$install_note"
printf '%s\n' "${results[@]}"
for dt in "${dtypes[@]}"; do cat "$OUT_DIR/pytest-$dt.log"; done \
  | grep -E "^(FAILED|ERROR|SKIPPED)" | sed 's/^SKIPPED \[[0-9]*\]/SKIPPED/' | cut -c1-240 | sort | uniq -c | head -20
echo "$run_note"
if [ $run_rc -eq 0 ]; then
  grep -E "backend triton|output tokens/s|TTFT|TPOT|finished" "$run_log" | head -8
else
  grep -vE "^\s*$" "$run_log" | tail -6
fi
echo "benchmark: rc=$bench_rc"
if grep -q "^SUMMARY" "$bench_log"; then
  head -1 "$bench_log"
  sed -n '/^SUMMARY/,$p' "$bench_log"
else
  grep -vE "^\s*$" "$bench_log" | tail -15
fi
echo "$prof_note"
grep -E -- "->|collectives|total" "$prof_log" | head -12 || true
