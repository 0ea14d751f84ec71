#!/bin/bash
# Kernel variants against this tree, in one device call. This tree is built
# whole (tests/gpu/build.sh); each variant is another commit's snapshot,
# tests/gpu/ab_src/NAME.tgz, made beforehand on the machine with git:
#   mkdir -p tests/gpu/ab_src &&
#     git archive BRANCH cpp jax_flash tests | gzip > tests/gpu/ab_src/NAME.tgz
# or, where there is no such snapshot, this tree itself (a tuning hook of
# this tree: its flags are the variant), and is rebuilt only in the units
# matching its regex (with extra nvcc flags where given), the rest taken
# from this tree's build. Each
# variant is checked with `tc_kernel_check features` (CHECK=check: `check`)
# and memcheck on `small` (CHECK=none: neither);
# then every build is timed side by side, ROUNDS rounds (default 2), D 64 /
# 128, S 1k / 4k / 16k, causal and not: the backward (bench1, bwd ms), the
# forward (bench1_fwd, fwd ms), or both (direction "both"). Logs and bench.txt under $OUT. MEMCHECK=0
# skips memcheck. Budget of one call (600 s): about 100 s for this tree, 100-
# 130 s for the variants, 75 s of checks per variant, 1.8 s per timed run:
# three variants fit with ROUNDS=1, two with the defaults.
# Usage (repo root, on the GPU machine):
#   tests/gpu/ab_run.sh bwd "maskbwd:." "dqred:^bwd_sm90:-DJAX_FLASH_TUNE_BWD_DQ_RED=1"
#   tests/gpu/ab_run.sh fwd "ostore:^fwd"
#   tests/gpu/ab_run.sh bwd "bm128:^bwd_sm90_.*hd64:-DJAX_FLASH_TUNE_SM90_D=64 \
#     -DJAX_FLASH_TUNE_SM90_BWD_BM=128 -DJAX_FLASH_TUNE_SM90_BWD_KV_RS=0"   (no bm128.tgz)
# A regex of "." rebuilds everything (a change to a header that every unit
# includes); about 2 minutes per whole build, variants built in parallel.
set -uo pipefail
direction=$1; shift
out=${OUT:-/tmp/ab_out}; mkdir -p "$out"
start=$(date +%s)
say() { echo "$(( $(date +%s) - start )) s: $*"; }
ARCH=90a JOBS=16 bash tests/gpu/build.sh /tmp/ab_this > "$out/build_this.log" 2>&1 || say "BUILD FAILED: this tree"
say built this tree
names=()
for spec in "$@"; do
  IFS=: read -r name regex flags <<< "$spec"
  names+=("$name")
  mkdir -p "/tmp/ab_src_$name"
  if [ -f "tests/gpu/ab_src/$name.tgz" ]; then
    tar -xzf "tests/gpu/ab_src/$name.tgz" -C "/tmp/ab_src_$name"
  else
    cp -r cpp jax_flash tests "/tmp/ab_src_$name/"
  fi
  (cd "/tmp/ab_src_$name" && REUSE=/tmp/ab_this REBUILD="$regex" ARCH=90a JOBS=$(( 16 / $# )) \
     bash tests/gpu/build.sh "/tmp/ab_$name" ${flags:-} > "$out/build_$name.log" 2>&1 ||
     echo "BUILD FAILED: $name") &
done
wait
say built variants
for name in "${names[@]}"; do
  checks=${CHECK:-features}  # CHECK=check: the 343 cases (~190 s) instead of the 197
  [ "$checks" = none ] && continue  # CHECK=none: timing only
  timeout 240 "/tmp/ab_$name/tc_kernel_check" "$checks" > "$out/${checks}_$name.log" 2>&1
  say "$checks $name: rc $?, $(tail -1 "$out/${checks}_$name.log")"
  [ "${MEMCHECK:-1}" = 0 ] && continue
  timeout 90 compute-sanitizer --tool memcheck "/tmp/ab_$name/tc_kernel_check" small \
    > "$out/memcheck_$name.log" 2>&1
  say "memcheck $name: rc $?, $(tail -1 "$out/memcheck_$name.log")"
done
directions=$direction; [ "$direction" = both ] && directions="fwd bwd"
time_of() {  # $1: build dir; dir D S c from the loop
  local mode=bench1; [ "$dir" = fwd ] && mode=bench1_fwd
  timeout 30 "$1/tc_kernel_check" $mode $D $S $c 2>&1 | grep BENCH |
    sed "s/.*| bwd \([0-9.]*\) ms.*/\1/; s/.*: fwd \([0-9.]*\) ms.*/\1/"
}
for round in $(seq "${ROUNDS:-2}"); do for dir in $directions; do
for D in 64 128; do for S in 1024 4096 16384; do for c in 0 1; do
  line="$dir D$D S$S causal$c this $(time_of /tmp/ab_this)"
  for name in "${names[@]}"; do line="$line $name $(time_of "/tmp/ab_$name")"; done
  echo "$line"
done; done; done; done; done | tee "$out/bench.txt"
say done
