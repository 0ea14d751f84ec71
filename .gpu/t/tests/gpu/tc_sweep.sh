#!/bin/bash
# Tile-shape sweep on the GPU machine: one variant per line of stdin,
# "name|nvcc flags" with the tuning hook of sm80/tile_size.h, e.g.
#   d128_bn64|-DJAX_FLASH_TUNE_D=128 -DJAX_FLASH_TUNE_FWD_BN=64
# builds the variant (the first build in full, the others recompiling only
# the tensor-core instantiations) and runs the benchmark of each. Logs under $OUT.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-/tmp}
first=""
while IFS='|' read -r name flags; do
  [ -z "$name" ] && continue
  reuse=()
  [ -n "$first" ] && reuse=(env REUSE="$first" REBUILD='_sm(80|90)_|dispatch')
  "${reuse[@]}" env JOBS=16 bash "$root/tests/gpu/build.sh" "/tmp/v_$name" $flags > "$out/build_$name.log" 2>&1 ||
    { echo "BUILD FAILED $name"; tail -5 "$out/build_$name.log"; continue; }
  [ -z "$first" ] && first=/tmp/v_$name
  echo "== $name ($flags)"
  timeout 60 "/tmp/v_$name/tc_kernel_check" bench 2>&1 | sed "s/^BENCH/$name/"
done
