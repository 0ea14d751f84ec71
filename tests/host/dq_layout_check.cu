// The fast backward's dQ accumulator layout checked on the host
// (tests/test_dq_layout.py builds and runs it; tc_kernel_check runs the same
// check before its GPU cases): tests/gpu/dq_layout_check.h, every head-dim
// bucket. Prints its PASS or FAIL line and exits 1 on a failure.
#include "dq_layout_check.h"

int main() { return check::DqAccumLayoutOk() ? 0 : 1; }
