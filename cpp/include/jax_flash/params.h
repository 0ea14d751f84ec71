// Plain parameter structs shared by every kernel (CPU and CUDA).
//
// No XLA or CUDA types here: the FFI handlers decode buffers and attributes
// into these structs, kernels read nothing else. Sizes, strides and offsets
// are 64-bit so that a tensor of more than 2^31 elements is addressed
// correctly. Strides are in elements.
#pragma once

#include <cstdint>

#include "jax_flash/dropout.h"
#include "jax_flash/macros.h"
#include "jax_flash/mask.h"

namespace jax_flash {

// The problem: query (B, Sq, Hq, D), key/value (B, Sk, Hkv, D), Hq % Hkv == 0.
struct AttentionShape {
  int64_t batch = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t num_heads_q = 0;
  int64_t num_heads_kv = 0;
  int64_t head_dim = 0;

  JAX_FLASH_HOST_DEVICE int64_t group_size() const { return num_heads_q / num_heads_kv; }
};

// Strides of a (batch, seq, heads, head_dim) tensor; head_dim is contiguous.
struct SeqStrides {
  int64_t batch = 0;
  int64_t row = 0;
  int64_t head = 0;

  static SeqStrides Contiguous(int64_t seqlen, int64_t heads, int64_t head_dim) {
    return SeqStrides{seqlen * heads * head_dim, heads * head_dim, head_dim};
  }
  JAX_FLASH_HOST_DEVICE int64_t offset(int64_t b, int64_t row_index, int64_t h) const {
    return b * batch + row_index * this->row + h * head;
  }
};

// The bias's element type: the accumulation type (float32, float64 for
// float64 inputs), or the 16-bit inputs' own, read as it is (CUDA; the CPU
// lowering converts it first).
enum class BiasType : int32_t { kAcc, kBFloat16, kFloat16 };

// Bytes of one bias element: acc_bytes (the accumulation type's), or 2.
JAX_FLASH_HOST_DEVICE int64_t BiasElementBytes(BiasType type, int64_t acc_bytes) {
  return type == BiasType::kAcc ? acc_bytes : 2;
}

// Score transform applied to q.k before the mask and the softmax:
//   x = scale * q.k + bias[b, h, i, j];  if softcap > 0: x = softcap * tanh(x / softcap).
struct ScoreParams {
  double scale = 1.0;
  double softcap = 0.0;  // 0 disables the cap.
  // Additive bias of bias_type, broadcast to (B, Hq, Sq, Sk); null if absent.
  // Added in the accumulation type.
  const void* bias = nullptr;
  DenseStrides bias_strides;
  int64_t bias_dims[4] = {0, 0, 0, 0};  // the bias's own shape (1 where broadcast)
  BiasType bias_type = BiasType::kAcc;
};

// Forward: out = softmax(x masked) @ v, lse = logsumexp(x masked) per row.
// lse is laid out (B, Hq, Sq), in the accumulation type (float32 for
// 16/32-bit inputs, float64 for float64 inputs). Rows with no visible key get
// out = 0 and lse = -inf.
struct FwdParams {
  AttentionShape shape;
  MaskParams mask;
  ScoreParams score;
  DropoutParams dropout;

  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  void* lse = nullptr;

  SeqStrides q_strides, k_strides, v_strides, out_strides;
};

// Backward: given dout, produce dq, dk, dv (and dbias when there is a bias
// and its gradient is wanted: dbias set).
// `delta` is a scratch buffer of B * Hq * Sq accumulation-type elements
// holding D = rowsum(dout * out).
struct BwdParams : FwdParams {
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  void* delta = nullptr;
  // Gradient of the bias, in the bias's own (unbroadcast) shape, contiguous,
  // accumulation type: sums dS over the dimensions the bias broadcasts. Null
  // when not wanted (even with a bias): the kernels then skip it.
  void* dbias = nullptr;

  SeqStrides dout_strides, dq_strides, dk_strides, dv_strides;
};

// Forward mode (JVP): given the forward's out and lse (the FwdParams out and
// lse, read here) and tangents q_dot, k_dot, v_dot, bias_dot of the inputs,
// produce the tangents of the outputs. With dS = d(logits), the derivative
// of the (scaled, biased, capped) logits in the direction of the tangents,
//   lse_dot = rowsum(P o dS),
//   out_dot = Pd v_dot + (Pd o dS) V - lse_dot o out,
// where P = exp(logits - lse) and Pd is P after dropout (the forward's mask,
// kept elements scaled by 1 / (1 - rate)). A null tangent is zero.
struct JvpParams : FwdParams {
  const void* q_dot = nullptr;
  const void* k_dot = nullptr;
  const void* v_dot = nullptr;
  // The bias's tangent: the bias's shape and strides (score.bias_strides), accumulation type.
  const void* bias_dot = nullptr;
  void* out_dot = nullptr;  // like out
  void* lse_dot = nullptr;  // like lse

  SeqStrides q_dot_strides, k_dot_strides, v_dot_strides, out_dot_strides;
};

}  // namespace jax_flash
