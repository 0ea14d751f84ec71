#!/bin/bash
# One device call for the tensor-core kernels: build (tests/gpu/build.sh) this
# tree and, when tests/gpu/baseline_src holds another tree (a copy of cpp/,
# jax_flash/ and tests/gpu/ of a base commit, e.g.
#   mkdir -p tests/gpu/baseline_src &&
#     git archive BASE cpp jax_flash tests/gpu | tar -x -C tests/gpu/baseline_src),
# that one with its own build script; check correctness, benchmark both
# against torch SDPA at the same shapes, and try tile variants of one bucket
# (recompiling only that instantiation, the tuning hook of sm80/tile_size.h or
# sm90/tile_size.h: -DJAX_FLASH_TUNE_D=... or -DJAX_FLASH_TUNE_SM90_D=...).
# Usage (repo root, on the GPU machine):
#   tests/gpu/tc_run.sh "name|FILE=fwd_sm80_bf16_hd128 -DJAX_FLASH_TUNE_D=128 -DJAX_FLASH_TUNE_FWD_BN=64" ...
# Logs and a summary under $OUT; TC_RACECHECK=1 adds compute-sanitizer racecheck,
# TC_BENCH_D=1 the other buckets' benchmark (bench_d).
set -uo pipefail
root=$(pwd)
out=${OUT:-/tmp/tc_out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee "$out/gpu.txt"
start=$(date +%s)
base=tests/gpu/baseline_src
if [ -d "$base" ]; then
  # The base tree builds with its own script: tests/gpu/build.sh, or
  # tc_build.sh before the cpp/cuda layout of issue 11.
  if [ -f "$base/tests/gpu/build.sh" ]; then
    (JOBS=8 bash "$base/tests/gpu/build.sh" /tmp/b_base > "$out/build_base.log" 2>&1 || echo "BASE BUILD FAILED") &
  else
    (JOBS=8 bash "$base/tests/gpu/tc_build.sh" /tmp/b_base > "$out/build_base.log" 2>&1 || echo "BASE BUILD FAILED") &
  fi
fi
JOBS=8 bash tests/gpu/build.sh /tmp/b_new > "$out/build_new.log" 2>&1 || { echo "NEW BUILD FAILED"; tail -30 "$out/build_new.log"; }
wait
# Variants: recompile one instantiation with extra flags, reuse the rest.
for spec in "$@"; do
  name=${spec%%|*}; flags=${spec#*|}; file=$(echo "$flags" | sed -n 's/.*FILE=\([a-z0-9_]*\).*/\1/p')
  flags=$(echo "$flags" | sed 's/FILE=[a-z0-9_]*//')
  ( REUSE=/tmp/b_new REBUILD="^$file\$" JOBS=4 bash tests/gpu/build.sh /tmp/v_$name $flags \
      > "$out/build_v_$name.log" 2>&1 || echo "VARIANT $name BUILD FAILED" ) &
done
wait
echo "builds done in $(( $(date +%s) - start )) s"
grep -h -A2 "DkDvKernel\|DqKernel\|FwdKernel\|BwdKernel" /tmp/b_new/obj/*_sm*.log | grep -E "Function|registers|spill" | sed 's/_ZN9jax_flash4cuda//' | cut -c1-110 > "$out/ptxas_new.txt"
echo "== check (new)"
timeout 240 /tmp/b_new/tc_kernel_check check > "$out/check.log" 2>&1; echo "check rc $?"
grep -v "^PASS" "$out/check.log" | tail -15
timeout 60 /tmp/b_new/tc_kernel_check small 2>&1 | tail -2
echo "== bench"
for b in b_base b_new; do
  [ -x /tmp/$b/tc_kernel_check ] || continue
  timeout 90 /tmp/$b/tc_kernel_check bench 2>&1 | sed "s/^BENCH/${b#b_}/" | tee -a "$out/bench.log"
  # With a soft cap (the Hopper backward's other kernels), where the driver has it.
  src=tests/gpu/tc_kernel_check.cu; [ $b = b_base ] && src=$base/$src
  grep -q bench_cap "$src" 2>/dev/null &&
    timeout 90 /tmp/$b/tc_kernel_check bench_cap 2>&1 | sed "s/^BENCH/${b#b_}/" | tee -a "$out/bench.log"
  # The other buckets (D = 32, 96, 192, 256) with TC_BENCH_D=1.
  [ -n "${TC_BENCH_D:-}" ] &&
    timeout 180 /tmp/$b/tc_kernel_check bench_d 2>&1 | sed "s/^BENCH/${b#b_}/" | tee -a "$out/bench.log"
done
for spec in "$@"; do
  name=${spec%%|*}; d=$(echo "$spec" | sed -n 's/.*TUNE_\(SM90_\)\{0,1\}D=\([0-9]*\).*/\2/p')
  [ -x /tmp/v_$name/tc_kernel_check ] || continue
  for s in 4096 16384; do for c in 0 1; do
    timeout 30 /tmp/v_$name/tc_kernel_check bench1 $d $s $c 2>&1 | sed "s/^BENCH/$name/" | tee -a "$out/bench.log"
  done; done
done
echo "== torch"
PYTHONUNBUFFERED=1 timeout 120 python3 tests/gpu/tc_torch_bench.py 2>&1 | tee "$out/torch.log" | grep TORCH
if [ -n "${TC_RACECHECK:-}" ]; then
  timeout 150 compute-sanitizer --tool racecheck /tmp/b_new/tc_kernel_check small > "$out/racecheck.log" 2>&1
  echo "racecheck rc $?"; tail -4 "$out/racecheck.log"
fi
echo "total $(( $(date +%s) - start )) s"
