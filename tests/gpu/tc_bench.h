// The timing modes of tc_kernel_check: forward, backward and deterministic
// backward of the tensor-core kernels, through the launch API
// (cpp/cuda/launch.h), bf16 or fp16, at the FA3 paper's shapes (B * S = 16k
// tokens, H * D = 2048). cudaEvents, the median of many after warm-up
// (check::TimeMs); FLOPs as the FlashAttention papers count them (the
// backward 2.5 x the forward, causal half).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "check_util.h"
#include "cuda/dispatch.h"
#include "cuda/launch.h"
#include "jax_flash/params.h"

// Per-example valid lengths as `python -m jax_flash.bench --features padding`
// and `lengths` make them, from S - S / (4B) down to 3S/4: (B,) int32, the
// `lengths` row's query_seq_lengths and key_value_seq_lengths.
inline std::vector<int32_t> PaddingLengths(int B, int S) {
  std::vector<int32_t> len(B);
  for (int b = 0; b < B; ++b) len[b] = S - (b + 1) * S / (4 * B);
  return len;
}

// That padding as the `padding` row's mask (Flax's make_attention_mask of
// those lengths): dense (B, 1, S, S) bytes and its tile map (B, 1, R, C).
struct PaddingMask {
  check::DeviceBytes dense, cells;
  int64_t rows = 0, cols = 0;

  PaddingMask(int B, int S)
      : dense((size_t)B * S * S), cells((size_t)B * check::CeilCells(S) * check::CeilCells(S)) {
    rows = cols = check::CeilCells(S);
    const int64_t cell = jax_flash::kBlockMaskBlock;
    std::vector<uint8_t> d((size_t)B * S * S), m((size_t)B * rows * cols);
    const std::vector<int32_t> lengths = PaddingLengths(B, S);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t len = lengths[b];
      for (int64_t i = 0; i < S; ++i)
        for (int64_t j = 0; j < S; ++j) d[(b * S + i) * S + j] = i < len && j < len;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t i1 = std::min<int64_t>(S, (r + 1) * cell);
          const int64_t j1 = std::min<int64_t>(S, (c + 1) * cell);
          const bool any = r * cell < len && c * cell < len, all = i1 <= len && j1 <= len;
          m[(b * rows + r) * cols + c] =
              !any ? jax_flash::kCellEmpty : (all ? jax_flash::kCellFull : jax_flash::kCellPartial);
        }
    }
    CHECK_CUDA(cudaMemcpy(dense.p(), d.data(), d.size(), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(cells.p(), m.data(), m.size(), cudaMemcpyHostToDevice));
  }
  void Apply(jax_flash::MaskParams* mask, int S) const {
    mask->dense = static_cast<const uint8_t*>(dense.p());
    mask->dense_strides = jax_flash::DenseStrides{(int64_t)S * S, 0, S, 1};
    mask->tile_map = static_cast<const uint8_t*>(cells.p());
    mask->tile_map_strides = jax_flash::DenseStrides{rows * cols, 0, cols, 1};
    mask->tile_map_rows = rows;
    mask->tile_map_cols = cols;
  }
};

// How a timed call pads its sequences: not, by PaddingMask, or by lengths.
enum class Padding { kNone, kMask, kLengths };

inline void Bench(int B, int S, int H, int D, bool causal, bool bf16, bool once = false,
                  float softcap = 0.f, bool fwd_only = false, float dropout = 0.f,
                  Padding padding = Padding::kNone) {
  using namespace jax_flash;  // BwdParams, AttentionShape, cuda::
  using Dev = check::DeviceBytes;
  if (check::RoutesAsTuring()) bf16 = false;  // as tc_kernel_check.cu's RunCase
  const size_t n = (size_t)B * S * H * D;
  Dev q(n * 2), k(n * 2), v(n * 2), o(n * 2), lse((size_t)B * H * S * 4), dout(n * 2), dq(n * 2), dk(n * 2),
      dv(n * 2);
  // Standard-normal q, k, v, dout, independent as the jax bench's (q = k
  // made S's diagonal dominate every row and P nearly one-hot there): one
  // draw of n values, tensor i starting i quarters and i elements further
  // into it (a rotation). The i elements matter: rotated by whole rows, k
  // would be q's rows again, shifted, and every row would still meet its
  // own values; shifted within the row, q . k pairs unrelated draws.
  std::vector<uint16_t> h(n); std::mt19937 rng(1); std::normal_distribution<float> nd;
  for (auto& x : h) x = check::ToBits(nd(rng), bf16);
  const Dev* tensors[] = {&q, &k, &v, &dout};
  for (size_t i = 0; i < 4; ++i) {
    const size_t off = (i * (n / 4) + i) % n;
    char* dst = static_cast<char*>(tensors[i]->p());
    CHECK_CUDA(cudaMemcpy(dst, h.data() + off, (n - off) * 2, cudaMemcpyHostToDevice));
    if (off > 0) CHECK_CUDA(cudaMemcpy(dst + (n - off) * 2, h.data(), off * 2, cudaMemcpyHostToDevice));
  }
  BwdParams p;
  p.shape = AttentionShape{B, S, S, H, H, D};
  p.mask.causal = causal;
  p.score.scale = 1.0 / std::sqrt((double)D);
  p.score.softcap = softcap;
  const uint32_t keys_h[2] = {0x2545f491u, 0x9e3779b9u};
  Dev keys(sizeof keys_h);
  CHECK_CUDA(cudaMemcpy(keys.p(), keys_h, sizeof keys_h, cudaMemcpyHostToDevice));
  p.dropout.rate = dropout;
  p.dropout.keys = static_cast<const uint32_t*>(keys.p());
  p.dropout.key_batch = 1;
  p.q = q.p(); p.k = k.p(); p.v = v.p(); p.out = o.p(); p.lse = lse.p(); p.dout = dout.p(); p.dq = dq.p(); p.dk = dk.p();
  p.dv = dv.p();
  check::SetContiguousStrides(&p);
  std::unique_ptr<PaddingMask> pad;
  if (padding == Padding::kMask) {
    pad = std::make_unique<PaddingMask>(B, S);
    pad->Apply(&p.mask, S);
  }
  Dev lengths((size_t)B * 4);
  if (padding == Padding::kLengths) {
    const std::vector<int32_t> len = PaddingLengths(B, S);
    CHECK_CUDA(cudaMemcpy(lengths.p(), len.data(), len.size() * 4, cudaMemcpyHostToDevice));
    p.mask.q_seqlens = p.mask.kv_seqlens = static_cast<const int32_t*>(lengths.p());
  }
  const char* padding_name =
      padding == Padding::kMask ? " padding" : padding == Padding::kLengths ? " lengths" : "";
  const cuda::DType dtype = check::DType16(bf16);
  Dev ws(cuda::BwdWorkspaceBytes(p.shape, dtype, false));
  const double flops = 4.0 * B * H * (double)S * S * D * (causal ? 0.5 : 1.0);
  if (once) {  // one launch of each, for a profiler
    CHECK_CUDA(check::LaunchFwd(p, dtype, nullptr));
    CHECK_CUDA(cuda::LaunchBwd(p, dtype, ws.p(), false, nullptr));
    CHECK_CUDA(cuda::LaunchBwd(p, dtype, ws.p(), true, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    return;
  }
  float tf = check::TimeMs([&] { CHECK_CUDA(check::LaunchFwd(p, dtype, nullptr)); }, 20);
  if (fwd_only) {
    std::printf("BENCH %s B%d S%d H%d D%d %s%s%s%s: fwd %.3f ms %.0f TF/s\n",
                bf16 ? "bf16" : "fp16", B, S, H, D, causal ? "causal" : "full",
                softcap > 0 ? " cap" : "", dropout > 0 ? " dropout" : "", padding_name, tf,
                flops / tf * 1e-9);
    return;
  }
  float tb = check::TimeMs([&] { CHECK_CUDA(cuda::LaunchBwd(p, dtype, ws.p(), false, nullptr)); }, 10);
  float td = check::TimeMs([&] { CHECK_CUDA(cuda::LaunchBwd(p, dtype, ws.p(), true, nullptr)); }, 5);
  std::printf("BENCH %s B%d S%d H%d D%d %s%s%s%s: fwd %.3f ms %.0f TF/s | bwd %.3f ms %.0f TF/s | bwd-det %.3f ms %.0f TF/s\n",
              bf16 ? "bf16" : "fp16", B, S, H, D, causal ? "causal" : "full", softcap > 0 ? " cap" : "",
              dropout > 0 ? " dropout" : "", padding_name, tf, flops / tf * 1e-9, tb,
              2.5 * flops / tb * 1e-9, td, 2.5 * flops / td * 1e-9);
}

// Runs `mode` if it is a timing mode: bench, bench_fp16, bench_cap,
// bench_fwd, bench_d, or bench1 / bench1_fwd (the forward alone) / prof with
// D S causal [dropout rate] (argv[2..5]), and bench1_pad / bench1_fwd_pad,
// the same with the padding mask (PaddingMask), bench1_lens / bench1_fwd_lens
// with that padding as lengths (PaddingLengths); false for any other mode,
// the one-shape modes without their three numbers included.
inline bool RunBenchMode(const std::string& mode, int argc, char** argv) {
  const Padding padding = mode == "bench1_pad" || mode == "bench1_fwd_pad"     ? Padding::kMask
                          : mode == "bench1_lens" || mode == "bench1_fwd_lens" ? Padding::kLengths
                                                                               : Padding::kNone;
  const bool fwd_only =
      mode == "bench1_fwd" || mode == "bench1_fwd_pad" || mode == "bench1_fwd_lens";
  const bool one_shape =
      mode == "bench1" || fwd_only || padding != Padding::kNone || mode == "prof";
  if (one_shape && (argc == 5 || argc == 6)) {
    const int D = std::atoi(argv[2]), S = std::atoi(argv[3]);
    const float dropout = argc == 6 ? std::strtof(argv[5], nullptr) : 0.f;
    Bench(16384 / S, S, 2048 / D, D, std::atoi(argv[4]) != 0, true, mode == "prof", 0.f,
          fwd_only, dropout, padding);
    return true;
  }
  if (mode == "bench" || mode == "bench_fp16") {
    for (int D : {64, 128})
      for (int S : {4096, 16384})
        for (bool causal : {false, true}) Bench(16384 / S, S, 2048 / D, D, causal, mode == "bench");
    return true;
  }
  if (mode == "bench_cap") {  // the bench shapes with a soft cap (its own Hopper bwd kernels)
    for (int D : {64, 128})
      for (int S : {4096, 16384})
        for (bool causal : {false, true}) Bench(16384 / S, S, 2048 / D, D, causal, true, false, 30.f);
    return true;
  }
  if (mode == "bench_fwd") {  // forward only, FA3 shapes (B * S = 16k, H * D = 2048), S 1k-16k
    for (int D : {64, 128})
      for (bool causal : {false, true})
        for (int S : {1024, 2048, 4096, 8192, 16384})
          Bench(16384 / S, S, 2048 / D, D, causal, true, false, 0.f, true);
    return true;
  }
  if (mode == "bench_d") {  // the other buckets, bf16, the FA3 shapes (H = 2048 / D rounded down)
    Bench(4, 4096, 64, 32, false, true);
    for (int D : {96, 192, 256})
      for (int S : {4096, 16384})
        for (bool causal : {false, true}) Bench(16384 / S, S, 2048 / D, D, causal, true);
    return true;
  }
  return false;
}
