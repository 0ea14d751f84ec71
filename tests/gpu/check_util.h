// Host helpers the kernel drivers in tests/gpu share: CUDA error checks,
// device arrays, storage types, random inputs, contiguous and broadcast
// strides, timing.
// Plain host code against the CUDA runtime; each driver keeps its own cases,
// reference and comparison rule.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cuda/dispatch.h"
#include "cuda/launch.h"
#include "jax_flash/params.h"

#define CHECK_CUDA(expr)                                                 \
  do {                                                                   \
    cudaError_t err_ = (expr);                                           \
    if (err_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, \
                   cudaGetErrorString(err_));                            \
      std::exit(2);                                                      \
    }                                                                    \
  } while (0)

namespace check {

using jax_flash::cuda::DType;

// ---- storage types on the host -----------------------------------------------

template <typename T> double ToDouble(T x) { return static_cast<double>(x); }
template <> inline double ToDouble(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> inline double ToDouble(__half x) { return __half2float(x); }
template <typename T> T FromDouble(double x) { return static_cast<T>(x); }
template <> inline __nv_bfloat16 FromDouble(double x) {
  return __float2bfloat16(static_cast<float>(x));
}
template <> inline __half FromDouble(double x) { return __float2half(static_cast<float>(x)); }

// 16-bit values as raw bits, bfloat16 when bf16 else float16 (rounded to
// nearest even): the tensor-core driver's storage, chosen per case at run time.
inline uint16_t ToBits(float x, bool bf16) {
  if (bf16) return __nv_bfloat16_raw(__float2bfloat16_rn(x)).x;
  return __half_raw(__float2half_rn(x)).x;
}
inline float FromBits(uint16_t b, bool bf16) {
  if (bf16) return __bfloat162float(__nv_bfloat16(__nv_bfloat16_raw{b}));
  return __half2float(__half(__half_raw{b}));
}
inline DType DType16(bool bf16) { return bf16 ? DType::kBFloat16 : DType::kFloat16; }

inline const char* DTypeName(DType t) {
  switch (t) {
    case DType::kFloat64: return "f64";
    case DType::kFloat32: return "f32";
    case DType::kFloat16: return "f16";
    case DType::kBFloat16: return "bf16";
  }
  return "?";
}

// The exact kernels' bound on max|x - ref| / max|ref| per storage type.
inline double ExactTolerance(DType t) {
  switch (t) {
    case DType::kFloat64: return 1e-12;
    case DType::kFloat32: return 2e-5;
    case DType::kFloat16: return 4e-3;
    case DType::kBFloat16: return 3e-2;
  }
  return 0;
}

// The largest error against a reference, and where the kernel and the
// reference disagree about finiteness.
struct Error {
  double max_err = 0, max_ref = 0;
  int64_t bad_nonfinite = 0;  // non-finite where the reference is finite, or vice versa
  double Normalized() const { return max_err / std::max(max_ref, 1e-30); }
};

inline const char* PathName(jax_flash::cuda::KernelPath path) {
  switch (path) {
    case jax_flash::cuda::KernelPath::kExact: return "exact";
    case jax_flash::cuda::KernelPath::kSm80: return "sm80";
    case jax_flash::cuda::KernelPath::kSm90: return "sm90";
    case jax_flash::cuda::KernelPath::kSm75: return "sm75";
  }
  return "?";
}

// True when JAX_FLASH_FORCE_PATH=sm75 routes as on a Turing GPU, where only
// float16 takes the tensor cores: the drivers then run their bfloat16 cases
// in float16, so that every case exercises the sm75 family.
inline bool RoutesAsTuring() {
  const char* env = std::getenv("JAX_FLASH_FORCE_PATH");
  return env != nullptr && std::string(env) == "sm75";
}

// ---- device memory -------------------------------------------------------------

template <typename T>
struct DeviceArray {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DeviceArray(size_t count) : n(count) {
    if (n) CHECK_CUDA(cudaMalloc(&ptr, n * sizeof(T)));
  }
  ~DeviceArray() {
    if (ptr) cudaFree(ptr);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  size_t bytes() const { return n * sizeof(T); }
  // 0xFF bytes: NaN in bf16, fp16, float32 and float64, so an element a
  // kernel forgets to write fails the comparison.
  void Poison() {
    if (n) CHECK_CUDA(cudaMemset(ptr, 0xff, bytes()));
  }
  void Upload(const std::vector<T>& h) {
    if (n) CHECK_CUDA(cudaMemcpy(ptr, h.data(), bytes(), cudaMemcpyHostToDevice));
  }
  std::vector<T> Download() const {
    std::vector<T> h(n);
    if (n) CHECK_CUDA(cudaMemcpy(h.data(), ptr, bytes(), cudaMemcpyDeviceToHost));
    return h;
  }
};

// Untyped device bytes; never a null pointer, also for an empty tensor.
struct DeviceBytes : DeviceArray<unsigned char> {
  explicit DeviceBytes(size_t bytes) : DeviceArray(std::max<size_t>(bytes, 16)) {}
  void* p() const { return ptr; }
};

// cuda::LaunchFwd with the workspace it needs: one buffer for the driver's
// process (its calls are stream-ordered on one device).
inline cudaError_t LaunchFwd(const jax_flash::FwdParams& p, jax_flash::cuda::DType dtype,
                             cudaStream_t stream) {
  static DeviceBytes workspace(jax_flash::cuda::FwdWorkspaceBytes());
  return jax_flash::cuda::LaunchFwd(p, dtype, workspace.p(), stream);
}

// Normal random values rounded to T; `host` keeps the rounded values as
// doubles, so a reference sees exactly what the kernel sees.
template <typename T>
std::vector<T> RandomTensor(size_t n, std::mt19937_64& rng, std::vector<double>* host,
                            double sigma = 1.0) {
  std::normal_distribution<double> normal(0.0, sigma);
  std::vector<T> t(n);
  host->resize(n);
  for (size_t i = 0; i < n; ++i) {
    t[i] = FromDouble<T>(normal(rng));
    (*host)[i] = ToDouble(t[i]);
  }
  return t;
}

// ---- parameters ------------------------------------------------------------------

// Contiguous (B, S, H, D) strides for q, k, v and every output and gradient.
inline void SetContiguousStrides(jax_flash::BwdParams* p) {
  const jax_flash::AttentionShape& s = p->shape;
  p->q_strides = jax_flash::SeqStrides::Contiguous(s.seqlen_q, s.num_heads_q, s.head_dim);
  p->k_strides = jax_flash::SeqStrides::Contiguous(s.seqlen_k, s.num_heads_kv, s.head_dim);
  p->v_strides = p->k_strides;
  p->out_strides = p->dout_strides = p->dq_strides = p->q_strides;
  p->dk_strides = p->dv_strides = p->k_strides;
}

// Contiguous strides of a broadcast operand (a dense mask or bias) of dims
// (B, H, Sq, Sk), each 1 or full: 0 along a dim of 1, as decode.h's
// DecodeDense computes them.
inline jax_flash::DenseStrides BroadcastStrides(const int64_t (&dims)[4]) {
  int64_t stride[4], running = 1;
  for (int i = 3; i >= 0; --i) {
    stride[i] = dims[i] == 1 ? 0 : running;
    running *= dims[i];
  }
  return jax_flash::DenseStrides{stride[0], stride[1], stride[2], stride[3]};
}

// The offset of element (b, h, i, j) of a dense operand with strides s.
inline int64_t DenseAt(const jax_flash::DenseStrides& s, int64_t b, int64_t h, int64_t i,
                       int64_t j) {
  return b * s.batch + h * s.head + i * s.row + j * s.col;
}

// Cells of the block mask and the tile map along a sequence of n positions.
inline int64_t CeilCells(int64_t n) {
  return (n + jax_flash::kBlockMaskBlock - 1) / jax_flash::kBlockMaskBlock;
}

// The tile map (B, 1, R, C) of the elementwise terms, visible(b, h, i, j)
// for heads [0, H), by the definition of mask.h's CellClass from every pair
// of each cell, over all heads (jax_flash/tile_map.py derives a map that may
// call some of these cells partial instead: both are valid).
inline std::vector<uint8_t> TileMapOf(
    const std::function<bool(int64_t, int64_t, int64_t, int64_t)>& visible, int64_t B, int64_t H,
    int64_t Sq, int64_t Sk) {
  const int64_t R = CeilCells(Sq), C = CeilCells(Sk), cell = jax_flash::kBlockMaskBlock;
  std::vector<uint8_t> map(B * R * C);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) {
        bool any = false, all = true;
        for (int64_t h = 0; h < H; ++h)
          for (int64_t i = r * cell; i < std::min(Sq, (r + 1) * cell); ++i)
            for (int64_t j = c * cell; j < std::min(Sk, (c + 1) * cell); ++j) {
              const bool v = visible(b, h, i, j);
              any = any || v;
              all = all && v;
            }
        map[(b * R + r) * C + c] = !any ? jax_flash::kCellEmpty
                                        : (all ? jax_flash::kCellFull : jax_flash::kCellPartial);
      }
  return map;
}

// ---- device and timing ------------------------------------------------------------

inline void PrintDevice() {
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
}

// Median of `iters` timed calls (cudaEvents on the default stream) after
// three warm-up calls, in milliseconds. With WARM_MS=<n> in the environment
// the warm-up runs for n ms of back-to-back calls instead: the GPU is
// power-limited under these kernels, and a short run times them at the top
// clock where a training loop (and the jax bench) sees them 10-20% slower
// (cpp/cuda/NOTES_sm90_fwd_power.md, "The gap is the clock").
inline float TimeMs(const std::function<void()>& fn, int iters) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) fn();
  const char* warm = std::getenv("WARM_MS");
  const double warm_ms = warm ? std::atof(warm) : 0.0;
  for (auto t0 = std::chrono::steady_clock::now();
       std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() <
       warm_ms;) {
    for (int i = 0; i < 4; ++i) fn();
    CHECK_CUDA(cudaDeviceSynchronize());
  }
  std::vector<float> ts;
  for (int i = 0; i < iters; ++i) {
    CHECK_CUDA(cudaEventRecord(a));
    fn();
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms);
  }
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

}  // namespace check
