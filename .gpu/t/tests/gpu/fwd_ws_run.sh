#!/bin/bash
# The warp-specialized Hopper forward (cpp/cuda/sm90/fwd_ws.cuh) on a GPU
# machine, in steps that each fit one device call (repo root; logs under $OUT):
#   tests/gpu/fwd_ws_run.sh build     builds under build/gpu_*: ws (the new
#                                     forward), classic (sm90/fwd.cuh for every
#                                     Hopper bucket: -DJAX_FLASH_SM90_FWD_WS=0),
#                                     base (tests/gpu/baseline_src, if present:
#                                     git archive BASE cpp jax_flash tests/gpu),
#                                     and tile variants of the new forward
#                                     (sm90/tile_size.h's hook, one bucket
#                                     each): ws_q2 / ws_q2d64 (two Q buffers,
#                                     D=128 / D=64), ws_s3 (3 K/V stages,
#                                     D=128)
#   tests/gpu/fwd_ws_run.sh check [BUILDS]  tc_kernel_check check + small of
#                                     the builds named (default: ws classic;
#                                     a variant before adopting it: ws_q2 ...)
#   tests/gpu/fwd_ws_run.sh sanitize  compute-sanitizer memcheck, racecheck,
#                                     synccheck on `small` (ws)
#   tests/gpu/fwd_ws_run.sh bench     bench_fwd (D 64/128, S 1k-16k, causal or
#                                     not, TFLOP/s) of every build, then torch
#                                     SDPA flash and cuDNN at the same shapes
# Every run has a timeout: a deadlocked pipeline shows up as rc 124.
set -uo pipefail
out=${OUT:-/tmp/fwd_ws_out}; mkdir -p "$out"
b=build
step=${1:-all}

if [ "$step" = build ] || [ "$step" = all ]; then
  start=$(date +%s)
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
  if [ -d tests/gpu/baseline_src ]; then
    (JOBS=6 bash tests/gpu/baseline_src/tests/gpu/build.sh $b/gpu_base > "$out/build_base.log" 2>&1 ||
      echo "BASE BUILD FAILED") &
  fi
  JOBS=10 bash tests/gpu/build.sh $b/gpu_ws > "$out/build_ws.log" 2>&1 ||
    { echo "WS BUILD FAILED"; tail -30 "$out/build_ws.log"; }
  (REUSE=$b/gpu_ws REBUILD='^fwd_sm90' JOBS=4 bash tests/gpu/build.sh $b/gpu_classic \
     -DJAX_FLASH_SM90_FWD_WS=0 > "$out/build_classic.log" 2>&1 || echo "CLASSIC BUILD FAILED") &
  # name, bucket, flags: only that bucket's bf16 forward is recompiled.
  for v in "q2 128 -DJAX_FLASH_TUNE_WS_QSTAGES=2" "q2d64 64 -DJAX_FLASH_TUNE_WS_QSTAGES=2" \
           "s3 128 -DJAX_FLASH_TUNE_WS_STAGES=3"; do
    read -r name d flags <<< "$v"
    (REUSE=$b/gpu_ws REBUILD="^fwd_sm90_bf16_hd$d\$" JOBS=2 bash tests/gpu/build.sh $b/gpu_ws_$name \
       -DJAX_FLASH_TUNE_D=$d $flags > "$out/build_ws_$name.log" 2>&1 ||
       echo "VARIANT $name BUILD FAILED") &
  done
  wait
  grep -h -A2 "FwdWsKernel\|FwdKernel" $b/gpu_ws/obj/fwd_sm90_*.log |
    grep -E "Function|registers|spill" | sed 's/_ZN9jax_flash4cuda//' | cut -c1-120 |
    tee "$out/ptxas_fwd_sm90.txt"
  for f in $b/gpu_ws_*/obj/fwd_sm90_bf16_hd*.log; do
    [ -f "$f" ] && echo "$f: $(grep -A2 FwdWsKernel "$f" | grep -oE '[0-9]+ bytes spill stores|Used [0-9]+ registers' | tr '\n' ' ')"
  done | tee -a "$out/ptxas_fwd_sm90.txt"
  echo "builds done in $(( $(date +%s) - start )) s"
fi

if [ "$step" = check ] || [ "$step" = all ]; then
  builds=${*:2}
  for v in ${builds:-ws classic}; do
    [ -x $b/gpu_$v/tc_kernel_check ] || { echo "no $v build"; continue; }
    echo "== check ($v)"
    timeout 300 $b/gpu_$v/tc_kernel_check check > "$out/check_$v.log" 2>&1
    echo "check $v rc $?"; grep -v "^PASS" "$out/check_$v.log" | tail -12
    timeout 60 $b/gpu_$v/tc_kernel_check small > "$out/small_$v.log" 2>&1
    echo "small $v rc $?"; tail -2 "$out/small_$v.log"
  done
fi

if [ "$step" = sanitize ] || [ "$step" = all ]; then
  for tool in memcheck racecheck synccheck; do
    timeout 180 compute-sanitizer --tool $tool --error-exitcode 3 $b/gpu_ws/tc_kernel_check small \
      > "$out/sanitize_$tool.log" 2>&1
    echo "$tool rc $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Hazard|SMALL" "$out/sanitize_$tool.log" | head -5
  done
fi

if [ "$step" = bench ] || [ "$step" = all ]; then
  for v in ws classic base ws_q2 ws_q2d64 ws_s3; do
    [ -x $b/gpu_$v/tc_kernel_check ] || continue
    if grep -q bench_fwd "$( [ $v = base ] && echo tests/gpu/baseline_src/ )tests/gpu/tc_kernel_check.cu" 2>/dev/null; then
      timeout 150 $b/gpu_$v/tc_kernel_check bench_fwd 2>&1 | sed "s/^BENCH/$v/" | tee -a "$out/bench.log"
    else  # a base tree without bench_fwd: its bench1 per shape (forward and backward)
      for d in 64 128; do for c in 0 1; do for s in 1024 2048 4096 8192 16384; do
        timeout 30 $b/gpu_$v/tc_kernel_check bench1 $d $s $c 2>&1 | sed "s/^BENCH/$v/" |
          sed 's/ | bwd.*//' | tee -a "$out/bench.log"
      done; done; done
    fi
  done
  PYTHONUNBUFFERED=1 timeout 120 python3 tests/gpu/tc_torch_bench.py --fwd \
    --seqs 1024,2048,4096,8192,16384 2>&1 | tee "$out/torch.log" | grep -E "TORCH|Error"
fi
