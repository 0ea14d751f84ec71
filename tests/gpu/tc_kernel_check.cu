// Standalone check and benchmark of the tensor-core kernels (cpp/cuda/sm80,
// sm90), through the launch API the FFI handlers call (cpp/cuda/launch.h);
// a case the dispatch would send to the exact kernels is reported and fails.
//
// Correctness: random bf16/fp16 inputs, NaN-poisoned outputs, compared with a
// float64 CPU reference by the FlashAttention rule: max error of the kernel
// <= 2 x max error of a plain same-dtype implementation (float math with the
// 16-bit roundings such an implementation makes: P, dS and outputs) + atol.
// The cases: tc_cases.h. Timing (the bench modes): tc_bench.h.
//
// Score terms: a dense boolean mask (MaskKind: its broadcast shape) and
// dropout (keys, rate), the reference drawing the keep mask from
// include/jax_flash/dropout.h on the host, so the kernels must drop exactly
// the elements the CPU drops.
//
// Build: tests/gpu/build.sh. Usage: tc_kernel_check [check|small|features|layout|bench|bench_fp16|
// bench_cap|bench_d|bench_fwd|bench1 D S causal [rate]|bench1_fwd D S causal [rate]|
// bench1_pad D S causal [rate]|bench1_fwd_pad D S causal [rate]|bench1_lens D S causal [rate]|
// bench1_fwd_lens D S causal [rate]|prof D S causal]
// (the _pad modes with the padding mask of the jax bench's `padding` row, dense with its tile map;
// the _lens modes with that padding as sequence lengths, the `lengths` row)
// check and features take an optional range, FIRST [COUNT]: those cases alone, with the
// seeds of the whole run, so that a long run (forced onto sm75) can be split over calls;
// CASES=<regex> keeps the cases whose names match.
// (tests/gpu/ab_run.sh checks and times variants of the kernels with it.)
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "check_util.h"
#include "cuda/dispatch.h"
#include "cuda/launch.h"
#include "dq_layout_check.h"
#include "tc_bench.h"
#include "tc_cases.h"

using namespace jax_flash;
using check::FromBits;
using check::ToBits;
using cuda::DType;
using cuda::KernelPath;

static float Round(float x, bool bf16) { return FromBits(ToBits(x, bf16), bf16); }

using Dev = check::DeviceBytes;  // never a null pointer, also for an empty tensor

// Reference outputs. Index (b, s, h, d) contiguous; lse (b, h, s).
struct Ref {
  std::vector<double> out, lse, dq, dk, dv, dbias;
};

// The bias on the host: its own dims, values (contiguous), strides
// broadcast to (B, Hq, Sq, Sk).
struct HostBias {
  int64_t dims[4] = {1, 1, 1, 1};
  std::vector<float> val;
  DenseStrides strides{};
  double At(int b, int h, int i, int j) const {
    if (val.empty()) return 0;
    return val[b * strides.batch + h * strides.head + i * strides.row + j * strides.col];
  }
  size_t Index(int b, int h, int i, int j) const {  // into dbias (the bias's own shape)
    const int64_t bb = dims[0] > 1 ? b : 0, hh = dims[1] > 1 ? h : 0, ii = dims[2] > 1 ? i : 0,
                  jj = dims[3] > 1 ? j : 0;
    return ((bb * dims[1] + hh) * dims[2] + ii) * dims[3] + jj;
  }
};

// exact = true: float64 everything. exact = false: the "plain same-dtype"
// implementation: float32 math, P / dS / outputs rounded to the dtype.
// mask_h and drop_h point to host arrays; with dropout Z (HeadDropout on the
// host) the output takes Z P / (1 - rate), dP = Z dO V^T / (1 - rate).
static void Reference(const Case& c, const MaskParams& mask_h, const DropoutParams& drop_h,
                      const HostBias& bias, const std::vector<float>& q,
                      const std::vector<float>& k, const std::vector<float>& v,
                      const std::vector<float>& dout, double scale, bool exact, Ref* r) {
  const int B = c.B, Sq = c.Sq, Sk = c.Sk, Hq = c.Hq, Hkv = c.Hkv, D = c.D, G = Hq / Hkv;
  auto rnd = [&](double x) { return exact ? x : (double)Round((float)x, c.bf16); };
  auto fl = [&](double x) { return exact ? x : (double)(float)x; };
  r->out.assign((size_t)B * Sq * Hq * D, 0);
  r->lse.assign((size_t)B * Hq * Sq, 0);
  r->dq.assign((size_t)B * Sq * Hq * D, 0);
  r->dk.assign((size_t)B * Sk * Hkv * D, 0);
  r->dv.assign((size_t)B * Sk * Hkv * D, 0);
  std::vector<double> dk_acc((size_t)B * Sk * Hq * D, 0), dv_acc((size_t)B * Sk * Hq * D, 0);
  // dS per (b, h, i, j) for dbias, summed over the broadcast dims after the loop.
  std::vector<double> ds_all(bias.val.empty() ? 0 : (size_t)B * Hq * Sq * Sk, 0);
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hq; ++h) {
      const int hk = h / G;
      const BatchMask m = BatchMask::WithBlocks(mask_h, b, h, Sq, Sk);
      const HeadDropout drop = HeadDropout::For(drop_h, B, b, h);
      const double keep_scale = drop_h.keep_scale();
      std::vector<double> x(Sk), p(Sk), dp(Sk), th(Sk), z(Sk);
      std::vector<char> vis(Sk);
      for (int i = 0; i < Sq; ++i) {
        const float* qi = &q[(((size_t)b * Sq + i) * Hq + h) * D];
        double mx = -INFINITY;
        for (int j = 0; j < Sk; ++j) {
          vis[j] = m.Visible(i, j);
          if (!vis[j]) continue;
          const float* kj = &k[(((size_t)b * Sk + j) * Hkv + hk) * D];
          double s = 0;
          for (int d = 0; d < D; ++d) s += (double)qi[d] * kj[d];
          s = fl(s) * scale + bias.At(b, h, i, j);
          th[j] = 0;
          if (c.softcap > 0) { th[j] = std::tanh(s / c.softcap); s = c.softcap * th[j]; }
          x[j] = s;
          mx = std::max(mx, s);
        }
        double l = 0;
        for (int j = 0; j < Sk; ++j) { p[j] = vis[j] ? std::exp(x[j] - mx) : 0; l += p[j]; }
        double* o = &r->out[(((size_t)b * Sq + i) * Hq + h) * D];
        r->lse[((size_t)b * Hq + h) * Sq + i] = l > 0 ? mx + std::log(l) : -INFINITY;
        if (l == 0) continue;
        for (int j = 0; j < Sk; ++j) {
          p[j] = p[j] / l;
          z[j] = !drop.enabled ? 1.0 : (drop.Keep(i, j) ? keep_scale : 0.0);
        }
        for (int d = 0; d < D; ++d) {
          double acc = 0;
          for (int j = 0; j < Sk; ++j)
            if (vis[j]) acc += rnd(p[j] * z[j]) * v[(((size_t)b * Sk + j) * Hkv + hk) * D + d];
          o[d] = rnd(acc);
        }
        // Backward: D = rowsum(dO * O) (from the rounded out, as the kernel).
        const float* doi = &dout[(((size_t)b * Sq + i) * Hq + h) * D];
        double Di = 0;
        for (int d = 0; d < D; ++d) Di += (double)doi[d] * o[d];
        for (int j = 0; j < Sk; ++j) {
          if (!vis[j]) { dp[j] = 0; continue; }
          const float* vj = &v[(((size_t)b * Sk + j) * Hkv + hk) * D];
          double s = 0;
          for (int d = 0; d < D; ++d) s += (double)doi[d] * vj[d];
          double ds = p[j] * (z[j] * s - Di) * (c.softcap > 0 ? 1 - th[j] * th[j] : 1.0);
          dp[j] = rnd(ds);  // dS, rounded as a 16-bit kernel would before its GEMMs
          // dbias takes dS before that rounding (float32 in the kernel).
          if (!ds_all.empty()) ds_all[(((size_t)b * Hq + h) * Sq + i) * Sk + j] = fl(ds);
        }
        double* dqi = &r->dq[(((size_t)b * Sq + i) * Hq + h) * D];
        for (int d = 0; d < D; ++d) {
          double acc = 0;
          for (int j = 0; j < Sk; ++j)
            if (vis[j]) acc += dp[j] * k[(((size_t)b * Sk + j) * Hkv + hk) * D + d];
          dqi[d] = acc * scale;
        }
        for (int j = 0; j < Sk; ++j) {
          if (!vis[j]) continue;
          double* dkj = &dk_acc[(((size_t)b * Sk + j) * Hq + h) * D];
          double* dvj = &dv_acc[(((size_t)b * Sk + j) * Hq + h) * D];
          const double pr = rnd(p[j] * z[j]);
          for (int d = 0; d < D; ++d) {
            dkj[d] += dp[j] * qi[d] * scale;
            dvj[d] += pr * doi[d];
          }
        }
      }
    }
  for (size_t e = 0; e < r->dq.size(); ++e) r->dq[e] = rnd(r->dq[e]);
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < Sk; ++j)
      for (int h = 0; h < Hq; ++h)
        for (int d = 0; d < D; ++d) {
          size_t src = (((size_t)b * Sk + j) * Hq + h) * D + d;
          size_t dst = (((size_t)b * Sk + j) * Hkv + h / G) * D + d;
          r->dk[dst] += dk_acc[src];
          r->dv[dst] += dv_acc[src];
        }
  for (auto& x : r->dk) x = rnd(x);
  for (auto& x : r->dv) x = rnd(x);
  r->dbias.assign(bias.val.size(), 0);
  if (!ds_all.empty())
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < Hq; ++h)
        for (int i = 0; i < Sq; ++i)
          for (int j = 0; j < Sk; ++j)
            r->dbias[bias.Index(b, h, i, j)] += ds_all[(((size_t)b * Hq + h) * Sq + i) * Sk + j];
  for (auto& x : r->dbias) x = fl(x);
}

struct Err { double max_abs = 0, rel_l2 = 0; bool nan = false; };
static Err Compare(const std::vector<double>& got, const std::vector<double>& ref) {
  Err e; double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(ref[i]) || std::isinf(got[i])) {
      if (!(std::isinf(ref[i]) && std::isinf(got[i]) && (ref[i] > 0) == (got[i] > 0))) e.nan = true;
      continue;
    }
    if (std::isnan(got[i])) { e.nan = true; continue; }
    double d = std::fabs(got[i] - ref[i]);
    e.max_abs = std::max(e.max_abs, d); num += d * d; den += ref[i] * ref[i];
  }
  e.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return e;
}

static bool RunCase(const Case& given, uint64_t seed, bool verbose = true) {
  // Under JAX_FLASH_FORCE_PATH=sm75 every case runs in float16 (check_util.h).
  Case c = given;
  if (check::RoutesAsTuring()) c.bf16 = false;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int B = c.B, Sq = c.Sq, Sk = c.Sk, Hq = c.Hq, Hkv = c.Hkv, D = c.D;
  const size_t nq = (size_t)B * Sq * Hq * D, nk = (size_t)B * Sk * Hkv * D;
  std::vector<float> q(nq), k(nk), v(nk), dout(nq);
  std::vector<uint16_t> qb(nq), kb(nk), vb(nk), dob(nq);
  auto fill = [&](std::vector<float>& f, std::vector<uint16_t>& bits, float sd) {
    for (size_t i = 0; i < f.size(); ++i) { bits[i] = ToBits(nd(rng) * sd, c.bf16); f[i] = FromBits(bits[i], c.bf16); }
  };
  fill(q, qb, 1.f); fill(k, kb, 1.f); fill(v, vb, 1.f); fill(dout, dob, 1.f);
  const double scale = 1.0 / std::sqrt((double)D);

  // Mask arrays: lengths in [0, S] (one batch fully hidden when B > 1),
  // segments in runs of random length.
  std::vector<int32_t> qlen(B), kvlen(B), qseg((size_t)B * Sq), kvseg((size_t)B * Sk);
  for (int b = 0; b < B; ++b) {
    qlen[b] = (b == 1) ? 0 : (int)(rng() % (Sq + 1));
    kvlen[b] = (int)(rng() % (Sk + 1));
    int s = 0; for (int i = 0; i < Sq; ++i) { if (rng() % c.seg_run == 0) ++s; qseg[(size_t)b * Sq + i] = s; }
    s = 0; for (int j = 0; j < Sk; ++j) { if (rng() % c.seg_run == 0) ++s; kvseg[(size_t)b * Sk + j] = s; }
  }
  MaskParams mh;
  mh.causal = c.causal; mh.window_left = c.wl; mh.window_right = c.wr;
  if (c.lengths) { mh.q_seqlens = qlen.data(); mh.kv_seqlens = kvlen.data(); }
  if (c.segments) { mh.q_segment_ids = qseg.data(); mh.kv_segment_ids = kvseg.data(); }
  // Dense mask: 16 x 16 blocks all hidden, all visible or random (so tiles
  // of every class appear), a few rows hidden entirely.
  int64_t md[4] = {1, 1, 1, 1};  // the mask's own dims
  if (c.mask == MaskKind::kFull) { md[0] = B; md[1] = Hq; md[2] = Sq; md[3] = Sk; }
  if (c.mask == MaskKind::kShared || c.mask == MaskKind::kCausal) { md[2] = Sq; md[3] = Sk; }
  if (c.mask == MaskKind::kPadding) { md[0] = B; md[3] = Sk; }
  std::vector<uint8_t> dense(md[0] * md[1] * md[2] * md[3]);
  {
    std::vector<uint8_t> block_kind(4096);
    for (auto& x : block_kind) x = rng() % 3;
    size_t e = 0;
    for (int64_t bb = 0; bb < md[0]; ++bb)
      for (int64_t hh = 0; hh < md[1]; ++hh)
        for (int64_t i = 0; i < md[2]; ++i) {
          const bool hidden_row = md[2] > 1 && rng() % 29 == 0;
          const int64_t pad = rng() % (Sk + 1);
          for (int64_t j = 0; j < md[3]; ++j, ++e) {
            const int kind = block_kind[((bb * 7 + hh * 5 + i / 16) * 31 + j / 16) % 4096];
            bool visible = kind == 1 || (kind == 2 && rng() % 2);
            if (c.mask == MaskKind::kPadding) visible = j < pad;
            if (c.mask == MaskKind::kCausal) visible = j <= i;
            dense[e] = (visible && !hidden_row) ? 1 : 0;
          }
        }
  }
  if (c.mask != MaskKind::kNone) {
    mh.dense = dense.data();
    mh.dense_strides = check::BroadcastStrides(md);
  }
  // A block mask (1, 1, R, C): cells hidden, visible at random, the
  // diagonal's visible (rows that see nothing are cases of their own).
  const int64_t cell_rows = check::CeilCells(Sq), cell_cols = check::CeilCells(Sk);
  std::vector<uint8_t> blocks(c.block_mask ? cell_rows * cell_cols : 0);
  for (int64_t r = 0; r < cell_rows && c.block_mask; ++r)
    for (int64_t cc = 0; cc < cell_cols; ++cc)
      blocks[r * cell_cols + cc] = r == cc || rng() % 2 == 0;
  if (c.block_mask) {
    mh.block = blocks.data();
    mh.block_strides = DenseStrides{0, 0, cell_cols, 1};
    mh.block_rows = cell_rows;
    mh.block_cols = cell_cols;
  }
  // The tile map (B, 1, R, C) of the segments, the dense mask and the block
  // mask, over all heads.
  auto term_visible = [&](int64_t b, int64_t h, int64_t i, int64_t j) {
    if (c.segments && qseg[(size_t)b * Sq + i] != kvseg[(size_t)b * Sk + j]) return false;
    if (c.block_mask && !blocks[(i / kBlockMaskBlock) * cell_cols + j / kBlockMaskBlock]) return false;
    return c.mask == MaskKind::kNone || dense[check::DenseAt(mh.dense_strides, b, h, i, j)] != 0;
  };
  const std::vector<uint8_t> cells =
      c.tile_map ? check::TileMapOf(term_visible, B, Hq, Sq, Sk) : std::vector<uint8_t>();
  // Bias: normal values (sd 2), in its own shape.
  HostBias hb;
  if (c.bias != BiasKind::kNone) {
    int64_t* bd = hb.dims;
    if (c.bias == BiasKind::kFull) { bd[0] = B; bd[1] = Hq; bd[2] = Sq; bd[3] = Sk; }
    if (c.bias == BiasKind::kHead) { bd[1] = Hq; bd[2] = Sq; bd[3] = Sk; }
    if (c.bias == BiasKind::kAlibi) { bd[1] = Hq; bd[3] = Sk; }
    if (c.bias == BiasKind::kRow) { bd[0] = B; bd[2] = Sq; }
    hb.val.resize(bd[0] * bd[1] * bd[2] * bd[3]);
    for (auto& x : hb.val) x = 2.f * nd(rng);
    // A 16-bit bias: its values rounded to the inputs' dtype, which the
    // kernels read.
    if (c.bias16)
      for (auto& x : hb.val) x = Round(x, c.bf16);
    hb.strides = check::BroadcastStrides(hb.dims);
  }
  // The bias as the kernels read it: float32, or 16-bit bits.
  const size_t bias_bytes = hb.val.size() * (c.bias16 ? 2 : 4);
  std::vector<uint16_t> bias_bits(c.bias16 ? hb.val.size() : 0);
  for (size_t i = 0; i < bias_bits.size(); ++i) bias_bits[i] = ToBits(hb.val[i], c.bf16);
  // Dropout keys: (1, 2) or (B, 2).
  std::vector<uint32_t> keys(2 * B);
  for (auto& x : keys) x = static_cast<uint32_t>(rng());
  DropoutParams drop_h;
  drop_h.rate = c.dropout;
  drop_h.keys = keys.data();
  drop_h.key_batch = c.key_per_batch ? B : 1;

  Dev dq_(nq * 2), dk_(nk * 2), dv_(nk * 2), ddo(nq * 2), dout_(nq * 2), dlse((size_t)B * Hq * Sq * 4),
      ddq(nq * 2), ddk(nk * 2), ddv(nk * 2), dql(B * 4), dkl(B * 4),
      dqs((size_t)B * Sq * 4), dks((size_t)B * Sk * 4), ddense(dense.size()), dkeys(keys.size() * 4),
      dbias_in(bias_bytes), ddbias(hb.val.size() * 4), dcells(cells.size()),
      dblocks(blocks.size());
  if (!blocks.empty())
    CHECK_CUDA(cudaMemcpy(dblocks.p(), blocks.data(), blocks.size(), cudaMemcpyHostToDevice));
  if (!cells.empty())
    CHECK_CUDA(cudaMemcpy(dcells.p(), cells.data(), cells.size(), cudaMemcpyHostToDevice));
  if (!hb.val.empty())
    CHECK_CUDA(cudaMemcpy(dbias_in.p(),
                          c.bias16 ? static_cast<const void*>(bias_bits.data()) : hb.val.data(),
                          bias_bytes, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(ddense.p(), dense.data(), dense.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dkeys.p(), keys.data(), keys.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dq_.p(), qb.data(), nq * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dk_.p(), kb.data(), nk * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dv_.p(), vb.data(), nk * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(ddo.p(), dob.data(), nq * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dql.p(), qlen.data(), B * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dkl.p(), kvlen.data(), B * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dqs.p(), qseg.data(), (size_t)B * Sq * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dks.p(), kvseg.data(), (size_t)B * Sk * 4, cudaMemcpyHostToDevice));
  // Poison: 0xFF bytes are NaN in bf16, fp16 and float32.
  for (Dev* d : {&dout_, &dlse, &ddq, &ddk, &ddv, &ddbias}) CHECK_CUDA(cudaMemset(d->p(), 0xFF, d->n));

  BwdParams p;
  p.shape = AttentionShape{B, Sq, Sk, Hq, Hkv, D};
  p.mask = mh;
  if (c.lengths) { p.mask.q_seqlens = (int32_t*)dql.p(); p.mask.kv_seqlens = (int32_t*)dkl.p(); }
  if (c.segments) { p.mask.q_segment_ids = (int32_t*)dqs.p(); p.mask.kv_segment_ids = (int32_t*)dks.p(); }
  if (c.block_mask) p.mask.block = (const uint8_t*)dblocks.p();
  if (!cells.empty()) {
    const int64_t rows = check::CeilCells(Sq), cols = check::CeilCells(Sk);
    p.mask.tile_map = (const uint8_t*)dcells.p();
    p.mask.tile_map_strides = DenseStrides{rows * cols, 0, cols, 1};
    p.mask.tile_map_rows = rows;
    p.mask.tile_map_cols = cols;
  }
  if (c.mask != MaskKind::kNone) p.mask.dense = (const uint8_t*)ddense.p();
  p.dropout = drop_h;
  p.dropout.keys = (const uint32_t*)dkeys.p();
  p.score.scale = scale; p.score.softcap = c.softcap;
  if (!hb.val.empty()) {
    p.score.bias = dbias_in.p();
    p.score.bias_type = !c.bias16 ? BiasType::kAcc : c.bf16 ? BiasType::kBFloat16 : BiasType::kFloat16;
    p.score.bias_strides = hb.strides;
    for (int d = 0; d < 4; ++d) p.score.bias_dims[d] = hb.dims[d];
    p.dbias = ddbias.p();
  }
  p.q = dq_.p(); p.k = dk_.p(); p.v = dv_.p(); p.out = dout_.p(); p.lse = dlse.p();
  check::SetContiguousStrides(&p);
  p.dout = ddo.p(); p.dq = ddq.p(); p.dk = ddk.p(); p.dv = ddv.p();

  const DType dtype = check::DType16(c.bf16);
  const KernelPath fwd_path = cuda::FwdPath(p, dtype), bwd_path = cuda::BwdPath(p, dtype, c.det);
  if (fwd_path == KernelPath::kExact || bwd_path == KernelPath::kExact) {
    std::printf("UNSUPPORTED (exact kernels) %s\n", c.name().c_str());
    return false;
  }
  CHECK_CUDA(check::LaunchFwd(p, dtype, nullptr));
  CHECK_CUDA(cudaGetLastError());
  // The workspace starts with delta (cuda/bwd/workspace.h).
  size_t ws_bytes = cuda::BwdWorkspaceBytes(p.shape, dtype, c.det);
  Dev ws(ws_bytes);
  CHECK_CUDA(cudaMemset(ws.p(), 0xFF, ws.n));
  CHECK_CUDA(cuda::LaunchBwd(p, dtype, ws.p(), c.det, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());

  auto fetch16 = [&](const Dev& d, size_t n) {
    std::vector<uint16_t> bits(n); CHECK_CUDA(cudaMemcpy(bits.data(), d.p(), n * 2, cudaMemcpyDeviceToHost));
    std::vector<double> r(n); for (size_t i = 0; i < n; ++i) r[i] = FromBits(bits[i], c.bf16); return r;
  };
  std::vector<double> out = fetch16(dout_, nq), gdq = fetch16(ddq, nq), gdk = fetch16(ddk, nk),
                      gdv = fetch16(ddv, nk);
  std::vector<float> lsef((size_t)B * Hq * Sq);
  CHECK_CUDA(cudaMemcpy(lsef.data(), dlse.p(), lsef.size() * 4, cudaMemcpyDeviceToHost));
  std::vector<double> lse(lsef.begin(), lsef.end());
  auto fetch32 = [&](const Dev& d, size_t n) {
    std::vector<float> f(n); CHECK_CUDA(cudaMemcpy(f.data(), d.p(), n * 4, cudaMemcpyDeviceToHost));
    return std::vector<double>(f.begin(), f.end());
  };
  const std::vector<double> gdbias = fetch32(ddbias, hb.val.size());

  // Determinism: a second backward must match bitwise in deterministic mode.
  bool det_ok = true;
  if (c.det) {
    CHECK_CUDA(cudaMemset(ddq.p(), 0xFF, ddq.n));
    CHECK_CUDA(cuda::LaunchBwd(p, dtype, ws.p(), c.det, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<uint16_t> a(nq); CHECK_CUDA(cudaMemcpy(a.data(), ddq.p(), nq * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < nq; ++i) det_ok &= FromBits(a[i], c.bf16) == gdq[i] || (std::isnan(gdq[i]));
    const std::vector<double> again = fetch32(ddbias, hb.val.size());  // bitwise too
    for (size_t i = 0; i < again.size(); ++i) det_ok &= again[i] == gdbias[i];
  }

  Ref exact, plain;
  Reference(c, mh, drop_h, hb, q, k, v, dout, scale, true, &exact);
  Reference(c, mh, drop_h, hb, q, k, v, dout, scale, false, &plain);
  bool ok = det_ok;
  std::string msg;
  const char* names[] = {"out", "lse", "dq", "dk", "dv", "dbias"};
  const std::vector<double>* got[] = {&out, &lse, &gdq, &gdk, &gdv, &gdbias};
  const std::vector<double>* ex[] = {&exact.out, &exact.lse, &exact.dq, &exact.dk, &exact.dv, &exact.dbias};
  const std::vector<double>* pl[] = {&plain.out, &plain.lse, &plain.dq, &plain.dk, &plain.dv, &plain.dbias};
  for (int t = 0; t < (hb.val.empty() ? 5 : 6); ++t) {
    Err ek = Compare(*got[t], *ex[t]), ep = Compare(*pl[t], *ex[t]);
    double scale_ref = 0; for (double x : *ex[t]) if (std::isfinite(x)) scale_ref = std::max(scale_ref, std::fabs(x));
    // The tiny slack of tests/conftest.py's rule (RELATIVE_ATOL): under one
    // rounding of the largest value. It matters only where the plain
    // implementation is exact, e.g. one key: P = 1, and dS = P (dP - D) is 0
    // in float64 but a few float ulps of |dP| in any kernel that computes dP
    // on tensor cores and D = rowsum(dO o O) separately (FA2 and FA3 alike).
    const double rel_atol = c.bf16 ? 1e-3 : 0x1p-11;
    const double atol = rel_atol * std::max(1.0, scale_ref) + (t == 1 ? 1e-4 : 0);
    bool pass = !ek.nan && ek.max_abs <= 2 * ep.max_abs + atol;
    ok &= pass;
    char buf[200];
    std::snprintf(buf, sizeof buf, " %s[%.1e/%.1e rel%.1e%s]", names[t], ek.max_abs, ep.max_abs, ek.rel_l2,
                  ek.nan ? " NaN/inf-mismatch" : (pass ? "" : " FAIL"));
    msg += buf;
  }
  if (verbose || !ok)
    std::printf("%s %-60s%s%s [%s/%s]\n", ok ? "PASS" : "FAIL", c.name().c_str(), msg.c_str(),
                det_ok ? "" : " NONDET", check::PathName(fwd_path), check::PathName(bwd_path));
  return ok;
}

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "check";
  if (mode == "small") {  // for compute-sanitizer
    bool ok = true;
    for (const SeededCase& s : SmallCases()) ok &= RunCase(s.c, s.seed);
    std::printf(ok ? "SMALL OK\n" : "SMALL FAILED\n");
    return ok ? 0 : 1;
  }
  if (RunBenchMode(mode, argc, argv)) return 0;
  // The dQ accumulator's layout, on the host (dq_layout_check.h): before any
  // case, whose backward would fail anyway but less legibly.
  const bool layout_ok = check::DqAccumLayoutOk();
  if (mode == "layout") return layout_ok ? 0 : 1;
  std::vector<Case> cases;
  if (mode == "features") AddFeatureCases(&cases);  // the score terms alone (also part of check)
  else AddCheckCases(&cases);
  const size_t first = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 0;
  const size_t count = argc > 3 ? std::strtoul(argv[3], nullptr, 10) : cases.size();
  const size_t end = std::min(cases.size(), first + std::min(count, cases.size()));
  // CASES=<regex>: only the cases whose names match (one head-dim bucket's,
  // when a variant changed only its kernels), with their seeds of the whole run.
  const char* filter = std::getenv("CASES");
  const std::regex re(filter ? filter : "");
  int fails = !layout_ok;
  size_t ran = 0;
  for (size_t i = first; i < end; ++i) {
    if (filter && !std::regex_search(cases[i].name(), re)) continue;
    fails += !RunCase(cases[i], 100 + i);
    ++ran;
  }
  std::printf("%s: %d of %zu cases failed", fails ? "FAILED" : "ALL PASSED", fails, ran);
  if (ran != cases.size())
    std::printf(" (%s cases %zu-%zu of %zu)", filter ? filter : "", first, end, cases.size());
  std::printf("\n");
  return fails ? 1 : 0;
}
