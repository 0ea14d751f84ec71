#!/usr/bin/env bash
# Builds (tests/gpu/build.sh) and runs the exact-kernel checks on a machine
# with an NVIDIA GPU: exact_kernel_check (the base features) and
# exact_features_check (bias, dbias, dense mask, dropout), then
# compute-sanitizer memcheck and racecheck on their small cases.
#
#   tests/gpu/exact_features_run.sh [LOG_DIR]       (BUILD_DIR, NVCC, JAX_FLASH_CUDA_ARCHS)
#   SKIP_RUN=1 builds only.
set -euo pipefail
cd "$(dirname "$0")/../.."
LOG_DIR=${1:-/tmp/jax_flash_gpu_logs}
BUILD=${BUILD_DIR:-/tmp/jax_flash_exact_build}
ARCH=${JAX_FLASH_CUDA_ARCHS:-90a}
mkdir -p "$LOG_DIR"

echo "== build (sm_${ARCH%%;*})"
start=$(date +%s)
# -warn-spills: a spill in an exact kernel shows in the build log.
ARCH=${ARCH%%;*} bash tests/gpu/build.sh "$BUILD" -Xptxas -warn-spills 2>&1 | tee "$LOG_DIR/build.log"
echo "built in $(( $(date +%s) - start )) s"
[ -n "${SKIP_RUN:-}" ] && exit 0

status=0
for check in exact_features_check exact_kernel_check; do
  echo "== $check"
  "$BUILD/$check" 2>&1 | tee "$LOG_DIR/$check.log" || status=1
done
for tool in memcheck racecheck; do
  for check in exact_features_check exact_kernel_check; do
    echo "== compute-sanitizer --tool $tool $check --small"
    if ! compute-sanitizer --tool "$tool" --error-exitcode 9 "$BUILD/$check" --small \
        > "$LOG_DIR/sanitizer_${tool}_$check.log" 2>&1; then
      status=1
    fi
    tail -n 3 "$LOG_DIR/sanitizer_${tool}_$check.log"
  done
done
exit $status
