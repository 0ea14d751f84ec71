// Host checks of the integer division the persistent schedulers decode tile
// indices with (tests/test_fast_divisor.py builds and runs it): FastDivisor
// (jax_flash/math.h) against the `/` operator; SectionedOrder::At
// (cuda/common/tile_scheduler.cuh) and the two schedulers' MakeArgs + Get / At
// (the forward's PersistentScheduler, sm90/scheduler_persistent.cuh; the
// backward's KeyBlockSectionScheduler) against the order written with plain
// divisions. Prints one line per failure and exits 1 if there was any.
#include <cstdint>
#include <cstdio>
#include <random>

#include "cuda/common/tile_scheduler.cuh"
#include "cuda/sm90/scheduler_persistent.cuh"
#include "jax_flash/math.h"
#include "jax_flash/params.h"

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

jax_flash::AttentionShape Shape(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seqlen,
                                int64_t head_dim) {
  jax_flash::AttentionShape s;
  s.batch = batch;
  s.seqlen_q = s.seqlen_k = seqlen;
  s.num_heads_q = heads_q;
  s.num_heads_kv = heads_kv;
  s.head_dim = head_dim;
  return s;
}

// The forward's tiles: query block from the last, (batch, head) pairs heads
// fastest, or batch fastest for TileOrder::kBatchInner.
void CheckForwardTiles(const jax_flash::AttentionShape& s, int64_t m_blocks, bool causal,
                       jax_flash::cuda::TileOrder order) {
  using jax_flash::cuda::sm90::PersistentScheduler;
  PersistentScheduler::Args a;
  if (!PersistentScheduler::MakeArgs(m_blocks, s, causal, order, &a)) return;
  const int64_t pairs = s.batch * s.num_heads_q;
  const int64_t kv_bytes = 2 * s.seqlen_k * s.head_dim * 2 / s.group_size();
  const int section = static_cast<int>(jax_flash::cuda::SectionedOrder::SectionPairs(
      PersistentScheduler::SectionBytes(causal), kv_bytes, pairs));
  const bool batch_inner = order == jax_flash::cuda::TileOrder::kBatchInner;
  for (int index = 0; index < a.tiles; ++index) {
    const auto at = PlainAt(index, static_cast<int>(m_blocks), section, static_cast<int>(pairs));
    const int64_t inner = batch_inner ? s.batch : s.num_heads_q;
    const int64_t outer = at.pair / inner, rest = at.pair % inner;
    const int64_t want_b = batch_inner ? rest : outer, want_h = batch_inner ? outer : rest;
    const int64_t want_m = m_blocks - 1 - at.block;
    const auto got = PersistentScheduler::Get(a, index);
    if ((got.b != want_b || got.h != want_h || got.m_block != want_m) && failures++ < 20)
      std::printf("forward B %lld H %lld m_blocks %lld causal %d order %d tile %d: (b %lld, h %lld, "
                  "m %lld), expected (%lld, %lld, %lld)\n",
                  static_cast<long long>(s.batch), static_cast<long long>(s.num_heads_q),
                  static_cast<long long>(m_blocks), causal, static_cast<int>(order), index,
                  static_cast<long long>(got.b), static_cast<long long>(got.h),
                  static_cast<long long>(got.m_block), static_cast<long long>(want_b),
                  static_cast<long long>(want_h), static_cast<long long>(want_m));
  }
}

// The backward's dK/dV tiles: key blocks outer, (batch, kv head) pairs kv
// heads fastest.
void CheckBackwardTiles(const jax_flash::AttentionShape& s, int64_t n_blocks, int block_n,
                        bool causal) {
  using jax_flash::cuda::KeyBlockSectionScheduler;
  KeyBlockSectionScheduler::Args a;
  if (!KeyBlockSectionScheduler::MakeArgs(n_blocks, block_n, s, causal, &a)) return;
  const int64_t pairs = s.batch * s.num_heads_kv;
  const int64_t pair_bytes = s.group_size() * s.seqlen_q * s.head_dim * (2 + 2 + 4);
  const int section = static_cast<int>(jax_flash::cuda::SectionedOrder::SectionPairs(
      KeyBlockSectionScheduler::SectionBytes(n_blocks, block_n, causal), pair_bytes, pairs));
  for (int index = 0; index < KeyBlockSectionScheduler::Tiles(a); ++index) {
    const auto at = PlainAt(index, static_cast<int>(n_blocks), section, static_cast<int>(pairs));
    const int64_t want_b = at.pair / s.num_heads_kv, want_h = at.pair % s.num_heads_kv;
    const auto got = KeyBlockSectionScheduler::At(a, index);
    if ((got.b != want_b || got.h_kv != want_h || got.n_block != at.block) && failures++ < 20)
      std::printf("backward B %lld Hkv %lld n_blocks %lld tile %d: (b %lld, h %lld, n %lld), "
                  "expected (%lld, %lld, %d)\n",
                  static_cast<long long>(s.batch), static_cast<long long>(s.num_heads_kv),
                  static_cast<long long>(n_blocks), index, static_cast<long long>(got.b),
                  static_cast<long long>(got.h_kv), static_cast<long long>(got.n_block),
                  static_cast<long long>(want_b), static_cast<long long>(want_h), at.block);
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
  // Shapes whose sections hold one pair, several (dividing the pairs or
  // not) or all of them: small and long sequences, GQA, odd batch and heads.
  using jax_flash::cuda::TileOrder;
  for (int64_t batch : {1, 3, 4})
    for (int64_t heads_kv : {1, 2, 5})
      for (int64_t group : {1, 4})
        for (int64_t seqlen : {128, 1000, 16384, 131072})
          for (int64_t head_dim : {64, 256}) {
            const auto s = Shape(batch, heads_kv * group, heads_kv, seqlen, head_dim);
            for (bool causal : {false, true}) {
              for (TileOrder order :
                   {TileOrder::kQueryBlocksInner, TileOrder::kBatchInner, TileOrder::kHeadsInner})
                CheckForwardTiles(s, jax_flash::CeilDiv(seqlen, 128), causal, order);
              CheckBackwardTiles(s, jax_flash::CeilDiv(seqlen, 128), 128, causal);
              CheckBackwardTiles(s, jax_flash::CeilDiv(seqlen, 64), 64, causal);
            }
          }
  if (failures) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
