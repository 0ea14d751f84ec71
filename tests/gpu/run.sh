#!/usr/bin/env bash
# Builds and runs the GPU checks on a machine with an NVIDIA GPU.
#
#   tests/gpu/run.sh [LOG_DIR]
#
# 1. exact_kernel_check: the CUDA launch API against a float64 host reference
#    (all dtypes, head dims, masks, GQA, softcap, NaN-poisoned outputs, and a
#    tensor of more than 2^31 elements).
# 2. compute-sanitizer memcheck, racecheck, synccheck and initcheck on small
#    cases.
# Environment: JAX_FLASH_CUDA_ARCHS (first entry used, default 90a), NVCC.
set -euo pipefail
cd "$(dirname "$0")/../.."
LOG_DIR=${1:-/tmp/jax_flash_gpu_logs}
BUILD=${BUILD_DIR:-/tmp/jax_flash_gpu_build}
NVCC=${NVCC:-nvcc}
ARCH=${JAX_FLASH_CUDA_ARCHS:-90a}
ARCH=${ARCH%%;*}
mkdir -p "$LOG_DIR" "$BUILD"

FLAGS=(-std=c++17 -O3 -lineinfo -arch=sm_${ARCH} -Icpp/include -Icpp)
SOURCES=(cpp/cuda/dispatch.cu cpp/cuda/exact_fwd_*.cu cpp/cuda/exact_bwd_*.cu
         tests/gpu/exact_kernel_check.cu)

echo "== build (sm_${ARCH})"
start=$(date +%s)
printf '%s\n' "${SOURCES[@]}" | xargs -P "$(nproc)" -I{} sh -c \
  "$NVCC ${FLAGS[*]} -Xptxas -warn-spills -c {} -o $BUILD/\$(basename {}).o" \
  2>&1 | tee "$LOG_DIR/build.log"
"$NVCC" "${FLAGS[@]}" -o "$BUILD/exact_kernel_check" "$BUILD"/*.o
echo "built in $(( $(date +%s) - start )) s"

echo "== exact_kernel_check --large"
"$BUILD/exact_kernel_check" --large 2>&1 | tee "$LOG_DIR/exact_kernel_check.log"

status=0
for tool in memcheck racecheck synccheck initcheck; do
  echo "== compute-sanitizer --tool $tool"
  if ! compute-sanitizer --tool "$tool" --error-exitcode 9 "$BUILD/exact_kernel_check" --small \
      > "$LOG_DIR/sanitizer_$tool.log" 2>&1; then
    status=1
  fi
  tail -n 4 "$LOG_DIR/sanitizer_$tool.log"
done
exit $status
