#!/bin/bash
export JAX_FLASH_CUDA_ARCHS=90a XLA_PYTHON_CLIENT_PREALLOCATE=false
cd "$(dirname "$0")"
( python3 -m pip install --no-build-isolation --no-deps -q . > $OUT/pip.log 2>&1; echo "pip rc=$?" >> $OUT/pip.log ) &
ARCH=90a bash tests/gpu/build.sh /tmp/b > $OUT/build.log 2>&1; echo "build rc=$?"
wait; tail -1 $OUT/pip.log
cp det.py /tmp/det.py; (cd /tmp && timeout 240 python3 det.py > $OUT/det.log 2>&1; echo "det rc=$?"; cat $OUT/det.log)
timeout 200 /tmp/b/tc_kernel_check features > $OUT/features.log 2>&1; echo "features rc=$?"
tail -1 $OUT/features.log; grep -E "Sq1024" $OUT/features.log | cut -c1-80; grep -iE "fail|mismatch" $OUT/features.log | head
cd tests && timeout 100 python3 -m pytest -q -p no:cacheprovider test_dropout.py -k many_tiles > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; tail -2 $OUT/pytest.log
