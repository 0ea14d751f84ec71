#!/bin/bash
# Where the energy goes, jax_flash against cuDNN on the same problems: ncu's
# counters (instructions by pipe, shared-memory wavefronts, L2 sectors, DRAM
# bytes, cycles) of one call each (tests/gpu/profile_calls.py), summed per
# implementation (tests/gpu/ncu_counters.py). At the GPU's power limit the
# time per call is the energy per call (cpp/cuda/NOTES_sm90_fwd.md, "The gap
# is the clock"), so where the two are level these counters per FLOP say
# what ours spends more of. Needs jax_flash installed (pip install
# --no-build-isolation .). Logs and one table per problem under $OUT.
# Usage (repo root, on the GPU machine):
#   tests/gpu/energy_compare.sh ["D S causal direction" ...]
set -uo pipefail
out=${OUT:-/tmp/energy_out}; mkdir -p "$out"
metrics=smsp__inst_executed.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_alu.sum
metrics=$metrics,smsp__inst_executed_pipe_xu.sum
metrics=$metrics,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,lts__t_sectors.sum,dram__bytes.sum
metrics=$metrics,sm__cycles_elapsed.avg,gpu__time_duration.sum
problems=("$@")
[ ${#problems[@]} -eq 0 ] &&
  problems=("128 16384 0 fwd" "128 16384 0 fwd_bwd" "256 4096 1 fwd_bwd" "64 1024 0 fwd")
for problem in "${problems[@]}"; do
  name=$(echo "$problem" | tr ' ' _)
  # ncu's own lines start with ==PROF==; ncu_counters.py reads the quoted CSV rows alone.
  timeout 300 ncu --profile-from-start off --csv --metrics "$metrics" \
    python3 tests/gpu/profile_calls.py $problem > "$out/$name.csv" 2> "$out/$name.err"
  echo "== $problem (rc $?)"
  python3 tests/gpu/ncu_counters.py "$out/$name.csv" | tee "$out/$name.txt"
done
