#!/bin/bash
# Builds tests/gpu/tc_kernel_check without CMake: generated instantiations
# (jax_flash/_supported.py), the dispatch, the driver. Usage:
#   tests/gpu/tc_build.sh BUILD_DIR [extra nvcc flags...]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-build_tc}; shift || true
mkdir -p "$build/gen/jax_flash" "$build/obj"
python3 "$root/jax_flash/_supported.py" --header "$build/gen/jax_flash/supported.h" \
  --tc-sources "$build/gen/tc" > "$build/sources.txt"
echo "$root/cpp/cuda/tc/tc_dispatch.cu" >> "$build/sources.txt"
flags="-std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -DJAX_FLASH_HAS_SM90A=1 -I$root/cpp/include -I$root/cpp/cuda -I$build/gen/tc -Xptxas -v $*"
jobs=${JOBS:-$(nproc)}
# One process per file, timed, ptxas report kept per file.
xargs -P "$jobs" -I{} bash -c 'f={}; n=$(basename $f .cu); s=$(date +%s%N);
  nvcc '"$flags"' -c $f -o '"$build"'/obj/$n.o > '"$build"'/obj/$n.log 2>&1 || { cat '"$build"'/obj/$n.log; exit 255; };
  echo "$n $(( ($(date +%s%N) - s) / 1000000 )) ms" >> '"$build"'/compile_times.txt' < "$build/sources.txt"
nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I"$root/cpp/include" -I"$root/cpp/cuda" \
  -Xcompiler -fopenmp -c "$root/tests/gpu/tc_kernel_check.cu" -o "$build/obj/check.o"
nvcc -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fopenmp "$build"/obj/*.o -o "$build/tc_kernel_check"
echo "built $build/tc_kernel_check"
