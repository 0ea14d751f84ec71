// Kernel-level check of the CUDA launch API (cpp/cuda/launch.h) against a
// dense float64 reference computed here on the host.
//
// For each case: random inputs (rounded to the storage dtype, so the
// reference sees exactly what the kernel sees), NaN-poisoned outputs (an
// element the kernel forgets to write fails), LaunchFwd then LaunchBwd (the
// backward gets the kernel's own out and lse, as in JAX), and a comparison of
// out, lse, dq, dk, dv. The error of each tensor is max|x - ref| / max|ref|;
// masked rows must be exactly out = 0, lse = -inf, dq = 0.
//
// Usage: exact_kernel_check [--small] [--large]
//   --small: two tiny cases only (for compute-sanitizer)
//   --large: add a bf16 forward/backward whose q has more than 2^31 elements
//            (checks 64-bit offsets; see RunLarge)
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
#include <vector>

#include "cuda/launch.h"
#include "jax_flash/mask.h"
#include "jax_flash/params.h"
#include "check_util.h"

using jax_flash::AttentionShape;
using jax_flash::BatchMask;
using jax_flash::BwdParams;
using jax_flash::FwdParams;
using jax_flash::MaskParams;
using jax_flash::cuda::DType;
using check::DeviceArray;
using check::Error;
using check::RandomTensor;
using check::ToDouble;

namespace {

struct Case {
  std::string name;
  DType dtype;
  int64_t B, Sq, Sk, Hq, Hkv, D;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  bool lengths = false;
  bool segments = false;
  double softcap = 0.0;
  bool check_bwd = true;
};

// ---------------------------------------------------------------------------
// The dense float64 reference: no tiling, no online softmax.

struct Reference {
  std::vector<double> out, lse, dq, dk, dv;
};

Reference ComputeReference(const Case& c, const MaskParams& host_mask, double scale,
                           const std::vector<double>& q, const std::vector<double>& k,
                           const std::vector<double>& v, const std::vector<double>& dout,
                           bool with_bwd) {
  const int64_t B = c.B, Sq = c.Sq, Sk = c.Sk, Hq = c.Hq, Hkv = c.Hkv, D = c.D, G = Hq / Hkv;
  Reference r;
  r.out.assign(B * Sq * Hq * D, 0.0);
  r.lse.assign(B * Hq * Sq, -INFINITY);
  if (with_bwd) {
    r.dq.assign(B * Sq * Hq * D, 0.0);
    r.dk.assign(B * Sk * Hkv * D, 0.0);
    r.dv.assign(B * Sk * Hkv * D, 0.0);
  }
  std::vector<double> x(Sk), dcap(Sk), prob(Sk);
  std::vector<char> vis(Sk);
  for (int64_t b = 0; b < B; ++b) {
    const BatchMask mask = BatchMask::For(host_mask, b, Sq, Sk);
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / G;
      for (int64_t i = 0; i < Sq; ++i) {
        const double* qi = &q[((b * Sq + i) * Hq + h) * D];
        double m = -INFINITY;
        for (int64_t j = 0; j < Sk; ++j) {
          vis[j] = mask.Visible(i, j);
          if (!vis[j]) continue;
          const double* kj = &k[((b * Sk + j) * Hkv + hk) * D];
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += qi[d] * kj[d];
          double s = scale * dot;
          dcap[j] = 1.0;
          if (c.softcap > 0) {
            const double t = std::tanh(s / c.softcap);
            s = c.softcap * t;
            dcap[j] = 1.0 - t * t;
          }
          x[j] = s;
          m = std::max(m, s);
        }
        if (m == -INFINITY) continue;  // no visible key: out 0, lse -inf, grads 0
        double l = 0;
        for (int64_t j = 0; j < Sk; ++j) l += vis[j] ? std::exp(x[j] - m) : 0.0;
        r.lse[(b * Hq + h) * Sq + i] = m + std::log(l);
        double* oi = &r.out[((b * Sq + i) * Hq + h) * D];
        for (int64_t j = 0; j < Sk; ++j) {
          prob[j] = vis[j] ? std::exp(x[j] - m) / l : 0.0;
          if (!vis[j]) continue;
          const double* vj = &v[((b * Sk + j) * Hkv + hk) * D];
          for (int64_t d = 0; d < D; ++d) oi[d] += prob[j] * vj[d];
        }
        if (!with_bwd) continue;
        const double* doi = &dout[((b * Sq + i) * Hq + h) * D];
        double delta = 0;
        for (int64_t d = 0; d < D; ++d) delta += doi[d] * oi[d];
        double* dqi = &r.dq[((b * Sq + i) * Hq + h) * D];
        for (int64_t j = 0; j < Sk; ++j) {
          if (!vis[j]) continue;
          const int64_t kv_at = ((b * Sk + j) * Hkv + hk) * D;
          double dp = 0;
          for (int64_t d = 0; d < D; ++d) dp += doi[d] * v[kv_at + d];
          const double ds = prob[j] * (dp - delta) * dcap[j] * scale;
          for (int64_t d = 0; d < D; ++d) {
            dqi[d] += ds * k[kv_at + d];
            r.dk[kv_at + d] += ds * qi[d];
            r.dv[kv_at + d] += prob[j] * doi[d];
          }
        }
      }
    }
  }
  return r;
}

// ---------------------------------------------------------------------------
// Comparison.

// Compares a (B, S, H, D) tensor, or a (B, H, S) one when is_lse.
template <typename T>
Error Compare(const Case& c, const std::vector<T>& got, const std::vector<double>& ref,
              int64_t S, int64_t H, int64_t D, bool is_lse) {
  Error e;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t i = 0; i < S; ++i) {
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          const int64_t at = is_lse ? (b * H + h) * S + i : ((b * S + i) * H + h) * D + d;
          const double x = ToDouble(got[at]), r = ref[at];
          if (std::isinf(r) && x == r) continue;  // lse of a masked row
          if (!std::isfinite(x) || !std::isfinite(r)) {
            ++e.bad_nonfinite;
            continue;
          }
          e.max_err = std::max(e.max_err, std::fabs(x - r));
          e.max_ref = std::max(e.max_ref, std::fabs(r));
        }
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

  std::vector<double> hq, hk, hv, hdo;
  DeviceArray<T> q(nq), k(nk), v(nk), dout(nq), out(nq), dq(nq), dk(nk), dv(nk);
  DeviceArray<Acc> lse(nstat);
  q.Upload(RandomTensor<T>(nq, rng, &hq));
  k.Upload(RandomTensor<T>(nk, rng, &hk));
  v.Upload(RandomTensor<T>(nk, rng, &hv));
  dout.Upload(RandomTensor<T>(nq, rng, &hdo));
  for (auto* a : {&out, &dq, &dk, &dv}) a->Poison();
  lse.Poison();

  // Mask operands: lengths in [-1, S + 1] (clamped by BatchMask) with a zero
  // length for batch 0; segment ids in runs, different on the q and kv side.
  std::vector<int32_t> q_len(B), kv_len(B), q_seg(B * Sq), kv_seg(B * Sk);
  std::uniform_int_distribution<int64_t> pick(0, 1 << 20);
  for (int64_t b = 0; b < B; ++b) {
    q_len[b] = static_cast<int32_t>(b == 0 ? 0 : (b == 1 ? -1 : pick(rng) % (Sq + 2)));
    kv_len[b] = static_cast<int32_t>(b == 1 ? Sk + 1 : pick(rng) % (Sk + 2));
    if (B == 1) q_len[b] = static_cast<int32_t>(Sq - Sq / 4);
    for (int64_t i = 0; i < Sq; ++i) q_seg[b * Sq + i] = static_cast<int32_t>(i / 13 + b);
    for (int64_t j = 0; j < Sk; ++j) kv_seg[b * Sk + j] = static_cast<int32_t>(j / 19 + b);
  }
  DeviceArray<int32_t> d_q_len(B), d_kv_len(B), d_q_seg(B * Sq), d_kv_seg(B * Sk);
  d_q_len.Upload(q_len);
  d_kv_len.Upload(kv_len);
  d_q_seg.Upload(q_seg);
  d_kv_seg.Upload(kv_seg);

  MaskParams host_mask, device_mask;
  for (MaskParams* m : {&host_mask, &device_mask}) {
    m->causal = c.causal;
    m->window_left = c.window_left;
    m->window_right = c.window_right;
  }
  if (c.lengths) {
    host_mask.q_seqlens = q_len.data();
    host_mask.kv_seqlens = kv_len.data();
    device_mask.q_seqlens = d_q_len.ptr;
    device_mask.kv_seqlens = d_kv_len.ptr;
  }
  if (c.segments) {
    host_mask.q_segment_ids = q_seg.data();
    host_mask.kv_segment_ids = kv_seg.data();
    device_mask.q_segment_ids = d_q_seg.ptr;
    device_mask.kv_segment_ids = d_kv_seg.ptr;
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));

  BwdParams p;
  p.shape = AttentionShape{B, Sq, Sk, Hq, Hkv, D};
  p.mask = device_mask;
  p.score.scale = scale;
  p.score.softcap = c.softcap;
  p.q = q.ptr;
  p.k = k.ptr;
  p.v = v.ptr;
  p.out = out.ptr;
  p.lse = lse.ptr;
  p.dout = dout.ptr;
  p.dq = dq.ptr;
  p.dk = dk.ptr;
  p.dv = dv.ptr;
  check::SetContiguousStrides(&p);

  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  cudaEvent_t start, mid, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&mid));
  CHECK_CUDA(cudaEventCreate(&stop));
  CHECK_CUDA(cudaEventRecord(start, stream));
  CHECK_CUDA(check::LaunchFwd(p, c.dtype, stream));
  CHECK_CUDA(cudaEventRecord(mid, stream));
  if (c.check_bwd) {
    const size_t ws_bytes = jax_flash::cuda::BwdWorkspaceBytes(p.shape, c.dtype, true);
    DeviceArray<unsigned char> ws(ws_bytes);
    ws.Poison();
    CHECK_CUDA(jax_flash::cuda::LaunchBwd(p, c.dtype, ws.ptr, /*deterministic=*/true, stream));
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
  } else {
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
  }
  float fwd_ms = 0, bwd_ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&fwd_ms, start, mid));
  CHECK_CUDA(cudaEventElapsedTime(&bwd_ms, mid, stop));
  CHECK_CUDA(cudaStreamDestroy(stream));

  const Reference ref = ComputeReference(c, host_mask, scale, hq, hk, hv, hdo, c.check_bwd);
  struct Named { const char* name; Error e; };
  std::vector<Named> errs;
  errs.push_back({"out", Compare(c, out.Download(), ref.out, Sq, Hq, D, false)});
  errs.push_back({"lse", Compare(c, lse.Download(), ref.lse, Sq, Hq, 1, true)});
  if (c.check_bwd) {
    errs.push_back({"dq", Compare(c, dq.Download(), ref.dq, Sq, Hq, D, false)});
    errs.push_back({"dk", Compare(c, dk.Download(), ref.dk, Sk, Hkv, D, false)});
    errs.push_back({"dv", Compare(c, dv.Download(), ref.dv, Sk, Hkv, D, false)});
  }
  const double tol = check::ExactTolerance(c.dtype);
  bool ok = true;
  std::string line;
  char buf[128];
  for (const Named& n : errs) {
    const bool good = n.e.bad_nonfinite == 0 && n.e.Normalized() <= tol;
    ok = ok && good;
    std::snprintf(buf, sizeof(buf), " %s=%.2e%s", n.name, n.e.Normalized(),
                  n.e.bad_nonfinite ? "(NONFINITE)" : "");
    line += buf;
  }
  std::printf("%-4s %-5s B%lld Sq%lld Sk%lld H%lld/%lld D%lld %-28s fwd %.3fms bwd %.3fms |%s\n",
              ok ? "ok" : "FAIL", check::DTypeName(c.dtype), (long long)B, (long long)Sq, (long long)Sk,
              (long long)Hq, (long long)Hkv, (long long)D, c.name.c_str(), fwd_ms, bwd_ms,
              line.c_str());
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
          int64_t D) {
  Case c;
  c.name = std::move(name);
  c.dtype = t;
  c.B = B; c.Sq = Sq; c.Sk = Sk; c.Hq = Hq; c.Hkv = Hkv; c.D = D;
  return c;
}

std::vector<Case> SmallCases() {
  std::vector<Case> cases;
  Case a = Make("small causal+segments", DType::kFloat32, 2, 17, 33, 2, 1, 40);
  a.causal = true; a.segments = true; a.lengths = true; a.softcap = 3.0;
  cases.push_back(a);
  Case b = Make("small f64 window", DType::kFloat64, 1, 9, 20, 2, 2, 72);
  b.window_left = 3; b.window_right = 2;
  cases.push_back(b);
  return cases;
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  const DType all[] = {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16};
  // Every head-dim tier and odd sizes, per dtype.
  for (DType t : all) {
    for (int64_t D : {1, 8, 40, 64, 72, 128, 200, 256}) {
      cases.push_back(Make("plain", t, 2, 17, 33, 2, 1, D));
    }
  }
  for (DType t : all) {
    Case c = Make("Sq1 Sk1", t, 1, 1, 1, 1, 1, 1);
    cases.push_back(c);
    c = Make("Sq127 Sk200 GQA3", t, 2, 127, 200, 6, 2, 72);
    cases.push_back(c);
    c = Make("causal Sq<Sk", t, 2, 127, 200, 4, 1, 64);
    c.causal = true;
    cases.push_back(c);
    c = Make("causal Sq>Sk", t, 2, 200, 33, 2, 2, 40);
    c.causal = true;
    cases.push_back(c);
    c = Make("window 16/8 softcap", t, 2, 127, 200, 2, 1, 256);
    c.window_left = 16; c.window_right = 8; c.softcap = 5.0;
    cases.push_back(c);
    c = Make("window left only", t, 1, 100, 100, 2, 1, 128);
    c.window_left = 7;
    cases.push_back(c);
    c = Make("lengths", t, 3, 127, 33, 2, 1, 64);
    c.lengths = true;
    cases.push_back(c);
    c = Make("segments+causal+softcap", t, 2, 65, 130, 8, 2, 256);
    c.segments = true; c.causal = true; c.softcap = 2.0;
    cases.push_back(c);
    c = Make("lengths+segments window", t, 3, 17, 200, 4, 4, 128);
    c.lengths = true; c.segments = true; c.window_left = 40; c.window_right = 0;
    cases.push_back(c);
    c = Make("Sk0", t, 2, 5, 0, 2, 1, 32);
    cases.push_back(c);
    c = Make("Sq0", t, 2, 0, 7, 2, 1, 32);
    cases.push_back(c);
  }
  // Bigger, for timing and many blocks.
  Case big = Make("bigger causal", DType::kFloat32, 2, 512, 512, 8, 2, 128);
  big.causal = true;
  cases.push_back(big);
  big = Make("bigger", DType::kFloat64, 1, 384, 384, 4, 4, 64);
  cases.push_back(big);
  return cases;
}

// A bf16 forward/backward whose q, out, dout and dq have more than 2^31
// elements (1 * 8'400'000 * 1 * 256 = 2.15e9, 4.3 GB each), to check that
// every offset is 64-bit. q and dout are zero except for a few sampled rows
// spread over the whole range; a zero row contributes nothing to dk and dv
// (its dout is 0, so P^T dO = 0 and dS = 0), so a compact problem made of the
// sampled rows alone is the exact reference for out, lse, dq of those rows
// and for all of dk, dv.
bool RunLarge() {
  using T = __nv_bfloat16;
  const int64_t Sq = 8'400'000, Sk = 40, D = 256;
  std::vector<int64_t> rows;
  for (int64_t i = 3; i < Sq; i += 400'009) rows.push_back(i);
  rows.push_back(Sq - 1);
  const int64_t n = static_cast<int64_t>(rows.size());
  Case c = Make("large q > 2^31 elements", DType::kBFloat16, 1, n, Sk, 1, 1, D);

  std::mt19937_64 rng(99);
  std::vector<double> hq, hk, hv, hdo;
  const std::vector<T> cq = RandomTensor<T>(n * D, rng, &hq);
  const std::vector<T> cdo = RandomTensor<T>(n * D, rng, &hdo);
  DeviceArray<T> q(Sq * D), dout(Sq * D), out(Sq * D), dq(Sq * D), k(Sk * D), v(Sk * D), dk(Sk * D),
      dv(Sk * D);
  DeviceArray<float> lse(Sq);
  CHECK_CUDA(cudaMemset(q.ptr, 0, q.n * sizeof(T)));
  CHECK_CUDA(cudaMemset(dout.ptr, 0, dout.n * sizeof(T)));
  for (int64_t r = 0; r < n; ++r) {
    CHECK_CUDA(cudaMemcpy(q.ptr + rows[r] * D, cq.data() + r * D, D * sizeof(T), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dout.ptr + rows[r] * D, cdo.data() + r * D, D * sizeof(T), cudaMemcpyHostToDevice));
  }
  k.Upload(RandomTensor<T>(Sk * D, rng, &hk));
  v.Upload(RandomTensor<T>(Sk * D, rng, &hv));
  for (auto* a : {&out, &dq, &dk, &dv}) a->Poison();
  lse.Poison();

  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  BwdParams p;
  p.shape = AttentionShape{1, Sq, Sk, 1, 1, D};
  p.score.scale = scale;
  p.q = q.ptr; p.k = k.ptr; p.v = v.ptr; p.out = out.ptr; p.lse = lse.ptr;
  p.dout = dout.ptr; p.dq = dq.ptr; p.dk = dk.ptr; p.dv = dv.ptr;
  check::SetContiguousStrides(&p);
  DeviceArray<unsigned char> ws(jax_flash::cuda::BwdWorkspaceBytes(p.shape, c.dtype, true));
  cudaEvent_t start, mid, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&mid));
  CHECK_CUDA(cudaEventCreate(&stop));
  CHECK_CUDA(cudaEventRecord(start));
  CHECK_CUDA(check::LaunchFwd(p, c.dtype, nullptr));
  CHECK_CUDA(cudaEventRecord(mid));
  CHECK_CUDA(jax_flash::cuda::LaunchBwd(p, c.dtype, ws.ptr, true, nullptr));
  CHECK_CUDA(cudaEventRecord(stop));
  CHECK_CUDA(cudaDeviceSynchronize());
  float fwd_ms = 0, bwd_ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&fwd_ms, start, mid));
  CHECK_CUDA(cudaEventElapsedTime(&bwd_ms, mid, stop));

  // Gather the sampled rows into the compact layout.
  std::vector<T> g_out(n * D), g_dq(n * D);
  std::vector<float> g_lse(n);
  for (int64_t r = 0; r < n; ++r) {
    CHECK_CUDA(cudaMemcpy(g_out.data() + r * D, out.ptr + rows[r] * D, D * sizeof(T), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(g_dq.data() + r * D, dq.ptr + rows[r] * D, D * sizeof(T), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(&g_lse[r], lse.ptr + rows[r], sizeof(float), cudaMemcpyDeviceToHost));
  }
  // Zero rows: uniform attention, lse = log(Sk) + 0, out = mean of v. Check one.
  std::vector<float> zero_row_lse(1);
  CHECK_CUDA(cudaMemcpy(zero_row_lse.data(), lse.ptr + Sq - 2, sizeof(float), cudaMemcpyDeviceToHost));
  const bool zero_row_ok = std::fabs(zero_row_lse[0] - std::log(double(Sk))) < 1e-5;

  MaskParams no_mask;
  const Reference ref = ComputeReference(c, no_mask, scale, hq, hk, hv, hdo, true);
  const Error e_out = Compare(c, g_out, ref.out, n, 1, D, false);
  const Error e_lse = Compare(c, g_lse, ref.lse, n, 1, 1, true);
  const Error e_dq = Compare(c, g_dq, ref.dq, n, 1, D, false);
  const Error e_dk = Compare(c, dk.Download(), ref.dk, Sk, 1, D, false);
  const Error e_dv = Compare(c, dv.Download(), ref.dv, Sk, 1, D, false);
  const double tol = check::ExactTolerance(c.dtype);
  bool ok = zero_row_ok;
  for (const Error* e : {&e_out, &e_lse, &e_dq, &e_dk, &e_dv})
    ok = ok && e->bad_nonfinite == 0 && e->Normalized() <= tol;
  std::printf("%-4s bf16  B1 Sq%lld Sk%lld H1/1 D%lld %s (%lld rows sampled) fwd %.3fms bwd %.3fms | "
              "out=%.2e lse=%.2e dq=%.2e dk=%.2e dv=%.2e zero-row lse %s\n",
              ok ? "ok" : "FAIL", (long long)Sq, (long long)Sk, (long long)D, c.name.c_str(),
              (long long)n, fwd_ms, bwd_ms, e_out.Normalized(), e_lse.Normalized(),
              e_dq.Normalized(), e_dk.Normalized(), e_dv.Normalized(), zero_row_ok ? "ok" : "WRONG");
  std::fflush(stdout);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  bool small = false, large = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--small")) small = true;
    if (!std::strcmp(argv[i], "--large")) large = true;
  }
  check::PrintDevice();
  std::vector<Case> cases = small ? SmallCases() : AllCases();
  int failures = 0;
  uint64_t seed = 1234;
  for (const Case& c : cases) failures += Run(c, seed++) ? 0 : 1;
  size_t total = cases.size();
  if (large) {
    failures += RunLarge() ? 0 : 1;
    ++total;
  }
  std::printf("%d of %zu cases failed\n", failures, total);
  return failures == 0 ? 0 : 1;
}
