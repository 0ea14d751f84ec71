#!/bin/bash
# One device call: build the kernels in cpp/cuda/tc (and, when
# tests/gpu/tc_baseline_src exists, the saved baseline copy of that folder),
# check correctness, benchmark both against torch SDPA at the same shapes,
# and try forward tile variants of one bucket (relinking only that object).
# Usage (repo root, on the GPU machine): tests/gpu/tc_run.sh "name|nvcc flags" ...
# Logs and a summary under $OUT.
set -uo pipefail
root=$(pwd)
out=${OUT:-/tmp/tc_out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee "$out/gpu.txt"
start=$(date +%s)
if [ -d tests/gpu/tc_baseline_src ]; then
  rm -rf /tmp/base && mkdir -p /tmp/base/cpp/cuda /tmp/base/tests/gpu
  cp -r cpp/include /tmp/base/cpp/ && cp -r jax_flash /tmp/base/ && cp tests/gpu/tc_build.sh tests/gpu/tc_kernel_check.cu /tmp/base/tests/gpu/
  cp -r tests/gpu/tc_baseline_src /tmp/base/cpp/cuda/tc
  (JOBS=8 /tmp/base/tests/gpu/tc_build.sh /tmp/b_base > "$out/build_base.log" 2>&1 || echo "BASE BUILD FAILED") &
fi
JOBS=8 tests/gpu/tc_build.sh /tmp/b_new > "$out/build_new.log" 2>&1 || { echo "NEW BUILD FAILED"; tail -30 "$out/build_new.log"; }
# Forward variants: recompile one instantiation, relink with the rest.
for spec in "$@"; do
  name=${spec%%|*}; flags=${spec#*|}; file=$(echo "$flags" | sed -n 's/.*FILE=\([a-z0-9_]*\).*/\1/p')
  flags=$(echo "$flags" | sed 's/FILE=[a-z0-9_]*//')
  ( mkdir -p /tmp/v_$name && nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icpp/include -Icpp/cuda -Xptxas -v $flags \
      -c /tmp/b_new/gen/tc/$file.cu -o /tmp/v_$name/$file.o > "$out/build_v_$name.log" 2>&1 &&
    nvcc -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fopenmp $(ls /tmp/b_new/obj/*.o | grep -v "/$file.o") /tmp/v_$name/$file.o \
      -o /tmp/v_$name/tc_kernel_check >> "$out/build_v_$name.log" 2>&1 || echo "VARIANT $name BUILD FAILED" ) &
done
wait
echo "builds done in $(( $(date +%s) - start )) s"
grep -h -A2 "FlashBwdDkDv\|FlashBwdDq\|FlashFwd" /tmp/b_new/obj/*.log | grep -E "Function|registers|spill" | sed 's/_ZN9jax_flash4cuda2tc//' | cut -c1-110 > "$out/ptxas_new.txt"
echo "== check (new)"
timeout 240 /tmp/b_new/tc_kernel_check check > "$out/check.log" 2>&1; echo "check rc $?"
grep -v "^PASS" "$out/check.log" | tail -15
timeout 60 /tmp/b_new/tc_kernel_check small 2>&1 | tail -2
echo "== bench"
for b in b_base b_new; do
  [ -x /tmp/$b/tc_kernel_check ] && timeout 90 /tmp/$b/tc_kernel_check bench 2>&1 | sed "s/^BENCH/${b#b_}/" | tee -a "$out/bench.log"
done
for spec in "$@"; do
  name=${spec%%|*}; d=$(echo "$spec" | sed -n 's/.*TUNE_D=\([0-9]*\).*/\1/p')
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
