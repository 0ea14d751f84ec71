#!/bin/bash
# The executed instructions of our main kernel and cuDNN's, by opcode, on the
# same problems: where energy_compare.sh says ours executes more of a pipe's
# instructions per FLOP, this says which. One call of each implementation
# (tests/gpu/profile_calls.py) under ncu's source counters, the kernel chosen
# by name, exported per SASS instruction and summed by opcode
# (tests/gpu/ncu_stalls.py --mix; its default view, the stall reasons by
# execution count, goes beside it). Needs jax_flash installed. Logs, reports
# and tables under $OUT.
# Usage (repo root, on the GPU machine):
#   tests/gpu/opcode_compare.sh ["D S causal direction" ...]
# direction fwd picks the forward kernels (ours FwdWsKernel / FwdKernel,
# cuDNN's "fprop"), fwd_bwd the backward's dK/dV kernels (ours BwdKernel /
# BwdWideKernel / BwdWsKernel, cuDNN's "bprop").
set -uo pipefail
out=${OUT:-/tmp/opcode_out}; mkdir -p "$out"
problems=("$@")
# The source view's counters and stall samples only: `--set full` replays
# each kernel for every section (cuDNN's 1k causal forward did not finish in
# 110 s); NCU_SECTIONS="--set full" brings the rest back.
sections=${NCU_SECTIONS:---section SourceCounters --section WarpStateStats}
[ ${#problems[@]} -eq 0 ] && problems=("64 1024 0 fwd" "64 4096 0 fwd" "128 16384 0 fwd_bwd")
for problem in "${problems[@]}"; do
  if [ "${problem##* }" = fwd ]; then  # the problem's last word: its direction
    kernels=("jax_flash:regex:FwdWsKernel|FwdKernel" "cudnn:regex:fprop")
  else
    kernels=("jax_flash:regex:BwdKernel|BwdWideKernel|BwdWsKernel" "cudnn:regex:bprop")
  fi
  for spec in "${kernels[@]}"; do
    impl=${spec%%:*}; filter=${spec#*:}
    name=$(echo "$problem $impl" | tr ' ' _)
    timeout 300 ncu --profile-from-start off $sections --import-source yes -k "$filter" \
      --launch-count 1 -f -o "$out/$name" python3 tests/gpu/profile_calls.py $problem \
      --impls "$impl" > "$out/$name.log" 2>&1
    echo "== $problem $impl (ncu rc $?)"
    ncu -i "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/$name.csv" \
      2>> "$out/$name.log" &&
      python3 tests/gpu/ncu_stalls.py "$out/$name.csv" --mix --top 20 | tee "$out/$name.txt" &&
      python3 tests/gpu/ncu_stalls.py "$out/$name.csv" >> "$out/$name.txt"
  done
done
