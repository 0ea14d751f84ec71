#!/bin/bash
# Kernel variants against this tree, in one device call: the one script for
# trying a kernel change on a GPU (tests/gpu/run.sh runs the whole suite).
#
# This tree is built whole (tests/gpu/build.sh). A variant NAME:REGEX[:FLAGS]
# is another commit's snapshot, tests/gpu/ab_src/NAME.tgz, made beforehand
# on the machine with git:
#   mkdir -p tests/gpu/ab_src &&
#     git archive BRANCH cpp jax_flash tests | gzip > tests/gpu/ab_src/NAME.tgz
# or, without such a snapshot, this tree itself with FLAGS (a tuning hook:
# sm80/tile_size.h, sm90/tile_size.h); either way only the units matching
# REGEX are rebuilt (with FLAGS), the rest taken from this tree's build.
# Each variant is checked with `tc_kernel_check features` (CHECK=check: the
# 343 cases of `check`, ~190 s; CHECK=none: no check) and the sanitizers of
# SANITIZERS (default memcheck; any of memcheck racecheck synccheck, "" for
# none) on `small`; then every build is timed side by side, ROUNDS rounds
# (default 2; 0: no timing), D in DIMS (default "64 128"), S in SEQS
# (default "1024 4096 16384"), causal and not, with dropout at RATE (unset:
# none), with PAD=1 the jax bench's padding mask (dense, with its tile
# map), with LENS=1 that padding as sequence lengths: the backward (bench1, bwd ms), the forward (bench1_fwd, fwd ms), or
# both (direction "both"). Logs and bench.txt under $OUT.
# Budget of one call (600 s): about 100 s for this tree, 100-130 s for the
# variants, 75 s of checks and memcheck (side by side for the variants),
# 2 s per timed fwd run, 3 s per bwd run (with WARM_MS=500).
# Usage (repo root, on the GPU machine):
#   tests/gpu/ab_run.sh bwd "maskbwd:." "ws64:^bwd_sm90_.*hd64:-DJAX_FLASH_TUNE_SM90_D=64 \
#     -DJAX_FLASH_TUNE_SM90_BWD_WS=1"   (maskbwd.tgz, no ws64.tgz)
#   tests/gpu/ab_run.sh fwd "classic:^fwd_sm90:-DJAX_FLASH_SM90_FWD_WS=0"   (no classic.tgz)
#   DIMS="96 192 256" tests/gpu/ab_run.sh both "bn64:^fwd_sm80:-DJAX_FLASH_TUNE_D=96 \
#     -DJAX_FLASH_TUNE_FWD_BN=64"
# A regex of "." rebuilds everything (a change to a header that every unit
# includes); about 2 minutes per whole build, variants built in parallel.
# Every run has a timeout: a deadlocked pipeline shows up as rc 124.
# KEEP=1 takes the builds (/tmp/ab_this, /tmp/ab_NAME) an earlier run left on
# the same machine: a second timing, with other RATE / PAD / DIMS, in the
# same call. CASES (a regex of case names) narrows the checks; CHECK_<name>,
# CASES_<name>, SANITIZERS_<name> set them per build (this tree: "this",
# checked only when CHECK_this is set), e.g. the merged tree checked whole
# and a snapshot of main only timed:
#   CHECK_this=check SANITIZERS_this="memcheck racecheck" CHECK_base=none \
#     SANITIZERS_base="" tests/gpu/ab_run.sh both "base:^(fwd|bwd)_sm90"
# WARM_MS=<n> (default 500; 0: none) times every row after n ms of
# back-to-back calls: at the clock the power limit leaves (a training
# loop's and the jax bench's), not the top clock of a short run, which can
# favour a change that buys cycles with power (BENCHMARKS.md, twenty-fifth
# session). It adds about 0.5 s per timed run (1.5 s per bwd row).
# Only 8 files come back from a device call: point OUT elsewhere and tar it.
set -uo pipefail
export WARM_MS=${WARM_MS-500}
direction=$1; shift
out=${OUT:-/tmp/ab_out}; mkdir -p "$out"
start=$(date +%s)
say() { echo "$(( $(date +%s) - start )) s: $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader \
  > "$out/gpu.txt" 2>&1
built() { [ -n "${KEEP:-}" ] && [ -x "$1/tc_kernel_check" ]; }
rm -f /tmp/ab_*/HUNG  # a marker of an earlier call's check, not of this one's
built /tmp/ab_this ||
  ARCH=90a JOBS=16 bash tests/gpu/build.sh /tmp/ab_this > "$out/build_this.log" 2>&1 ||
  say "BUILD FAILED: this tree"
say built this tree
names=()
for spec in "$@"; do
  IFS=: read -r name regex flags <<< "$spec"
  names+=("$name")
  built "/tmp/ab_$name" && continue
  mkdir -p "/tmp/ab_src_$name"
  if [ -f "tests/gpu/ab_src/$name.tgz" ]; then
    tar -xzf "tests/gpu/ab_src/$name.tgz" -C "/tmp/ab_src_$name"
  else
    cp -r cpp jax_flash tests "/tmp/ab_src_$name/"
  fi
  # A tuning hook changes tile sizes that dispatch.cu reads too (workspace
  # sizes, sm90::TilesInCells' routing of block masks): with FLAGS it is
  # rebuilt as well, or it would route to kernels of tiles it does not know.
  [ -n "${flags:-}" ] && regex="($regex)|^dispatch\$"
  (cd "/tmp/ab_src_$name" && REUSE=/tmp/ab_this REBUILD="$regex" ARCH=90a JOBS=$(( 16 / $# )) \
     bash tests/gpu/build.sh "/tmp/ab_$name" ${flags:-} > "$out/build_$name.log" 2>&1 ||
     echo "BUILD FAILED: $name") &
done
wait
say built variants
# The checks of the builds run side by side (the float64 reference is CPU
# work): CHECK, CASES and SANITIZERS as above for every variant, and per
# build CHECK_<name>, CASES_<name>, SANITIZERS_<name> (this tree's name is
# "this"; it is checked only when CHECK_this is set). CHECK_TIMEOUT bounds
# each check (default 240 s for features, 480 s for check, which takes ~200 s
# alone and longer beside other checks): a deadlock is its rc 124, and that
# build is not timed in this call (HUNG; a later KEEP=1 call checks afresh).
for name in this "${names[@]}"; do (
  is_this() { [ "$name" = this ]; }
  v=CHECK_$name; checks=${!v:-$(is_this && echo none || echo "${CHECK:-features}")}
  v=CASES_$name; [ -n "${!v:-}" ] && export CASES=${!v}
  # The check and the sanitizers side by side too: one after the other they
  # outran a 600 s call (a whole `check` beside two others took 390 s).
  if [ "$checks" != none ]; then (
    limit=${CHECK_TIMEOUT:-$([ "$checks" = check ] && echo 480 || echo 240)}
    timeout "$limit" "/tmp/ab_$name/tc_kernel_check" "$checks" \
      > "$out/${checks}_$name.log" 2>&1
    rc=$?
    say "$checks $name: rc $rc, $(tail -1 "$out/${checks}_$name.log")"
    [ $rc = 124 ] && touch "/tmp/ab_$name/HUNG"  # not timed: every run would hang too
  ) & fi
  v=SANITIZERS_$name; tools=${!v-$(is_this || echo "${SANITIZERS-memcheck}")}
  for tool in $tools; do
    timeout 150 compute-sanitizer --tool "$tool" "/tmp/ab_$name/tc_kernel_check" small \
      > "$out/${tool}_$name.log" 2>&1
    say "$tool $name: rc $?, $(tail -1 "$out/${tool}_$name.log")"
  done
  wait ) &
done
wait
directions=$direction; [ "$direction" = both ] && directions="fwd bwd"
time_of() {  # $1: build dir; dir D S c from the loop
  [ -f "$1/HUNG" ] && { echo hung; return; }
  local mode=bench1; [ "$dir" = fwd ] && mode=bench1_fwd; [ -n "${PAD:-}" ] && mode=${mode}_pad
  [ -n "${LENS:-}" ] && mode=${mode}_lens
  timeout 30 "$1/tc_kernel_check" $mode $D $S $c ${RATE:-} 2>&1 | grep BENCH |
    sed "s/.*| bwd \([0-9.]*\) ms.*/\1/; s/.*: fwd \([0-9.]*\) ms.*/\1/"
}
# The SM clock and power once a second while the builds are timed (dmon.txt):
# the GPU is power-limited under these kernels, and rows have moved by 5-9%
# between rounds of the same build.
nvidia-smi dmon -s pc -d 1 > "$out/dmon.txt" 2>&1 &
dmon=$!
for round in $(seq "${ROUNDS:-2}"); do for dir in $directions; do
for D in ${DIMS:-64 128}; do for S in ${SEQS:-1024 4096 16384}; do for c in 0 1; do
  line="$dir D$D S$S causal$c this $(time_of /tmp/ab_this)"
  for name in "${names[@]}"; do line="$line $name $(time_of "/tmp/ab_$name")"; done
  echo "$line"
done; done; done; done; done | tee "$out/bench.txt"
kill "$dmon" 2>/dev/null
say done
