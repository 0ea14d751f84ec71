// Host checks of the integer division the persistent schedulers decode tile
// indices with (tests/test_fast_divisor.py builds and runs it): FastDivisor
// (jax_flash/math.h) against the `/` operator, and SectionedOrder::At
// (cuda/common/tile_scheduler.cuh) against the order written with plain
// divisions. Prints one line per failure and exits 1 if there was any.
#include <cstdint>
#include <cstdio>
#include <random>

#include "cuda/common/tile_scheduler.cuh"
#include "jax_flash/math.h"

namespace {

int failures = 0;

void CheckDivisor(int32_t d, std::mt19937_64& rng) {
  const jax_flash::FastDivisor f = jax_flash::FastDivisor::Of(d);
  auto expect = [&](int64_t n) {
    if (n < 0 || n > INT32_MAX) return;
    const int32_t m = static_cast<int32_t>(n);
    if (f.Divide(m) != m / d && failures++ < 20)
      std::printf("FastDivisor: %d / %d = %d, expected %d\n", m, d, f.Divide(m), m / d);
  };
  // Around every multiple of d up to 64 d, around the top of the range, and
  // at random.
  for (int64_t k = 0; k <= 64; ++k)
    for (int64_t e = -1; e <= 1; ++e) expect(k * d + e);
  for (int64_t e = 0; e < 4; ++e) {
    expect(INT32_MAX - e);
    const int64_t top = (int64_t{INT32_MAX} / d) * d;
    expect(top + e - 1);
  }
  std::uniform_int_distribution<int32_t> any(0, INT32_MAX);
  for (int i = 0; i < 64; ++i) expect(any(rng));
}

// The order as it was written with plain divisions.
jax_flash::cuda::SectionedPosition PlainAt(int index, int blocks, int section_pairs, int pairs) {
  const int per_section = blocks * section_pairs;
  const int section = index / per_section;
  const int r = index - section * per_section;
  const int first_pair = section * section_pairs;
  const int rest = pairs - first_pair;
  const int n_pairs = rest < section_pairs ? rest : section_pairs;
  const int block = r / n_pairs;
  return {block, first_pair + (r - block * n_pairs)};
}

void CheckOrder(int blocks, int section_pairs, int pairs) {
  const auto order = jax_flash::cuda::SectionedOrder::Make(blocks, section_pairs, pairs);
  for (int index = 0; index < blocks * pairs; ++index) {
    const auto want = PlainAt(index, blocks, section_pairs, pairs);
    const auto got = order.At(index);
    if ((got.block != want.block || got.pair != want.pair) && failures++ < 20)
      std::printf("SectionedOrder(%d, %d, %d).At(%d) = (%d, %d), expected (%d, %d)\n", blocks,
                  section_pairs, pairs, index, got.block, got.pair, want.block, want.pair);
  }
}

}  // namespace

int main() {
  std::mt19937_64 rng(20261130);
  for (int32_t d = 1; d <= 5000; ++d) CheckDivisor(d, rng);
  for (int s = 13; s <= 31; ++s)  // around every power of two above
    for (int64_t e = -3; e <= 3; ++e) {
      const int64_t d = (int64_t{1} << s) + e;
      if (d >= 1 && d <= INT32_MAX) CheckDivisor(static_cast<int32_t>(d), rng);
    }
  std::uniform_int_distribution<int32_t> any(1, INT32_MAX);
  for (int i = 0; i < 20000; ++i) CheckDivisor(any(rng), rng);
  for (int blocks : {1, 2, 3, 8, 17, 128})
    for (int pairs : {1, 2, 5, 12, 64, 100})
      for (int section_pairs = 1; section_pairs <= pairs; ++section_pairs)
        CheckOrder(blocks, section_pairs, pairs);
  if (failures) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
