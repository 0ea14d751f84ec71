// Kernel-level check of bias (+ dbias), dense mask and dropout in the CUDA
// launch API (cpp/cuda/launch.h), against a dense float64 reference computed
// here on the host. These problems all take the exact kernels (the
// tensor-core ones exclude the three features).
//
// For each case: random inputs rounded to the storage dtype, a bias in the
// accumulation type with some broadcast shape, a boolean mask (random, with
// fully False rows and a fully False tile), dropout with HeadDropout's mask
// drawn on the host by the very function the kernels (and the CPU) use;
// NaN-poisoned outputs; LaunchFwd then LaunchBwd; errors max|x - ref| /
// max|ref| of out, lse, dq, dk, dv, dbias. A second check recovers the
// dropout mask from the output (one-hot values: out row i *is* row i of the
// dropped, rescaled P) and compares it bit for bit with HeadDropout::Keep.
//
// Usage: exact_features_check [--small]   (--small: tiny cases, for compute-sanitizer)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/launch.h"
#include "jax_flash/dropout.h"
#include "jax_flash/mask.h"
#include "jax_flash/params.h"
#include "check_util.h"

using jax_flash::AttentionShape;
using jax_flash::BatchMask;
using jax_flash::BwdParams;
using jax_flash::DenseStrides;
using jax_flash::DropoutParams;
using jax_flash::HeadDropout;
using jax_flash::MaskParams;
using jax_flash::SeqStrides;
using jax_flash::cuda::DType;
using check::BroadcastStrides;
using check::DenseAt;
using check::DeviceArray;
using check::Error;
using check::RandomTensor;
using check::ToDouble;

namespace {

struct Dims4 {
  int64_t d[4] = {0, 0, 0, 0};  // all 0: absent
  bool present() const { return d[0] > 0 || d[1] > 0 || d[2] > 0 || d[3] > 0; }
  int64_t count() const { return d[0] * d[1] * d[2] * d[3]; }
};

struct Case {
  std::string name;
  DType dtype;
  int64_t B, Sq, Sk, Hq, Hkv, D;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  double softcap = 0.0;
  Dims4 bias, mask;  // each dim 1 or full
  double dropout = 0.0;
  int64_t key_batch = 1;
  bool broadcast_dropout = false;
};

// ---------------------------------------------------------------------------
// The dense float64 reference.

struct Reference {
  std::vector<double> out, lse, dq, dk, dv, dbias;
  // Largest sum of |dS| over the elements that make up one dbias element: the
  // scale of dbias's rounding error. A bias constant along the keys does not
  // change the softmax, so its exact gradient is ~0 and max|dbias| would be
  // no scale at all.
  std::vector<double> dbias_abs;
};

Reference ComputeReference(const Case& c, const MaskParams& mask_params,
                           const DropoutParams& dropout_params, const double* bias,
                           const DenseStrides& bias_strides, double scale,
                           const std::vector<double>& q, const std::vector<double>& k,
                           const std::vector<double>& v, const std::vector<double>& dout) {
  const int64_t B = c.B, Sq = c.Sq, Sk = c.Sk, Hq = c.Hq, Hkv = c.Hkv, D = c.D, G = Hq / Hkv;
  Reference r;
  r.out.assign(B * Sq * Hq * D, 0.0);
  r.lse.assign(B * Hq * Sq, -INFINITY);
  r.dq.assign(B * Sq * Hq * D, 0.0);
  r.dk.assign(B * Sk * Hkv * D, 0.0);
  r.dv.assign(B * Sk * Hkv * D, 0.0);
  r.dbias.assign(c.bias.present() ? c.bias.count() : 0, 0.0);
  r.dbias_abs.assign(r.dbias.size(), 0.0);
  const DenseStrides dbias_strides = BroadcastStrides(c.bias.d);
  const double keep_scale = dropout_params.keep_scale();  // of the rate rounded to 2^-8
  std::vector<double> x(Sk), dcap(Sk), prob(Sk), kept(Sk);
  std::vector<char> vis(Sk);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const BatchMask mask = BatchMask::For(mask_params, b, h, Sq, Sk);
      const HeadDropout drop = HeadDropout::For(dropout_params, B, b, h);
      const int64_t hk = h / G;
      for (int64_t i = 0; i < Sq; ++i) {
        const double* qi = &q[((b * Sq + i) * Hq + h) * D];
        double m = -INFINITY;
        for (int64_t j = 0; j < Sk; ++j) {
          vis[j] = mask.Visible(i, j);
          kept[j] = !drop.enabled ? 1.0 : (drop.Keep(i, j) ? keep_scale : 0.0);
          if (!vis[j]) continue;
          const double* kj = &k[((b * Sk + j) * Hkv + hk) * D];
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += qi[d] * kj[d];
          double s = scale * dot + (bias ? bias[DenseAt(bias_strides, b, h, i, j)] : 0.0);
          dcap[j] = 1.0;
          if (c.softcap > 0) {
            const double t = std::tanh(s / c.softcap);
            s = c.softcap * t;
            dcap[j] = 1.0 - t * t;
          }
          x[j] = s;
          m = std::max(m, s);
        }
        if (m == -INFINITY) continue;
        double l = 0;
        for (int64_t j = 0; j < Sk; ++j) l += vis[j] ? std::exp(x[j] - m) : 0.0;
        r.lse[(b * Hq + h) * Sq + i] = m + std::log(l);
        double* oi = &r.out[((b * Sq + i) * Hq + h) * D];
        for (int64_t j = 0; j < Sk; ++j) {
          prob[j] = vis[j] ? std::exp(x[j] - m) / l : 0.0;
          if (!vis[j]) continue;
          const double* vj = &v[((b * Sk + j) * Hkv + hk) * D];
          for (int64_t d = 0; d < D; ++d) oi[d] += kept[j] * prob[j] * vj[d];
        }
        const double* doi = &dout[((b * Sq + i) * Hq + h) * D];
        double delta = 0;
        for (int64_t d = 0; d < D; ++d) delta += doi[d] * oi[d];
        double* dqi = &r.dq[((b * Sq + i) * Hq + h) * D];
        for (int64_t j = 0; j < Sk; ++j) {
          if (!vis[j]) continue;
          const int64_t kv_at = ((b * Sk + j) * Hkv + hk) * D;
          double dp = 0;
          for (int64_t d = 0; d < D; ++d) dp += doi[d] * v[kv_at + d];
          const double ds = prob[j] * (kept[j] * dp - delta) * dcap[j];
          if (!r.dbias.empty()) {
            r.dbias[DenseAt(dbias_strides, b, h, i, j)] += ds;
            r.dbias_abs[DenseAt(dbias_strides, b, h, i, j)] += std::fabs(ds);
          }
          for (int64_t d = 0; d < D; ++d) {
            dqi[d] += scale * ds * k[kv_at + d];
            r.dk[kv_at + d] += scale * ds * qi[d];
            r.dv[kv_at + d] += kept[j] * prob[j] * doi[d];
          }
        }
      }
    }
  return r;
}

// Elementwise comparison of two arrays in the same layout.
template <typename T>
Error Compare(const std::vector<T>& got, const std::vector<double>& ref) {
  Error e;
  for (size_t at = 0; at < ref.size(); ++at) {
    const double x = ToDouble(got[at]), r = ref[at];
    if (std::isinf(r) && x == r) continue;  // lse of a fully masked row
    if (!std::isfinite(x) || !std::isfinite(r)) {
      ++e.bad_nonfinite;
      continue;
    }
    e.max_err = std::max(e.max_err, std::fabs(x - r));
    e.max_ref = std::max(e.max_ref, std::fabs(r));
  }
  return e;
}

// ---------------------------------------------------------------------------

template <typename T>
bool RunCase(const Case& c, uint64_t seed) {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  std::mt19937_64 rng(seed);
  const int64_t B = c.B, Sq = c.Sq, Sk = c.Sk, Hq = c.Hq, Hkv = c.Hkv, D = c.D;
  const size_t nq = B * Sq * Hq * D, nk = B * Sk * Hkv * D, nstat = B * Hq * Sq;

  std::vector<double> hq, hk, hv, hdo, hbias;
  DeviceArray<T> q(nq), k(nk), v(nk), dout(nq), out(nq), dq(nq), dk(nk), dv(nk);
  DeviceArray<Acc> lse(nstat);
  q.Upload(RandomTensor<T>(nq, rng, &hq));
  k.Upload(RandomTensor<T>(nk, rng, &hk));
  v.Upload(RandomTensor<T>(nk, rng, &hv));
  dout.Upload(RandomTensor<T>(nq, rng, &hdo));
  for (auto* a : {&out, &dq, &dk, &dv}) a->Poison();
  lse.Poison();

  // Bias in the accumulation type, in its own (broadcast) shape.
  const size_t nbias = c.bias.present() ? c.bias.count() : 0;
  DeviceArray<Acc> bias(nbias), dbias(nbias);
  const DenseStrides bias_strides = BroadcastStrides(c.bias.d);
  if (nbias) {
    bias.Upload(RandomTensor<Acc>(nbias, rng, &hbias));
    dbias.Poison();
  }

  // Boolean mask: 60% True, every row with i % 11 == 5 False (rows that see
  // nothing), and the tile i < 128, j < 64 of the first (b, h) False (a
  // whole tile for the kernels to skip).
  const size_t nmask = c.mask.present() ? c.mask.count() : 0;
  std::vector<uint8_t> hmask(nmask);
  const DenseStrides mask_strides = BroadcastStrides(c.mask.d);
  std::bernoulli_distribution coin(0.6);
  for (int64_t b = 0; b < c.mask.d[0]; ++b)
    for (int64_t h = 0; h < c.mask.d[1]; ++h)
      for (int64_t i = 0; i < c.mask.d[2]; ++i)
        for (int64_t j = 0; j < c.mask.d[3]; ++j) {
          bool keep = coin(rng);
          if (c.mask.d[2] > 1 && i % 11 == 5) keep = false;
          if (b == 0 && h == 0 && i < 128 && j < 64) keep = false;
          hmask[DenseAt(mask_strides, b, h, i, j)] = keep;
        }
  DeviceArray<uint8_t> dmask(nmask);
  dmask.Upload(hmask);

  // Dropout keys (key_batch, 2).
  std::vector<uint32_t> hkeys(2 * c.key_batch);
  for (auto& w : hkeys) w = static_cast<uint32_t>(rng());
  DeviceArray<uint32_t> dkeys(hkeys.size());
  dkeys.Upload(hkeys);

  MaskParams host_mask, device_mask;
  for (MaskParams* m : {&host_mask, &device_mask}) {
    m->causal = c.causal;
    m->window_left = c.window_left;
    m->window_right = c.window_right;
    m->dense_strides = mask_strides;
  }
  if (nmask) {
    host_mask.dense = hmask.data();
    device_mask.dense = dmask.ptr;
  }
  DropoutParams host_dropout, device_dropout;
  for (DropoutParams* d : {&host_dropout, &device_dropout}) {
    d->rate = c.dropout;
    d->key_batch = c.key_batch;
    d->broadcast_batch_and_heads = c.broadcast_dropout;
  }
  host_dropout.keys = hkeys.data();
  device_dropout.keys = dkeys.ptr;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));

  BwdParams p;
  p.shape = AttentionShape{B, Sq, Sk, Hq, Hkv, D};
  p.mask = device_mask;
  p.dropout = device_dropout;
  p.score.scale = scale;
  p.score.softcap = c.softcap;
  if (nbias) {
    p.score.bias = bias.ptr;
    p.score.bias_strides = bias_strides;
    for (int i = 0; i < 4; ++i) p.score.bias_dims[i] = c.bias.d[i];
    p.dbias = dbias.ptr;
  }
  p.q = q.ptr; p.k = k.ptr; p.v = v.ptr; p.out = out.ptr; p.lse = lse.ptr;
  p.dout = dout.ptr; p.dq = dq.ptr; p.dk = dk.ptr; p.dv = dv.ptr;
  check::SetContiguousStrides(&p);

  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  CHECK_CUDA(check::LaunchFwd(p, c.dtype, stream));
  DeviceArray<unsigned char> ws(jax_flash::cuda::BwdWorkspaceBytes(p.shape, c.dtype, true));
  ws.Poison();
  CHECK_CUDA(jax_flash::cuda::LaunchBwd(p, c.dtype, ws.ptr, /*deterministic=*/true, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  // Determinism: a second backward gives the same bits.
  const std::vector<T> dq_first = dq.Download();
  const std::vector<Acc> dbias_first = dbias.Download();
  CHECK_CUDA(jax_flash::cuda::LaunchBwd(p, c.dtype, ws.ptr, true, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_CUDA(cudaStreamDestroy(stream));
  const std::vector<T> dq_second = dq.Download();
  const std::vector<Acc> dbias_second = dbias.Download();
  const bool deterministic =
      std::memcmp(dq_first.data(), dq_second.data(), dq_first.size() * sizeof(T)) == 0 &&
      std::memcmp(dbias_first.data(), dbias_second.data(), dbias_first.size() * sizeof(Acc)) == 0;

  const Reference ref = ComputeReference(c, host_mask, host_dropout, nbias ? hbias.data() : nullptr,
                                         bias_strides, scale, hq, hk, hv, hdo);
  struct Named { const char* name; Error e; };
  std::vector<Named> errs = {{"out", Compare(out.Download(), ref.out)},
                             {"lse", Compare(lse.Download(), ref.lse)},
                             {"dq", Compare(dq_second, ref.dq)},
                             {"dk", Compare(dk.Download(), ref.dk)},
                             {"dv", Compare(dv.Download(), ref.dv)}};
  if (nbias) {
    Error e = Compare(dbias_second, ref.dbias);
    for (double a : ref.dbias_abs) e.max_ref = std::max(e.max_ref, a);
    errs.push_back({"dbias", e});
  }
  const double tol = check::ExactTolerance(c.dtype);
  bool ok = deterministic;
  std::string line;
  char buf[128];
  for (const Named& n : errs) {
    const bool good = n.e.bad_nonfinite == 0 && n.e.Normalized() <= tol;
    ok = ok && good;
    std::snprintf(buf, sizeof(buf), " %s=%.2e%s", n.name, n.e.Normalized(),
                  n.e.bad_nonfinite ? "(NONFINITE)" : "");
    line += buf;
  }
  std::printf("%-4s %-5s B%lld Sq%lld Sk%lld H%lld/%lld D%lld %-34s |%s%s\n", ok ? "ok" : "FAIL",
              check::DTypeName(c.dtype), (long long)B, (long long)Sq, (long long)Sk, (long long)Hq,
              (long long)Hkv, (long long)D, c.name.c_str(), line.c_str(),
              deterministic ? "" : " NOT-DETERMINISTIC");
  std::fflush(stdout);
  return ok;
}

bool Run(const Case& c, uint64_t seed) {
  switch (c.dtype) {
    case DType::kFloat32: return RunCase<float>(c, seed);
    case DType::kFloat64: return RunCase<double>(c, seed);
    case DType::kBFloat16: return RunCase<__nv_bfloat16>(c, seed);
    case DType::kFloat16: return RunCase<__half>(c, seed);
  }
  return false;
}

// Recovers the dropout mask from the kernel's output with one-hot values
// (V[j] = e_j, D = Sk: out[b, i, h, j] = Z P / (1 - rate)) and compares it
// with HeadDropout::Keep on the host, element by element.
bool RunDropoutRecovery(bool broadcast, int64_t key_batch, uint64_t seed) {
  const int64_t B = 2, Sq = 50, Sk = 64, Hq = 3, D = Sk;
  const double rate = 0.3;
  std::mt19937_64 rng(seed);
  std::vector<double> hq, hk;
  DeviceArray<float> q(B * Sq * Hq * D), k(B * Sk * Hq * D), v(B * Sk * Hq * D),
      out(B * Sq * Hq * D), lse(B * Hq * Sq);
  q.Upload(RandomTensor<float>(q.n, rng, &hq, 0.3));
  k.Upload(RandomTensor<float>(k.n, rng, &hk, 0.3));
  std::vector<float> hv(v.n, 0.0f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < Sk; ++j)
      for (int64_t h = 0; h < Hq; ++h) hv[((b * Sk + j) * Hq + h) * D + j] = 1.0f;
  v.Upload(hv);
  out.Poison();
  std::vector<uint32_t> hkeys(2 * key_batch);
  for (auto& w : hkeys) w = static_cast<uint32_t>(rng());
  DeviceArray<uint32_t> dkeys(hkeys.size());
  dkeys.Upload(hkeys);

  jax_flash::FwdParams p;
  p.shape = AttentionShape{B, Sq, Sk, Hq, Hq, D};
  p.score.scale = 1.0 / std::sqrt(static_cast<double>(D));
  p.dropout.rate = rate;
  p.dropout.keys = dkeys.ptr;
  p.dropout.key_batch = key_batch;
  p.dropout.broadcast_batch_and_heads = broadcast;
  p.q = q.ptr; p.k = k.ptr; p.v = v.ptr; p.out = out.ptr; p.lse = lse.ptr;
  p.q_strides = p.out_strides = SeqStrides::Contiguous(Sq, Hq, D);
  p.k_strides = p.v_strides = SeqStrides::Contiguous(Sk, Hq, D);
  CHECK_CUDA(check::LaunchFwd(p, DType::kFloat32, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  const std::vector<float> got = out.Download();

  DropoutParams host = p.dropout;
  host.keys = hkeys.data();
  int64_t mismatches = 0, kept = 0, total = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const HeadDropout drop = HeadDropout::For(host, B, b, h);
      for (int64_t i = 0; i < Sq; ++i)
        for (int64_t j = 0; j < Sk; ++j) {
          const float x = got[((b * Sq + i) * Hq + h) * D + j];
          const bool want = drop.Keep(i, j);
          mismatches += (x != 0.0f) != want || std::isnan(x);
          kept += want;
          ++total;
        }
    }
  const double keep_rate = double(kept) / double(total);
  const bool ok = mismatches == 0 && std::fabs(keep_rate - (1 - rate)) < 0.02;
  std::printf("%-4s dropout mask recovered from the output vs HeadDropout::Keep (broadcast=%d, "
              "key_batch=%lld): %lld of %lld differ, keep rate %.4f\n",
              ok ? "ok" : "FAIL", broadcast, (long long)key_batch, (long long)mismatches,
              (long long)total, keep_rate);
  std::fflush(stdout);
  return ok;
}

Case Make(std::string name, DType t, int64_t B, int64_t Sq, int64_t Sk, int64_t Hq, int64_t Hkv,
          int64_t D) {
  Case c;
  c.name = std::move(name);
  c.dtype = t;
  c.B = B; c.Sq = Sq; c.Sk = Sk; c.Hq = Hq; c.Hkv = Hkv; c.D = D;
  return c;
}

Dims4 Shape(int64_t a, int64_t b, int64_t c, int64_t d) {
  Dims4 s;
  s.d[0] = a; s.d[1] = b; s.d[2] = c; s.d[3] = d;
  return s;
}

std::vector<Case> SmallCases() {
  std::vector<Case> cases;
  Case a = Make("small bias+mask+dropout", DType::kFloat32, 2, 17, 33, 2, 1, 40);
  a.bias = Shape(2, 2, 17, 33); a.mask = Shape(1, 2, 17, 33); a.dropout = 0.25; a.softcap = 3.0;
  a.causal = true;
  cases.push_back(a);
  Case b = Make("small f64 bias(1,H,1,S) dropout", DType::kFloat64, 2, 9, 20, 2, 2, 72);
  b.bias = Shape(1, 2, 1, 20); b.dropout = 0.4; b.window_left = 3; b.window_right = 2;
  cases.push_back(b);
  return cases;
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  const DType all[] = {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16};
  for (DType t : all) {
    Case c = Make("bias(1,H,1,S) causal GQA", t, 2, 77, 130, 4, 2, 40);
    c.bias = Shape(1, 4, 1, 130); c.causal = true;
    cases.push_back(c);
    c = Make("bias full softcap", t, 2, 65, 70, 2, 1, 64);
    c.bias = Shape(2, 2, 65, 70); c.softcap = 5.0;
    cases.push_back(c);
    c = Make("bias(B,1,1,1) D72", t, 3, 40, 50, 2, 1, 72);
    c.bias = Shape(3, 1, 1, 1);
    cases.push_back(c);
    c = Make("bias(1,1,Sq,1) window", t, 1, 90, 100, 2, 2, 128);
    c.bias = Shape(1, 1, 90, 1); c.window_left = 16; c.window_right = 8;
    cases.push_back(c);
    c = Make("bias(1,H,Sq,Sk) window", t, 2, 90, 100, 2, 2, 32);
    c.bias = Shape(1, 2, 90, 100); c.window_left = 16; c.window_right = 8;
    cases.push_back(c);
    c = Make("mask full (rows, tile False)", t, 2, 150, 170, 2, 1, 32);
    c.mask = Shape(2, 2, 150, 170);
    cases.push_back(c);
    c = Make("mask(B,1,Sq,Sk)+bias(1,1,Sq,Sk)", t, 2, 150, 170, 4, 2, 64);
    c.mask = Shape(2, 1, 150, 170); c.bias = Shape(1, 1, 150, 170);
    cases.push_back(c);
    c = Make("mask(1,H,1,Sk) causal", t, 2, 70, 90, 2, 2, 40);
    c.mask = Shape(1, 2, 1, 90); c.causal = true;
    cases.push_back(c);
    c = Make("dropout 0.3 GQA keys2", t, 2, 100, 90, 4, 2, 64);
    c.dropout = 0.3; c.key_batch = 2;
    cases.push_back(c);
    c = Make("dropout broadcast D128", t, 2, 60, 75, 2, 1, 128);
    c.dropout = 0.2; c.broadcast_dropout = true;
    cases.push_back(c);
    c = Make("all: mask+bias+dropout+causal+cap", t, 2, 150, 170, 2, 1, 200);
    c.mask = Shape(2, 1, 150, 170); c.bias = Shape(1, 2, 1, 170); c.dropout = 0.3;
    c.causal = true; c.softcap = 4.0;
    cases.push_back(c);
  }
  Case c = Make("Sq1 bias(1,1,1,Sk)", DType::kFloat32, 1, 1, 5, 1, 1, 8);
  c.bias = Shape(1, 1, 1, 5);
  cases.push_back(c);
  c = Make("Sk0 bias(1,1,1,1)", DType::kFloat32, 2, 5, 0, 2, 1, 32);
  c.bias = Shape(1, 1, 1, 1);
  cases.push_back(c);
  c = Make("bigger bias(1,H,1,S) dropout causal", DType::kFloat32, 2, 512, 512, 4, 2, 64);
  c.bias = Shape(1, 4, 1, 512); c.dropout = 0.1; c.causal = true;
  cases.push_back(c);
  return cases;
}

}  // namespace

int main(int argc, char** argv) {
  bool small = false;
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--small")) small = true;
  check::PrintDevice();
  int failures = 0, total = 0;
  uint64_t seed = 4321;
  for (const Case& c : small ? SmallCases() : AllCases()) {
    failures += Run(c, seed++) ? 0 : 1;
    ++total;
  }
  if (!small) {
    for (auto [broadcast, key_batch] : {std::pair{false, int64_t{1}}, std::pair{false, int64_t{2}},
                                        std::pair{true, int64_t{1}}}) {
      failures += RunDropoutRecovery(broadcast, key_batch, seed++) ? 0 : 1;
      ++total;
    }
  }
  std::printf("%d of %d cases failed\n", failures, total);
  return failures == 0 ? 0 : 1;
}
