#!/bin/bash
# SASS of every CUDA kernel, without a GPU: compiles each kernel source (the
# instantiations generated from jax_flash/_supported.py and every .cu under
# cpp/cuda) to one cubin per architecture, with the flags CMake uses, and
# dumps
#   OUT/sass/<unit>.<arch>.sass   cuobjdump -sass of the cubin
#   OUT/ptxas/<unit>.<arch>.log   ptxas -v (registers, spills per kernel)
# Compiling with -cubin is deterministic, so a refactoring is checked by
# comparing two snapshots kernel by kernel (tests/gpu/sass_compare.py).
#
#   tests/gpu/sass_snapshot.sh OUT [REGEX]   (REGEX: only units whose name matches)
# Environment: NVCC (default nvcc), CUOBJDUMP (default cuobjdump; the 13.x
# nvidia-cuda-cuobjdump wheel has one), JOBS (default nproc), ARCHS (default
# "80 90a").
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:?usage: sass_snapshot.sh OUT [REGEX]}
filter=${2:-.}
mkdir -p "$out/gen/jax_flash" "$out/cubin" "$out/sass" "$out/ptxas"
out=$(cd "$out" && pwd)
NVCC=${NVCC:-nvcc}
CUOBJDUMP=${CUOBJDUMP:-cuobjdump}
ARCHS=${ARCHS:-80 90a}
python3 "$root/jax_flash/_supported.py" --header "$out/gen/jax_flash/supported.h" \
  --cuda-sources "$out/gen/cuda" > "$out/generated.txt"
# Unit name: the path below cpp/cuda or the generated folder, '/' -> '_'.
{
  sed "s|^$out/gen/cuda/||" "$out/generated.txt" | sed "s|^|gen:|"
  (cd "$root/cpp/cuda" && find . -name '*.cu' | sed 's|^\./||' | sort) | sed "s|^|src:|"
} | grep -E "$filter" > "$out/units.txt" || true
# The flags of cmake/cuda_sources.cmake (Release: -O3 -DNDEBUG), per arch.
flags="-std=c++17 -O3 -DNDEBUG -lineinfo -DJAX_FLASH_WITH_CUDA=1 -DJAX_FLASH_HAS_SM90A=1
  -I$root/cpp/include -I$root/cpp -I$out/gen -Xptxas -v"
export NVCC CUOBJDUMP flags root out
for arch in $ARCHS; do
  sed "s|$| $arch|" "$out/units.txt"
done | xargs -P "${JOBS:-$(nproc)}" -L1 bash -c '
  spec=$0; arch=$1
  case $spec in gen:*) src=$out/gen/cuda/${spec#gen:} ;; src:*) src=$root/cpp/cuda/${spec#src:} ;; esac
  unit=$(echo "${spec#*:}" | sed "s|\.cu$||; s|/|_|g")
  cubin=$out/cubin/$unit.$arch.cubin
  $NVCC $flags -cubin -gencode=arch=compute_${arch},code=sm_${arch} "$src" -o "$cubin" \
      > "$out/ptxas/$unit.$arch.log" 2>&1 || { cat "$out/ptxas/$unit.$arch.log"; exit 255; }
  $CUOBJDUMP -sass "$cubin" > "$out/sass/$unit.$arch.sass"
  echo "$unit sm_$arch"'
echo "snapshot in $out ($(ls "$out/sass" | wc -l) cubins)"
