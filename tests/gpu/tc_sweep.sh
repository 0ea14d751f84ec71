#!/bin/bash
# Tile-shape sweep on the GPU machine: builds one variant per line of
# "name|nvcc flags" and runs the benchmark of each. Logs under $OUT.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-/tmp}
while IFS='|' read -r name flags; do
  [ -z "$name" ] && continue
  JOBS=16 "$root/tests/gpu/tc_build.sh" "/tmp/v_$name" $flags > "$out/build_$name.log" 2>&1 || { echo "BUILD FAILED $name"; tail -5 "$out/build_$name.log"; continue; }
  echo "== $name ($flags)"
  timeout 60 "/tmp/v_$name/tc_kernel_check" bench 2>&1 | sed "s/^BENCH/$name/"
done
