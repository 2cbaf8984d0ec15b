#!/usr/bin/env bash
# Fetch the GPU kernel libraries as wheels for the lent GPU machine, and pack them for carrying.
#
#   bash scripts/fetch_gpu_wheels.sh [flashinfer] [fa4]        (default: both)
#
# The GPU machine (H200, python 3.12, torch built for CUDA 13, nvcc present) has no network, so
# the wheels travel with the working tree, at most 64 MiB per call, tree included. This script
# downloads them (pip download --no-deps; the machine already has torch, numpy, einops, ninja,
# nvidia-ml-py, cuda-bindings, ...), tars them and splits the tar into parts of PART_MB
# (default 60) MiB, one per folder: wheels/c1, wheels/c2, ... (wheels/ is git-ignored). Carry
# one folder per call, back to back (the machine stays warm only briefly between calls):
#
#   run(carry=["wheels/c1"], command="bash scripts/gpu_check.sh stage")
#   ...
#   run(carry=["wheels/cN"], command="bash scripts/gpu_check.sh", timeout_s=600)
#
# Why these: PyPI has flash-attn 2.x only as a source package (hours of nvcc, or a download from
# GitHub at install time), so flash_attn runs there through flash-attn 4 (`flash_attn.cute`, pure
# Python on the CuTe DSL). FlashInfer's kernels are JIT-compiled there with nvcc on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PART_MB=${PART_MB:-60}
sets=("$@")
[ ${#sets[@]} -eq 0 ] && sets=(flashinfer fa4)

pkgs=()
for s in "${sets[@]}"; do
  case "$s" in
    flashinfer) pkgs+=(flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2) ;;
    fa4) pkgs+=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1
                nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 torch-c-dlpack-ext==0.1.5
                apache-tvm-ffi==0.1.15.post2) ;;
    *) echo "unknown set '$s' (choose flashinfer, fa4)" >&2; exit 2 ;;
  esac
done
mapfile -t pkgs < <(printf '%s\n' "${pkgs[@]}" | sort -u)

rm -rf wheels/dl wheels/c[0-9]* wheels/bundle.tar*
mkdir -p wheels/dl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d wheels/dl "${pkgs[@]}"

tar cf wheels/bundle.tar -C wheels/dl .
sum=$(sha256sum wheels/bundle.tar | cut -d' ' -f1)
split -b "${PART_MB}M" -d -a 2 wheels/bundle.tar wheels/bundle.tar.part-
parts=(wheels/bundle.tar.part-*)
for i in "${!parts[@]}"; do
  dir="wheels/c$((i + 1))"
  mkdir -p "$dir"
  mv "${parts[$i]}" "$dir/"
  echo "parts=${#parts[@]} sha256=$sum" > "$dir/MANIFEST"
done
rm wheels/bundle.tar
echo "wheels: $(ls wheels/dl | tr '\n' ' ')"
rm -rf wheels/dl  # only the parts travel; keep nothing here that someone could carry by mistake

du -sh wheels/c[0-9]* | sed 's/^/  /'
n=${#parts[@]}
echo "carry them one call each, back to back:"
for i in $(seq 1 "$n"); do
  if [ "$i" -lt "$n" ]; then
    echo "  run(carry=[\"wheels/c$i\"], command=\"bash scripts/gpu_check.sh stage\")"
  else
    echo "  run(carry=[\"wheels/c$i\"], command=\"bash scripts/gpu_check.sh\", timeout_s=600)"
  fi
done
