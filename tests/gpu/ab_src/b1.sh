#!/usr/bin/env bash
# device call: install main, then the fa3 bench per head dim given in DIMS
set -u
cd "$(dirname "$0")/../../.."
R=$OUT
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > $R/gpu.txt 2>&1
if ! python3 -m pip show jax_flash > /dev/null 2>&1 || [ "${INSTALL:-0}" = 1 ]; then
  t0=$(date +%s)
  JAX_FLASH_CUDA_ARCHS=90a python3 -m pip install --no-build-isolation --no-deps . > $R/install.log 2>&1 || { tail -30 $R/install.log; exit 1; }
  echo "install $(( $(date +%s)-t0 )) s"
fi
python3 -c "import jax, jax_flash; print(jax.__version__, jax.devices())"
for d in ${DIMS}; do
  t0=$(date +%s)
  timeout ${TL:-290} python3 -m jax_flash.bench --preset fa3 --seqlens 1k 2k 4k 16k --head-dims $d --impls jax_flash,cudnn --rounds 3 --json $R/bench_d$d.json > $R/bench_d$d.log 2>&1
  echo "D=$d rc=$? $(( $(date +%s)-t0 )) s"
  tail -n 30 $R/bench_d$d.log
done
