#!/usr/bin/env bash
# Builds and runs the exact-kernel checks on a machine with an NVIDIA GPU:
# exact_kernel_check (the base features) and exact_features_check (bias,
# dbias, dense mask, dropout), then compute-sanitizer memcheck and racecheck
# on their small cases. The dispatch links the tensor-core kernels too, so
# their generated instantiations (jax_flash/_supported.py) are built here.
#
#   tests/gpu/exact_features_run.sh [LOG_DIR]       (BUILD_DIR, NVCC, JAX_FLASH_CUDA_ARCHS)
#   SKIP_RUN=1 builds only.
set -euo pipefail
cd "$(dirname "$0")/../.."
LOG_DIR=${1:-/tmp/jax_flash_gpu_logs}
BUILD=${BUILD_DIR:-/tmp/jax_flash_exact_build}
NVCC=${NVCC:-nvcc}
ARCH=${JAX_FLASH_CUDA_ARCHS:-90a}
ARCH=${ARCH%%;*}
mkdir -p "$LOG_DIR" "$BUILD/gen/jax_flash" "$BUILD/obj"

python3 jax_flash/_supported.py --header "$BUILD/gen/jax_flash/supported.h" \
  --tc-sources "$BUILD/gen/tc" > "$BUILD/tc_sources.txt"
FLAGS="-std=c++17 -O3 -lineinfo -arch=sm_${ARCH} -Icpp/include -Icpp -Icpp/cuda -I$BUILD/gen -I$BUILD/gen/tc"
[ "$ARCH" = 90a ] && FLAGS="$FLAGS -DJAX_FLASH_HAS_SM90A=1"
{
  cat "$BUILD/tc_sources.txt"
  ls cpp/cuda/tc/tc_dispatch.cu cpp/cuda/dispatch.cu cpp/cuda/exact_fwd_*.cu cpp/cuda/exact_bwd_*.cu \
     tests/gpu/exact_kernel_check.cu tests/gpu/exact_features_check.cu
} > "$BUILD/sources.txt"

echo "== build (sm_${ARCH})"
start=$(date +%s)
# Object names keep the parent folder: the generated tc files may share base names.
xargs -P "$(nproc)" -I{} sh -c \
  'f={}; o=$(echo "$f" | tr "/" "_"); '"$NVCC $FLAGS"' -Xptxas -warn-spills -c "$f" -o '"$BUILD"'/obj/"$o".o' \
  < "$BUILD/sources.txt" 2>&1 | tee "$LOG_DIR/build.log"
KERNELS=$(ls "$BUILD"/obj/*.o | grep -v '_check.cu.o$')
"$NVCC" -arch=sm_${ARCH} -o "$BUILD/exact_kernel_check" $KERNELS "$BUILD"/obj/*exact_kernel_check.cu.o
"$NVCC" -arch=sm_${ARCH} -o "$BUILD/exact_features_check" $KERNELS "$BUILD"/obj/*exact_features_check.cu.o
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
