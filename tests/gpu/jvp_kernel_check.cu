// Kernel-level check of the forward-mode derivative (JVP) kernels through the
// launch API the FFI handler calls (cuda/launch.h: LaunchFwd, then LaunchJvp
// on its out and lse), against the analytic JVP computed here in float64:
//   x = cap tanh((scale q.k + bias) / cap),  P = exp(x - lse),
//   dS = (scale (q_dot.k + q.k_dot) + bias_dot) * dx/dlogit,
//   lse_dot = sum_j P dS,   out_dot = sum_j Pd ((dS - lse_dot) v + v_dot)
// (Pd: P with the forward's dropout applied, HeadDropout drawn on the host).
//
// Every case names the path it must take (exact, sm80 or sm75,
// cuda/dispatch.h) and fails if the dispatch picks another. Under
// JAX_FLASH_FORCE_PATH=sm75 the tensor-core cases run in float16 and must
// take the Turing family (check::RoutesAsTuring). float32/float64: max|x - ref| /
// max|ref| within check::ExactTolerance. bf16/fp16: out_dot by the
// FlashAttention rule, error <= 2 x that of a plain same-dtype
// implementation (float math, P and P o dS rounded to the dtype as a
// tensor-core kernel feeds them to its GEMMs, outputs rounded) + a tiny
// atol; lse_dot (float32) within 1e-4 of max|ref|. Outputs are NaN-poisoned;
// absent tangents are null pointers.
//
// Build: tests/gpu/build.sh. Usage: jvp_kernel_check [check|small|bench|bench_terms]
//   small: tiny cases, for compute-sanitizer; bench: JVP vs forward time;
//   bench_terms: the same with dropout 0.1 (both on their kTerms kernels).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "check_util.h"
#include "cuda/dispatch.h"
#include "cuda/launch.h"
#include "jax_flash/dropout.h"
#include "jax_flash/mask.h"
#include "jax_flash/params.h"

using namespace jax_flash;
using check::BroadcastStrides;
using check::DenseAt;
using check::DeviceArray;
using check::Error;
using check::RandomTensor;
using check::ToDouble;
using cuda::DType;
using cuda::KernelPath;

namespace {

// Which tangents a case passes (the others are absent, i.e. zero).
enum Tangent : unsigned { kQDot = 1, kKDot = 2, kVDot = 4, kBiasDot = 8, kAll = 15 };

struct Dims4 {
  int64_t d[4] = {0, 0, 0, 0};  // all 0: absent
  bool present() const { return d[0] > 0; }
  int64_t count() const { return d[0] * d[1] * d[2] * d[3]; }
};

struct Case {
  std::string name;
  DType dtype;
  int64_t B, Sq, Sk, Hq, Hkv, D;
  KernelPath expect;
  bool causal = false, lengths = false, segments = false, broadcast_dropout = false;
  int64_t window_left = -1, window_right = -1;
  double softcap = 0.0, dropout = 0.0;
  Dims4 bias, mask;
  unsigned tangents = kAll;
};

template <typename T>
double RoundTo(double x) {
  return ToDouble(check::FromDouble<T>(x));
}

// The host inputs (rounded to the storage type, as doubles; zeros for an
// absent tangent) and the mask and dropout in their host form.
struct HostProblem {
  std::vector<double> q, k, v, q_dot, k_dot, v_dot, bias, bias_dot;
  DenseStrides bias_strides;
  MaskParams mask;
  DropoutParams dropout;
  double scale;
};

struct Reference {
  std::vector<double> out_dot, lse_dot;  // float64
  std::vector<double> plain_out_dot;     // the plain same-dtype implementation (16-bit only)
};

template <typename T>
Reference ComputeReference(const Case& c, const HostProblem& hp) {
  const int64_t B = c.B, Sq = c.Sq, Sk = c.Sk, Hq = c.Hq, Hkv = c.Hkv, D = c.D, G = Hq / Hkv;
  constexpr bool kPlain = !std::is_same_v<T, float> && !std::is_same_v<T, double>;
  Reference r;
  r.out_dot.assign(B * Sq * Hq * D, 0.0);
  r.lse_dot.assign(B * Hq * Sq, 0.0);
  r.plain_out_dot.assign(kPlain ? r.out_dot.size() : 0, 0.0);
  const double keep_scale = hp.dropout.keep_scale();
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const BatchMask mask = BatchMask::For(hp.mask, b, h, Sq, Sk);
      const HeadDropout drop = HeadDropout::For(hp.dropout, B, b, h);
      const int64_t hk = h / G;
      std::vector<double> x(Sk), ds(Sk), p(Sk), keep(Sk), out(D), acc(D);
      std::vector<char> vis(Sk);
      for (int64_t i = 0; i < Sq; ++i) {
        const double* qi = &hp.q[((b * Sq + i) * Hq + h) * D];
        const double* qdi = &hp.q_dot[((b * Sq + i) * Hq + h) * D];
        double m = -INFINITY;
        for (int64_t j = 0; j < Sk; ++j) {
          vis[j] = mask.Visible(i, j);
          if (!vis[j]) continue;
          const double* kj = &hp.k[((b * Sk + j) * Hkv + hk) * D];
          const double* kdj = &hp.k_dot[((b * Sk + j) * Hkv + hk) * D];
          double dot = 0, ddot = 0;
          for (int64_t d = 0; d < D; ++d) {
            dot += qi[d] * kj[d];
            ddot += qdi[d] * kj[d] + qi[d] * kdj[d];
          }
          const int64_t at = DenseAt(hp.bias_strides, b, h, i, j);
          double s = hp.scale * dot + (hp.bias.empty() ? 0.0 : hp.bias[at]);
          double dlogit = hp.scale * ddot + (hp.bias_dot.empty() ? 0.0 : hp.bias_dot[at]);
          if (c.softcap > 0) {
            const double t = std::tanh(s / c.softcap);
            s = c.softcap * t;
            dlogit *= 1.0 - t * t;
          }
          x[j] = s;
          ds[j] = dlogit;
          keep[j] = !drop.enabled ? 1.0 : (drop.Keep(i, j) ? keep_scale : 0.0);
          m = std::max(m, s);
        }
        double l = 0;
        for (int64_t j = 0; j < Sk; ++j) l += vis[j] ? std::exp(x[j] - m) : 0.0;
        if (l == 0) continue;  // sees nothing: out_dot = 0, lse_dot = 0
        const double lse = m + std::log(l);
        double lse_dot = 0;
        for (int64_t j = 0; j < Sk; ++j) {
          p[j] = vis[j] ? std::exp(x[j] - lse) : 0.0;
          lse_dot += p[j] * (vis[j] ? ds[j] : 0.0);
        }
        r.lse_dot[(b * Hq + h) * Sq + i] = lse_dot;
        double* od = &r.out_dot[((b * Sq + i) * Hq + h) * D];
        std::fill(out.begin(), out.end(), 0.0);
        std::fill(acc.begin(), acc.end(), 0.0);
        float plain_lse_dot = 0.f;
        for (int64_t j = 0; j < Sk; ++j) {
          if (!vis[j]) continue;
          const double* vj = &hp.v[((b * Sk + j) * Hkv + hk) * D];
          const double* vdj = &hp.v_dot[((b * Sk + j) * Hkv + hk) * D];
          const double pd = p[j] * keep[j];
          for (int64_t d = 0; d < D; ++d) {
            od[d] += pd * ((ds[j] - lse_dot) * vj[d] + vdj[d]);
            out[d] += pd * vj[d];
          }
          if constexpr (kPlain) {
            const float pf = std::exp(static_cast<float>(x[j]) - static_cast<float>(lse));
            const float dsf = static_cast<float>(ds[j]);
            plain_lse_dot += pf * dsf;
            const double pd16 = RoundTo<T>(pf * static_cast<float>(keep[j]));
            const double pds16 = RoundTo<T>(pf * dsf * static_cast<float>(keep[j]));
            for (int64_t d = 0; d < D; ++d)
              acc[d] = static_cast<float>(acc[d] + static_cast<float>(pds16 * vj[d] + pd16 * vdj[d]));
          }
        }
        if constexpr (kPlain) {
          double* pod = &r.plain_out_dot[((b * Sq + i) * Hq + h) * D];
          for (int64_t d = 0; d < D; ++d)
            pod[d] = RoundTo<T>(static_cast<float>(acc[d]) -
                                plain_lse_dot * static_cast<float>(RoundTo<T>(out[d])));
        }
      }
    }
  return r;
}

template <typename T>
Error Compare(const std::vector<T>& got, const std::vector<double>& ref) {
  Error e;
  for (size_t at = 0; at < ref.size(); ++at) {
    const double x = ToDouble(got[at]), r = ref[at];
    if (!std::isfinite(x) || !std::isfinite(r)) {
      ++e.bad_nonfinite;
      continue;
    }
    e.max_err = std::max(e.max_err, std::fabs(x - r));
    e.max_ref = std::max(e.max_ref, std::fabs(r));
  }
  return e;
}

template <typename T>
bool RunCase(const Case& c, uint64_t seed) {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  std::mt19937_64 rng(seed);
  const int64_t B = c.B, Sq = c.Sq, Sk = c.Sk, Hq = c.Hq, Hkv = c.Hkv, D = c.D;
  const size_t nq = B * Sq * Hq * D, nk = B * Sk * Hkv * D, nstat = B * Hq * Sq;
  HostProblem hp;
  hp.scale = 1.0 / std::sqrt(static_cast<double>(D));

  DeviceArray<T> q(nq), k(nk), v(nk), out(nq), out_dot(nq);
  DeviceArray<Acc> lse(nstat), lse_dot(nstat);
  q.Upload(RandomTensor<T>(nq, rng, &hp.q));
  k.Upload(RandomTensor<T>(nk, rng, &hp.k));
  v.Upload(RandomTensor<T>(nk, rng, &hp.v));
  // A tangent operand: random when the case passes it, else absent (zeros
  // on the host, a null pointer for the kernel).
  DeviceArray<T> q_dot((c.tangents & kQDot) ? nq : 0), k_dot((c.tangents & kKDot) ? nk : 0),
      v_dot((c.tangents & kVDot) ? nk : 0);
  for (auto [dev, host, n] : {std::tuple{&q_dot, &hp.q_dot, nq}, std::tuple{&k_dot, &hp.k_dot, nk},
                              std::tuple{&v_dot, &hp.v_dot, nk}}) {
    if (dev->n) dev->Upload(RandomTensor<T>(n, rng, host));
    else host->assign(n, 0.0);
  }
  for (auto* a : {&out, &out_dot}) a->Poison();
  lse.Poison();
  lse_dot.Poison();

  const size_t nbias = c.bias.present() ? c.bias.count() : 0;
  hp.bias_strides = BroadcastStrides(c.bias.d);
  DeviceArray<Acc> bias(nbias), bias_dot((c.tangents & kBiasDot) ? nbias : 0);
  if (nbias) {
    bias.Upload(RandomTensor<Acc>(nbias, rng, &hp.bias));
    if (c.tangents & kBiasDot) bias_dot.Upload(RandomTensor<Acc>(nbias, rng, &hp.bias_dot));
  }

  // Dense mask: 60% True, rows i % 11 == 5 False (rows that see nothing).
  const size_t nmask = c.mask.present() ? c.mask.count() : 0;
  std::vector<uint8_t> hmask(nmask);
  const DenseStrides mask_strides = BroadcastStrides(c.mask.d);
  std::bernoulli_distribution coin(0.6);
  for (int64_t b = 0; b < c.mask.d[0]; ++b)
    for (int64_t h = 0; h < c.mask.d[1]; ++h)
      for (int64_t i = 0; i < c.mask.d[2]; ++i)
        for (int64_t j = 0; j < c.mask.d[3]; ++j)
          hmask[DenseAt(mask_strides, b, h, i, j)] = coin(rng) && !(c.mask.d[2] > 1 && i % 11 == 5);
  DeviceArray<uint8_t> dmask(nmask);
  dmask.Upload(hmask);
  // Lengths: batch 0 a little short, batch 1 sees no key at all.
  std::vector<int32_t> q_lens(B), kv_lens(B), q_seg(B * Sq), kv_seg(B * Sk);
  for (int64_t b = 0; b < B; ++b) {
    q_lens[b] = static_cast<int32_t>(b == 0 ? Sq - 3 : Sq);
    kv_lens[b] = static_cast<int32_t>(b == 0 ? Sk - 5 : b == 1 ? 0 : Sk);
  }
  // Segments: three per sequence, the query's and key's cut at other places.
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < Sq; ++i) q_seg[b * Sq + i] = static_cast<int32_t>(3 * i / Sq);
    for (int64_t j = 0; j < Sk; ++j) kv_seg[b * Sk + j] = static_cast<int32_t>((3 * j + 1) / Sk);
  }
  DeviceArray<int32_t> d_q_lens(B), d_kv_lens(B), d_q_seg(B * Sq), d_kv_seg(B * Sk);
  d_q_lens.Upload(q_lens); d_kv_lens.Upload(kv_lens);
  d_q_seg.Upload(q_seg); d_kv_seg.Upload(kv_seg);
  std::vector<uint32_t> hkeys = {static_cast<uint32_t>(rng()), static_cast<uint32_t>(rng())};
  DeviceArray<uint32_t> dkeys(2);
  dkeys.Upload(hkeys);

  MaskParams device_mask;
  DropoutParams device_dropout;
  for (MaskParams* m : {&hp.mask, &device_mask}) {
    m->causal = c.causal;
    m->window_left = c.window_left;
    m->window_right = c.window_right;
    m->dense_strides = mask_strides;
  }
  for (DropoutParams* d : {&hp.dropout, &device_dropout}) {
    d->rate = c.dropout;
    d->key_batch = 1;
    d->broadcast_batch_and_heads = c.broadcast_dropout;
  }
  if (nmask) { hp.mask.dense = hmask.data(); device_mask.dense = dmask.ptr; }
  if (c.lengths) {
    hp.mask.q_seqlens = q_lens.data(); hp.mask.kv_seqlens = kv_lens.data();
    device_mask.q_seqlens = d_q_lens.ptr; device_mask.kv_seqlens = d_kv_lens.ptr;
  }
  if (c.segments) {
    hp.mask.q_segment_ids = q_seg.data(); hp.mask.kv_segment_ids = kv_seg.data();
    device_mask.q_segment_ids = d_q_seg.ptr; device_mask.kv_segment_ids = d_kv_seg.ptr;
  }
  hp.dropout.keys = hkeys.data();
  device_dropout.keys = dkeys.ptr;

  JvpParams p;
  p.shape = AttentionShape{B, Sq, Sk, Hq, Hkv, D};
  p.mask = device_mask;
  p.dropout = device_dropout;
  p.score.scale = hp.scale;
  p.score.softcap = c.softcap;
  if (nbias) {
    p.score.bias = bias.ptr;
    p.score.bias_strides = hp.bias_strides;
    for (int i = 0; i < 4; ++i) p.score.bias_dims[i] = c.bias.d[i];
    p.bias_dot = bias_dot.ptr;
  }
  p.q = q.ptr; p.k = k.ptr; p.v = v.ptr; p.out = out.ptr; p.lse = lse.ptr;
  p.q_dot = q_dot.ptr; p.k_dot = k_dot.ptr; p.v_dot = v_dot.ptr;
  p.out_dot = out_dot.ptr; p.lse_dot = lse_dot.ptr;
  p.q_strides = p.out_strides = p.q_dot_strides = p.out_dot_strides =
      SeqStrides::Contiguous(Sq, Hq, D);
  p.k_strides = p.v_strides = p.k_dot_strides = p.v_dot_strides =
      SeqStrides::Contiguous(Sk, Hkv, D);

  const KernelPath path = cuda::JvpPath(p, c.dtype);
  CHECK_CUDA(check::LaunchFwd(p, c.dtype, nullptr));
  CHECK_CUDA(cuda::LaunchJvp(p, c.dtype, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());

  const Reference ref = ComputeReference<T>(c, hp);
  const Error e_out = Compare(out_dot.Download(), ref.out_dot);
  const Error e_lse = Compare(lse_dot.Download(), ref.lse_dot);
  bool ok = path == c.expect && e_out.bad_nonfinite == 0 && e_lse.bad_nonfinite == 0;
  char detail[160];
  if (c.dtype == DType::kFloat32 || c.dtype == DType::kFloat64) {
    const double tol = check::ExactTolerance(c.dtype);
    ok = ok && e_out.Normalized() <= tol && e_lse.Normalized() <= tol;
    std::snprintf(detail, sizeof detail, "out_dot=%.2e lse_dot=%.2e (tol %.0e)",
                  e_out.Normalized(), e_lse.Normalized(), tol);
  } else {
    const double plain = Compare(ref.plain_out_dot, ref.out_dot).max_err;
    const double atol = 1e-5 * std::max(1.0, e_out.max_ref);
    ok = ok && e_out.max_err <= 2 * plain + atol && e_lse.Normalized() <= 1e-4;
    std::snprintf(detail, sizeof detail, "out_dot err %.2e (plain %.2e, |ref| %.2g) lse_dot=%.2e",
                  e_out.max_err, plain, e_out.max_ref, e_lse.Normalized());
  }
  std::printf("%-4s %-5s %-5s B%lld Sq%lld Sk%lld H%lld/%lld D%lld %-30s | %s%s\n",
              ok ? "ok" : "FAIL", check::DTypeName(c.dtype), check::PathName(path), (long long)B,
              (long long)Sq, (long long)Sk, (long long)Hq, (long long)Hkv, (long long)D,
              c.name.c_str(), detail, path == c.expect ? "" : " WRONG-PATH");
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

Case Make(std::string name, DType t, int64_t B, int64_t Sq, int64_t Sk, int64_t Hq, int64_t Hkv,
          int64_t D, KernelPath expect) {
  Case c;
  c.name = std::move(name);
  c.dtype = t;
  c.B = B; c.Sq = Sq; c.Sk = Sk; c.Hq = Hq; c.Hkv = Hkv; c.D = D;
  c.expect = expect;
  return c;
}

Dims4 Shape(int64_t a, int64_t b, int64_t c, int64_t d) {
  Dims4 s;
  s.d[0] = a; s.d[1] = b; s.d[2] = c; s.d[3] = d;
  return s;
}

// The tensor-core path of this run and the dtype its cases take: sm80 (bf16
// and fp16), or under JAX_FLASH_FORCE_PATH=sm75 the Turing family (fp16).
KernelPath TensorCorePath() {
  return check::RoutesAsTuring() ? KernelPath::kSm75 : KernelPath::kSm80;
}
DType TensorCoreDType(DType t) { return check::RoutesAsTuring() ? DType::kFloat16 : t; }

// Exact-kernel cases: every option, every tier (head dims 1..256), tangent
// subsets. float32/float64 always take the exact kernel; so do bf16/fp16
// with a bias or a head_dim that is not a multiple of 8.
void ExactCases(DType t, std::vector<Case>* cases) {
  const KernelPath kExact = KernelPath::kExact;
  Case c = Make("plain", t, 2, 77, 131, 2, 2, 40, kExact);
  cases->push_back(c);
  c = Make("causal GQA D1", t, 2, 70, 50, 4, 2, 1, kExact);
  c.causal = true;
  cases->push_back(c);
  c = Make("window lengths", t, 3, 90, 100, 2, 1, 64, kExact);
  c.window_left = 16; c.window_right = 5; c.lengths = true;
  cases->push_back(c);
  c = Make("segments softcap D100", t, 2, 60, 75, 2, 1, 100, kExact);
  c.segments = true; c.softcap = 2.5;
  cases->push_back(c);
  c = Make("bias full + bias_dot", t, 2, 65, 70, 2, 1, 32, kExact);
  c.bias = Shape(2, 2, 65, 70);
  cases->push_back(c);
  c = Make("bias(1,H,1,Sk) causal, bias_dot only", t, 2, 77, 90, 4, 2, 48, kExact);
  c.bias = Shape(1, 4, 1, 90); c.causal = true; c.tangents = kBiasDot;
  cases->push_back(c);
  c = Make("dense mask(B,1,Sq,Sk)", t, 2, 100, 120, 4, 2, 64, kExact);
  c.mask = Shape(2, 1, 100, 120);
  cases->push_back(c);
  c = Make("dropout 0.3", t, 2, 100, 90, 4, 2, 64, kExact);
  c.dropout = 0.3;
  cases->push_back(c);
  c = Make("dropout broadcast, v_dot only", t, 2, 60, 75, 2, 1, 128, kExact);
  c.dropout = 0.2; c.broadcast_dropout = true; c.tangents = kVDot;
  cases->push_back(c);
  c = Make("q_dot only D200", t, 1, 50, 60, 2, 1, 200, kExact);
  c.tangents = kQDot;
  cases->push_back(c);
  c = Make("everything D256", t, 2, 70, 90, 2, 1, 256, kExact);
  c.causal = true; c.window_left = 40; c.window_right = 3; c.lengths = true; c.segments = true;
  c.softcap = 3.0; c.bias = Shape(1, 2, 70, 90); c.mask = Shape(2, 2, 70, 90); c.dropout = 0.25;
  cases->push_back(c);
  // bf16/fp16 without a bias reach the exact kernel through a head dim that
  // is not a multiple of 8.
  if (t == DType::kBFloat16 || t == DType::kFloat16)
    for (Case& e : *cases)
      if (e.dtype == t && !e.bias.present() && e.D % 8 == 0) e.D -= 1;
}

// Tensor-core cases: bf16/fp16, every head-dim bucket, the options the
// mma.sync kernel has (the dense mask and dropout: its kTerms kernels), odd
// lengths, tangent subsets.
void TensorCoreCases(DType t, std::vector<Case>* cases) {
  const KernelPath kSm80 = TensorCorePath();  // sm75 under JAX_FLASH_FORCE_PATH=sm75
  t = TensorCoreDType(t);
  const int64_t dims[] = {32, 64, 96, 128, 192, 256};
  for (int64_t D : dims) cases->push_back(Make("plain", t, 2, 130, 200, 2, 2, D, kSm80));
  Case c = Make("causal GQA D40", t, 2, 150, 140, 4, 2, 40, kSm80);
  c.causal = true;
  cases->push_back(c);
  c = Make("window lengths D72", t, 3, 190, 170, 2, 1, 72, kSm80);
  c.window_left = 40; c.window_right = 7; c.lengths = true;
  cases->push_back(c);
  c = Make("segments softcap D128", t, 2, 140, 150, 2, 1, 128, kSm80);
  c.segments = true; c.softcap = 3.0;
  cases->push_back(c);
  c = Make("causal softcap k_dot only D64", t, 2, 100, 130, 2, 2, 64, kSm80);
  c.causal = true; c.softcap = 2.0; c.tangents = kKDot;
  cases->push_back(c);
  c = Make("q_dot+v_dot D256 lengths", t, 2, 90, 100, 2, 1, 256, kSm80);
  c.tangents = kQDot | kVDot; c.lengths = true;
  cases->push_back(c);
  c = Make("everything tc D192", t, 2, 150, 170, 4, 2, 192, kSm80);
  c.causal = true; c.window_left = 64; c.lengths = true; c.segments = true; c.softcap = 4.0;
  cases->push_back(c);
  // kTerms: the dense mask (rows that see nothing included) and dropout.
  c = Make("dense mask(B,1,Sq,Sk) D64", t, 2, 100, 120, 4, 2, 64, kSm80);
  c.mask = Shape(2, 1, 100, 120);
  cases->push_back(c);
  c = Make("dense mask(1,H,Sq,Sk) causal D128", t, 2, 90, 110, 2, 1, 128, kSm80);
  c.mask = Shape(1, 2, 90, 110); c.causal = true;
  cases->push_back(c);
  c = Make("dropout 0.3 D32", t, 2, 100, 90, 4, 2, 32, kSm80);
  c.dropout = 0.3;
  cases->push_back(c);
  c = Make("dropout broadcast, v_dot only D128", t, 2, 60, 75, 2, 1, 128, kSm80);
  c.dropout = 0.2; c.broadcast_dropout = true; c.tangents = kVDot;
  cases->push_back(c);
  c = Make("dropout causal q_dot only D256", t, 2, 90, 100, 2, 2, 256, kSm80);
  c.dropout = 0.25; c.causal = true; c.tangents = kQDot;
  cases->push_back(c);
  c = Make("mask dropout window lengths segments D96", t, 3, 130, 150, 2, 1, 96, kSm80);
  c.mask = Shape(3, 2, 130, 150); c.dropout = 0.15; c.window_left = 50; c.window_right = 9;
  c.lengths = true; c.segments = true; c.softcap = 3.0;
  cases->push_back(c);
  c = Make("mask(1,1,Sq,Sk) dropout k_dot only D192", t, 2, 70, 80, 2, 2, 192, kSm80);
  c.mask = Shape(1, 1, 70, 80); c.dropout = 0.1; c.tangents = kKDot;
  cases->push_back(c);
  // The soft cap runs on tanh.approx.f32 (relative error 2^-11, as in the
  // forward): below float16's rounding of P only by a factor of ~1 at these
  // caps, so the 2x rule against a plain float-math implementation is a
  // bfloat16 test (pytest's plain float16 rounds the logits too).
  if (t == DType::kFloat16)
    for (Case& e : *cases)
      if (e.dtype == t && e.expect != KernelPath::kExact) e.softcap = 0.0;
}

std::vector<Case> SmallCases() {
  std::vector<Case> cases;
  Case c = Make("small everything", DType::kFloat32, 2, 17, 33, 2, 1, 40, KernelPath::kExact);
  c.causal = true; c.lengths = true; c.segments = true; c.softcap = 2.0;
  c.bias = Shape(2, 2, 17, 33); c.mask = Shape(1, 2, 17, 33); c.dropout = 0.25;
  cases.push_back(c);
  c = Make("small f64 window", DType::kFloat64, 2, 9, 20, 2, 2, 72, KernelPath::kExact);
  c.window_left = 3; c.window_right = 2; c.tangents = kQDot | kVDot;
  cases.push_back(c);
  const KernelPath tc = TensorCorePath();
  c = Make("small tc", TensorCoreDType(DType::kBFloat16), 2, 70, 45, 2, 1, 64, tc);
  c.causal = true; c.lengths = true; c.segments = true;
  c.softcap = check::RoutesAsTuring() ? 0.0 : 2.0;  // float16: see TensorCoreCases
  cases.push_back(c);
  c = Make("small tc D256 one stage", DType::kFloat16, 1, 20, 40, 2, 2, 256, tc);
  cases.push_back(c);
  c = Make("small tc mask dropout", DType::kFloat16, 2, 40, 50, 2, 1, 32, tc);
  c.causal = true; c.mask = Shape(2, 1, 40, 50); c.dropout = 0.25;
  cases.push_back(c);
  return cases;
}

// JVP time against the forward's, bf16 (float16 under
// JAX_FLASH_FORCE_PATH=sm75), same problem (B * S = 16k tokens, H * D =
// 2048); dropout > 0: both with that dropout rate (their kTerms kernels).
// TFLOP/s counts the JVP's five GEMMs of 2 S^2 D flops per head (the
// forward has two), halved when causal, as FlashAttention counts.
template <typename T>
void Bench(DType dtype, double dropout) {
  for (int64_t D : {64, 128})
    for (int64_t S : {1024, 4096})
      for (bool causal : {false, true}) {
        const int64_t B = 16384 / S, H = 2048 / D;
        const size_t n = B * S * H * D;
        std::mt19937_64 rng(7);
        std::vector<double> unused;
        DeviceArray<T> q(n), k(n), v(n), qd(n), kd(n), vd(n), out(n), out_dot(n);
        DeviceArray<float> lse(B * H * S), lse_dot(B * H * S);
        for (auto* a : {&q, &k, &v, &qd, &kd, &vd}) a->Upload(RandomTensor<T>(n, rng, &unused));
        DeviceArray<uint32_t> keys(2);
        keys.Upload(std::vector<uint32_t>{12345u, 678u});
        JvpParams p;
        p.shape = AttentionShape{B, S, S, H, H, D};
        p.mask.causal = causal;
        p.dropout.rate = dropout;
        p.dropout.key_batch = 1;
        p.dropout.keys = keys.ptr;
        p.score.scale = 1.0 / std::sqrt(double(D));
        p.q = q.ptr; p.k = k.ptr; p.v = v.ptr; p.out = out.ptr; p.lse = lse.ptr;
        p.q_dot = qd.ptr; p.k_dot = kd.ptr; p.v_dot = vd.ptr;
        p.out_dot = out_dot.ptr; p.lse_dot = lse_dot.ptr;
        p.q_strides = p.k_strides = p.v_strides = p.out_strides = p.q_dot_strides =
            p.k_dot_strides = p.v_dot_strides = p.out_dot_strides = SeqStrides::Contiguous(S, H, D);
        const float fwd = check::TimeMs([&] { CHECK_CUDA(check::LaunchFwd(p, dtype, nullptr)); }, 20);
        const float jvp = check::TimeMs([&] { CHECK_CUDA(cuda::LaunchJvp(p, dtype, nullptr)); }, 20);
        const double flops = 10.0 * B * H * double(S) * S * D * (causal ? 0.5 : 1.0);
        std::printf("%s D%lld S%lld causal=%d dropout=%.2f  fwd %.3f ms  jvp %.3f ms (%s)  "
                    "jvp/fwd %.2f  jvp %.0f TFLOP/s\n", check::DTypeName(dtype), (long long)D,
                    (long long)S, causal, dropout, fwd, jvp,
                    check::PathName(cuda::JvpPath(p, dtype)), jvp / fwd,
                    flops / (jvp * 1e-3) / 1e12);
        std::fflush(stdout);
      }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "check";
  check::PrintDevice();
  if (mode == "bench" || mode == "bench_terms") {
    const double dropout = mode == "bench_terms" ? 0.1 : 0.0;
    if (check::RoutesAsTuring()) Bench<__half>(DType::kFloat16, dropout);
    else Bench<__nv_bfloat16>(DType::kBFloat16, dropout);
    return 0;
  }
  std::vector<Case> cases;
  if (mode == "small") {
    cases = SmallCases();
  } else {
    for (DType t : {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16})
      ExactCases(t, &cases);
    for (DType t : {DType::kBFloat16, DType::kFloat16}) TensorCoreCases(t, &cases);
  }
  int failures = 0;
  uint64_t seed = 9876;
  for (const Case& c : cases) failures += Run(c, seed++) ? 0 : 1;
  std::printf("%d of %zu cases failed\n", failures, cases.size());
  return failures == 0 ? 0 : 1;
}
