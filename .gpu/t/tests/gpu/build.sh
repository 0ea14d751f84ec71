#!/bin/bash
# Builds the kernel drivers without CMake or Python packaging: every kernel
# instantiation (generated from jax_flash/_supported.py), the dispatch, and
# the drivers exact_kernel_check, exact_features_check, tc_kernel_check and
# jvp_kernel_check, all against the launch API the FFI handlers call
# (cpp/cuda/launch.h).
#
#   tests/gpu/build.sh BUILD_DIR [extra nvcc flags, for every file...]
#
# Environment: NVCC (default nvcc), ARCH (one architecture, default 90a),
# JOBS (default nproc). ptxas -v per file in BUILD_DIR/obj/*.log, compile
# times in BUILD_DIR/compile_times.txt.
# A variant of a finished build: REUSE=DIR takes the objects of DIR except
# for the units (file names without .cu) matching the regex REBUILD, which
# are compiled with this call's flags, e.g. a tile shape for one bucket:
#   REUSE=/tmp/b REBUILD=fwd_sm80_bf16_hd128 tests/gpu/build.sh /tmp/v \
#     -DJAX_FLASH_TUNE_D=128 -DJAX_FLASH_TUNE_FWD_BN=64   (sm80/tile_size.h)
# or the chunked backward (bwd/workspace.h) with the dispatch that sizes it:
#   REUSE=/tmp/b REBUILD='^(bwd_sm|dispatch)' tests/gpu/build.sh /tmp/c \
#     -DJAX_FLASH_MAX_DQ_ACCUM_BYTES=65536
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-build_gpu}; shift || true
mkdir -p "$build/gen/jax_flash" "$build/obj"
build=$(cd "$build" && pwd)
NVCC=${NVCC:-nvcc}
arch=${ARCH:-90a}
python3 "$root/jax_flash/_supported.py" --header "$build/gen/jax_flash/supported.h" \
  --cuda-sources "$build/gen/cuda" > "$build/sources.txt"
echo "$root/cpp/cuda/dispatch.cu" >> "$build/sources.txt"
drivers="exact_kernel_check exact_features_check tc_kernel_check jvp_kernel_check"
kernels=$(sed 's|.*/||; s|\.cu$|.o|' "$build/sources.txt" | sed "s|^|$build/obj/|")
# The flags of cmake/cuda_sources.cmake.
# The Turing family's files (*_sm75_*) are compute_75 PTX (and sm_75 code)
# whatever ARCH is: a newer GPU runs them JIT-compiled by the driver, with
# JAX_FLASH_CUDA_DEVICE_ARCH=75 (cuda/dispatch.cu).
flags="-std=c++17 -O3 -lineinfo -DJAX_FLASH_WITH_CUDA=1 -DJAX_FLASH_HAS_SM80=1
  -DJAX_FLASH_HAS_SM75=1 -Xcompiler -fopenmp -I$root/cpp/include -I$root/cpp -I$build/gen $*"
[ "$arch" = 90a ] && flags="$flags -DJAX_FLASH_HAS_SM90A=1"
gencode="-gencode=arch=compute_${arch},code=sm_${arch}"
gencode75="-gencode=arch=compute_75,code=[sm_75,compute_75]"
: > "$build/compile_times.txt"
export NVCC flags build gencode gencode75
export REUSE=${REUSE:-} REBUILD=${REBUILD:-.}
xargs -P "${JOBS:-$(nproc)}" -I{} bash -c 'f={}; n=$(basename "$f" .cu); s=$(date +%s%N)
  if [ -n "$REUSE" ] && ! echo "$n" | grep -qE "$REBUILD" && [ -f "$REUSE/obj/$n.o" ]; then
    cp "$REUSE/obj/$n.o" "$REUSE/obj/$n.log" "$build/obj/"; exit 0
  fi
  case "$n" in *_sm75_*) g=$gencode75 ;; *) g=$gencode ;; esac
  $NVCC $flags $g -Xptxas -v -c "$f" -o "$build/obj/$n.o" > "$build/obj/$n.log" 2>&1 ||
    { cat "$build/obj/$n.log"; exit 255; }
  echo "$n $(( ($(date +%s%N) - s) / 1000000 )) ms" >> "$build/compile_times.txt"' \
  < <(cat "$build/sources.txt"; for d in $drivers; do echo "$root/tests/gpu/$d.cu"; done)
for d in $drivers; do
  $NVCC -gencode=arch=compute_${arch},code=sm_${arch} -Xcompiler -fopenmp $kernels \
    "$build/obj/$d.o" -o "$build/$d"
done
echo "built $build/{exact_kernel_check,exact_features_check,tc_kernel_check,jvp_kernel_check} (sm_$arch)"
