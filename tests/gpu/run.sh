#!/usr/bin/env bash
# The whole GPU suite and the benchmark, on a machine with an NVIDIA GPU:
#
#   tests/gpu/run.sh [LOG_DIR]
#
# Stages (all by default; choose with STAGES="install pytest ..."):
#   install  pip install the package for the visible GPU's architecture
#   pytest   the pytest suite; every backend-parametrised test runs on the GPU
#            too (the CPU half is what CI runs; PYTEST_K="not cpu" skips it)
#   kernels  standalone kernel drivers against float64 host references:
#            exact kernels (base and bias/mask/dropout), tensor-core kernels,
#            the JVP kernels (jvp_kernel_check),
#            then compute-sanitizer memcheck and racecheck on small cases
#   bench    python -m jax_flash.bench (fa3 preset), then --memory (memory preset)
#   gpt      the GPT example, jax_flash vs Flax attention, a few steps
# Every command runs from the repository root, as README.md shows it.
# Environment: JAX_FLASH_CUDA_ARCHS (default 90a), PYTHON (default python3),
# PYTEST_K (a -k filter), PYTEST_WORKERS (pytest-xdist processes, default 4).
set -uo pipefail
cd "$(dirname "$0")/../.."
LOG_DIR=${1:-/tmp/jax_flash_gpu_logs}
STAGES=${STAGES:-install pytest kernels bench gpt}
PYTHON=${PYTHON:-python3}
export JAX_FLASH_CUDA_ARCHS=${JAX_FLASH_CUDA_ARCHS:-90a} PYTHONUNBUFFERED=1
mkdir -p "$LOG_DIR"
status=0
has() { [[ " $STAGES " == *" $1 "* ]]; }
step() { echo "== $1"; }
# Whether a racecheck log of `tc_kernel_check small` is clean: the driver
# passed and racecheck reported nothing but the ws forward's tile-index slot,
# which it cannot judge (it reports a race-free handoff between a warp and
# warpgroups on named barriers too: tests/gpu/racecheck_probe.cu). That
# handoff's protocol is checked by tests/gpu/ws_pipeline_model.py instead.
racecheck_clean() {
  grep -q "SMALL OK" "$1" && grep -q "RACECHECK SUMMARY" "$1" &&
    ! grep -E "Race reported|^=+ +and (Read|Write) access" "$1" | grep -qv "TileIndexHandoff"
}

if has install; then
  step "install (sm_${JAX_FLASH_CUDA_ARCHS})"
  if ! $PYTHON -m pip install --no-build-isolation --no-deps . > "$LOG_DIR/install.log" 2>&1; then
    tail -n 40 "$LOG_DIR/install.log"; exit 1
  fi
  grep -E "^ *(-- )?jax_flash:" "$LOG_DIR/install.log"
fi

if has pytest; then
  step "pytest ${PYTEST_K:+-k \"$PYTEST_K\"}"
  # With pytest-xdist, PYTEST_WORKERS processes share the GPU (each allocates
  # on demand): the GPU half ran in 4.5 minutes with 4 on an H100, against
  # over 10 in one process.
  workers=()
  if $PYTHON -c "import xdist" 2> /dev/null; then
    workers=(-n "${PYTEST_WORKERS:-4}")
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
  fi
  $PYTHON -m pytest -q -p no:cacheprovider --tb=short -rfE "${workers[@]}" \
      ${PYTEST_K:+-k "$PYTEST_K"} tests > "$LOG_DIR/pytest.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)| passed| failed" "$LOG_DIR/pytest.log" | tail -n 30
fi

if has kernels; then
  step "kernel drivers and sanitizers"
  build=${BUILD_DIR:-/tmp/jax_flash_gpu_build}
  # Builds all three drivers (tests/gpu/build.sh), runs the exact ones.
  BUILD_DIR=$build bash tests/gpu/exact_features_run.sh "$LOG_DIR" > "$LOG_DIR/exact.log" 2>&1 \
      || status=1
  grep -E "cases failed|SUMMARY" "$LOG_DIR/exact.log"
  if [ -x "$build/tc_kernel_check" ]; then
    "$build/tc_kernel_check" check > "$LOG_DIR/tc_check.log" 2>&1 || status=1
    tail -n 2 "$LOG_DIR/tc_check.log"
    compute-sanitizer --tool racecheck "$build/tc_kernel_check" small \
        > "$LOG_DIR/tc_racecheck.log" 2>&1
    racecheck_clean "$LOG_DIR/tc_racecheck.log" || status=1
    grep SUMMARY "$LOG_DIR/tc_racecheck.log"
    # The forward-mode derivative: exact and sm80 JVP kernels, then the
    # Turing family's (float16, compute_75 code JIT-compiled for this GPU).
    "$build/jvp_kernel_check" check > "$LOG_DIR/jvp_check.log" 2>&1 || status=1
    tail -n 1 "$LOG_DIR/jvp_check.log"
    JAX_FLASH_FORCE_PATH=sm75 "$build/jvp_kernel_check" check > "$LOG_DIR/jvp_check_sm75.log" \
        2>&1 || status=1
    tail -n 1 "$LOG_DIR/jvp_check_sm75.log"
    for tool in memcheck racecheck; do
      compute-sanitizer --tool $tool --error-exitcode 9 "$build/jvp_kernel_check" small \
          > "$LOG_DIR/jvp_$tool.log" 2>&1 || status=1
      grep SUMMARY "$LOG_DIR/jvp_$tool.log"
    done
  else
    status=1; tail -n 20 "$LOG_DIR/exact.log"
  fi
  # The same cases with the backward's dQ accumulator capped at 64 KiB, so
  # that they run in chunks (batch runs, head runs) as long sequences do:
  # only the backward instantiations and the dispatch (which sizes the
  # workspace) are recompiled.
  if REUSE=$build REBUILD='^(bwd_sm|dispatch)' ARCH=${JAX_FLASH_CUDA_ARCHS%%;*} \
      bash tests/gpu/build.sh "$build-chunked" -DJAX_FLASH_MAX_DQ_ACCUM_BYTES=65536 \
      > "$LOG_DIR/tc_build_chunked.log" 2>&1; then
    "$build-chunked/tc_kernel_check" check > "$LOG_DIR/tc_check_chunked.log" 2>&1 || status=1
    tail -n 1 "$LOG_DIR/tc_check_chunked.log"
  else
    status=1; tail -n 20 "$LOG_DIR/tc_build_chunked.log"
  fi
fi

if has bench; then
  step "bench"
  # Lines starting with "… " are the bench's progress (stderr); the logs keep them.
  $PYTHON -m jax_flash.bench --json "$LOG_DIR/bench.json" > "$LOG_DIR/bench.log" 2>&1 || status=1
  grep -v "^… " "$LOG_DIR/bench.log" | cut -c1-170
  $PYTHON -m jax_flash.bench --memory > "$LOG_DIR/memory.log" 2>&1 || status=1
  grep -v "^… " "$LOG_DIR/memory.log" | cut -c1-170
fi

if has gpt; then
  step "gpt example"
  $PYTHON -m jax_flash.examples.gpt --preset gpt3-small --steps 10 --compare \
      > "$LOG_DIR/gpt.log" 2>&1 || status=1
  tail -n 12 "$LOG_DIR/gpt.log"
fi
exit $status
