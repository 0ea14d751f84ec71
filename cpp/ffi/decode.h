// Decoding and validation, shared by every op and platform (ops.h).
//
// The one place that turns XLA FFI buffers and attributes into FwdParams,
// BwdParams and JvpParams, and the one place that says what is valid; the
// operands, results and attributes themselves are listed in contract.h. It
// must stay free of CUDA types so that the CPU build includes it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "ffi/attrs.h"
#include "ffi/contract.h"
#include "jax_flash/params.h"
#include "jax_flash/supported.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash::ffi_decode {

namespace ffi = xla::ffi;

// The operands every op ends with (contract.h), by name.
#define JAX_FLASH_MASK_OPERAND_FIELD(name, dtype, shape) ffi::AnyBuffer name;
struct MaskOperands {
  JAX_FLASH_MASK_OPERANDS(JAX_FLASH_MASK_OPERAND_FIELD)
};
#undef JAX_FLASH_MASK_OPERAND_FIELD

inline std::string DimsToString(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + (dims.size() == 1 ? ",)" : ")");
}

inline ffi::Error Invalid(const std::string& message) {
  return ffi::Error::InvalidArgument("jax_flash: " + message);
}

inline bool IsSupportedFloat(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::F64 ||
         t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

// The accumulation (and lse) type of an input type.
inline ffi::DataType AccumulationType(ffi::DataType t) {
  return t == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
}

inline bool Is16Bit(ffi::DataType t) {
  return t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

// A dtype's name in messages (numpy's, as Python users know them).
inline std::string DataTypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::PRED: return "bool";
    default: return "XLA type " + std::to_string(static_cast<int>(t));
  }
}

inline ffi::Error ExpectDims(const char* name, ffi::AnyBuffer::Dimensions dims,
                             std::initializer_list<int64_t> expected) {
  bool ok = dims.size() == expected.size();
  size_t i = 0;
  for (int64_t e : expected) {
    if (!ok) break;
    ok = dims[i++] == e;
  }
  if (ok) return ffi::Error::Success();
  std::string want = "(";
  i = 0;
  for (int64_t e : expected) want += (i++ ? ", " : "") + std::to_string(e);
  want += expected.size() == 1 ? ",)" : ")";  // Python's tuples, as DimsToString
  return Invalid(std::string(name) + " must have shape " + want + ", got " + DimsToString(dims));
}

// q, k, v -> shape; checks ranks, dtypes, head_dim range, GQA divisibility.
inline ffi::Error DecodeShape(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                              const ffi::AnyBuffer& v, AttentionShape* shape) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4)
    return Invalid("q, k, v must be rank 4 (batch, seq, heads, head_dim); got " +
                   DimsToString(qd) + ", " + DimsToString(kd) + ", " + DimsToString(vd));
  if (!IsSupportedFloat(q.element_type()))
    return Invalid("q must be float32, float64, bfloat16 or float16");
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type())
    return Invalid("q, k and v must have the same dtype");
  shape->batch = qd[0];
  shape->seqlen_q = qd[1];
  shape->num_heads_q = qd[2];
  shape->head_dim = qd[3];
  shape->seqlen_k = kd[1];
  shape->num_heads_kv = kd[2];
  if (kd[0] != qd[0] || kd[3] != qd[3])
    return Invalid("k must have shape (B, Sk, Hkv, D) = (" + std::to_string(qd[0]) +
                   ", Sk, Hkv, " + std::to_string(qd[3]) + "), got " + DimsToString(kd));
  if (auto e = ExpectDims("v", vd, {kd[0], kd[1], kd[2], kd[3]}); e.failure()) return e;
  if (shape->head_dim < 1 || shape->head_dim > kMaxHeadDim)
    return Invalid("head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "], got " +
                   std::to_string(shape->head_dim));
  if (shape->num_heads_kv < 1 || shape->num_heads_q % shape->num_heads_kv != 0)
    return Invalid("query heads (" + std::to_string(shape->num_heads_q) +
                   ") must be a multiple of key/value heads (" +
                   std::to_string(shape->num_heads_kv) + ")");
  return ffi::Error::Success();
}

// An optional operand is absent when it has shape (0,), as jax_flash.primitives
// lowers it (0-d in its jaxprs: absent_operand says why). Present operands
// have rank >= 1 and may be empty (a bias of an empty problem, (1, 1, 0, S)):
// element_count() == 0 would take that for "no bias" and then refuse its
// gradient, which has the bias's shape.
inline bool IsAbsent(ffi::AnyBuffer::Dimensions d) { return d.size() == 1 && d[0] == 0; }
inline bool IsAbsent(const ffi::AnyBuffer& b) { return IsAbsent(b.dimensions()); }

// A rank-4 operand broadcast to (B, Hq, Sq, Sk): checks its dims, returns
// its strides (0 along broadcast dims) and dims.
inline ffi::Error DecodeDense(const char* name, const ffi::AnyBuffer& buf,
                              const AttentionShape& s, DenseStrides* strides, int64_t dims[4]) {
  auto d = buf.dimensions();
  const int64_t full[4] = {s.batch, s.num_heads_q, s.seqlen_q, s.seqlen_k};
  bool ok = d.size() == 4;
  for (int i = 0; ok && i < 4; ++i) ok = d[i] == 1 || d[i] == full[i];
  if (!ok)
    return Invalid(std::string(name) + " must be rank 4 and broadcastable to (B, Hq, Sq, Sk) = (" +
                   std::to_string(full[0]) + ", " + std::to_string(full[1]) + ", " +
                   std::to_string(full[2]) + ", " + std::to_string(full[3]) + "), got " +
                   DimsToString(d));
  int64_t stride[4];
  int64_t running = 1;
  for (int i = 3; i >= 0; --i) {
    stride[i] = d[i] == 1 ? 0 : running;
    running *= d[i];
    dims[i] = d[i];
  }
  *strides = DenseStrides{stride[0], stride[1], stride[2], stride[3]};
  return ffi::Error::Success();
}

// The offsets operand -> its pointer (null when absent).
inline ffi::Error DecodeOffsets(const ffi::AnyBuffer& offsets, const int32_t** out) {
  if (IsAbsent(offsets)) return ffi::Error::Success();
  auto dims = offsets.dimensions();
  if (offsets.element_type() != ffi::DataType::S32 || dims.size() != 1 || dims[0] != kNumOffsets)
    return Invalid("offsets must be int32 (" + std::to_string(kNumOffsets) + ",) or (0,), got " +
                   DimsToString(dims));
  *out = static_cast<const int32_t*>(offsets.untyped_data());
  return ffi::Error::Success();
}

// An operand of one value per cell of kBlockMaskBlock x kBlockMaskBlock
// positions, (B', H', R, C): the block mask and the tile map. B' and H' 1 or
// B and Hq; R and C 1 (broadcast) or enough cells for this call's rows and
// keys. A chunk (offsets) reads the whole problem's cells by position; cells
// past the end count as hidden (block mask) or empty (tile map), never read
// (mask.h). Sets *data, *strides, *rows and *cols when present.
inline ffi::Error DecodeCells(const char* name, ffi::DataType type, const char* type_name,
                              const AttentionShape& s, const ffi::AnyBuffer& buf,
                              const uint8_t** data, DenseStrides* strides, int64_t* rows,
                              int64_t* cols) {
  if (IsAbsent(buf)) return ffi::Error::Success();
  if (buf.element_type() != type)
    return Invalid(std::string(name) + " must be " + type_name);
  auto d = buf.dimensions();
  const int64_t need_rows = (s.seqlen_q + kBlockMaskBlock - 1) / kBlockMaskBlock;
  const int64_t need_cols = (s.seqlen_k + kBlockMaskBlock - 1) / kBlockMaskBlock;
  if (d.size() != 4 || (d[0] != 1 && d[0] != s.batch) || (d[1] != 1 && d[1] != s.num_heads_q) ||
      (d[2] != 1 && d[2] < need_rows) || (d[3] != 1 && d[3] < need_cols))
    return Invalid(std::string(name) + " must be rank 4, (1 or B, 1 or Hq, 1 or >= ceil(Sq / " +
                   std::to_string(kBlockMaskBlock) + "), 1 or >= ceil(Sk / " +
                   std::to_string(kBlockMaskBlock) + ")) = (" + std::to_string(s.batch) + ", " +
                   std::to_string(s.num_heads_q) + ", " + std::to_string(need_rows) + ", " +
                   std::to_string(need_cols) + "), got " + DimsToString(d));
  *data = static_cast<const uint8_t*>(buf.untyped_data());
  *strides = DenseStrides{d[0] == 1 ? 0 : d[1] * d[2] * d[3], d[1] == 1 ? 0 : d[2] * d[3],
                          d[2] == 1 ? 0 : d[3], d[3] == 1 ? 0 : 1};
  *rows = d[2];
  *cols = d[3];
  return ffi::Error::Success();
}

// Lengths, segment ids, the dense and the block mask, the tile map -> mask
// pointers; checks shapes and dtypes.
inline ffi::Error DecodeMask(const AttentionShape& s, const ScoreAttrs& a,
                             const MaskOperands& ops, MaskParams* m) {
  m->causal = a.is_causal;
  // A bound at least the length it limits, plus the largest distance between
  // a chunk's query and key positions (int32 offsets: under 2^32), admits
  // every key, so clamping changes nothing, and it keeps i + diagonal + right
  // and i + diagonal - left in mask.h far from int64 overflow whatever the
  // caller passed (jax_flash.attention clamps too; this covers a direct
  // primitive call).
  constexpr int64_t kPositionSpan = int64_t{1} << 32;
  m->window_left = a.window_left < 0 ? -1 : std::min(a.window_left, s.seqlen_q + kPositionSpan);
  m->window_right =
      a.window_right < 0 ? -1 : std::min(a.window_right, s.seqlen_k + kPositionSpan);
  struct Named { const char* name; const ffi::AnyBuffer* buf; };
  for (Named n : {Named{"q_seqlens", &ops.q_seqlens}, Named{"kv_seqlens", &ops.kv_seqlens},
                  Named{"q_segment_ids", &ops.q_segment_ids},
                  Named{"kv_segment_ids", &ops.kv_segment_ids}}) {
    if (n.buf->element_type() != ffi::DataType::S32)
      return Invalid(std::string(n.name) + " must be int32");
  }
  if (!IsAbsent(ops.q_seqlens)) {
    if (auto e = ExpectDims("q_seqlens", ops.q_seqlens.dimensions(), {s.batch}); e.failure()) return e;
    m->q_seqlens = static_cast<const int32_t*>(ops.q_seqlens.untyped_data());
  }
  if (!IsAbsent(ops.kv_seqlens)) {
    if (auto e = ExpectDims("kv_seqlens", ops.kv_seqlens.dimensions(), {s.batch}); e.failure()) return e;
    m->kv_seqlens = static_cast<const int32_t*>(ops.kv_seqlens.untyped_data());
  }
  if (IsAbsent(ops.q_segment_ids) != IsAbsent(ops.kv_segment_ids) &&
      s.batch * s.seqlen_q * s.seqlen_k > 0)
    return Invalid("q_segment_ids and kv_segment_ids must be given together");
  if (!IsAbsent(ops.q_segment_ids) && !IsAbsent(ops.kv_segment_ids)) {
    if (auto e = ExpectDims("q_segment_ids", ops.q_segment_ids.dimensions(), {s.batch, s.seqlen_q}); e.failure()) return e;
    if (auto e = ExpectDims("kv_segment_ids", ops.kv_segment_ids.dimensions(), {s.batch, s.seqlen_k}); e.failure()) return e;
    m->q_segment_ids = static_cast<const int32_t*>(ops.q_segment_ids.untyped_data());
    m->kv_segment_ids = static_cast<const int32_t*>(ops.kv_segment_ids.untyped_data());
  }
  if (auto e = DecodeOffsets(ops.offsets, &m->offsets); e.failure()) return e;
  if (!IsAbsent(ops.mask)) {
    if (ops.mask.element_type() != ffi::DataType::PRED) return Invalid("mask must be bool");
    int64_t dims[4];
    if (auto e = DecodeDense("mask", ops.mask, s, &m->dense_strides, dims); e.failure()) return e;
    m->dense = static_cast<const uint8_t*>(ops.mask.untyped_data());
  }
  if (auto e = DecodeCells("block_mask", ffi::DataType::PRED, "bool", s, ops.block_mask,
                           &m->block, &m->block_strides, &m->block_rows, &m->block_cols);
      e.failure())
    return e;
  // Any uint8 is a class: values above kCellFull read as full (mask.h).
  if (auto e = DecodeCells("tile_map", ffi::DataType::U8, "uint8", s, ops.tile_map,
                           &m->tile_map, &m->tile_map_strides, &m->tile_map_rows,
                           &m->tile_map_cols);
      e.failure())
    return e;
  // One map for every head: the kernels that step through it read one line
  // of cells for all the heads of a CTA (a dK/dV CTA's GQA group).
  if (m->tile_map != nullptr && ops.tile_map.dimensions()[1] != 1)
    return Invalid("tile_map must have one head (B', 1, R, C), got " +
                   DimsToString(ops.tile_map.dimensions()));
  return ffi::Error::Success();
}

inline ffi::Error DecodeScore(const AttentionShape& s, const ScoreAttrs& a,
                              const MaskOperands& ops, ffi::DataType input_type,
                              ScoreParams* score) {
  if (!std::isfinite(a.scale)) return Invalid("scale must be finite");
  if (!std::isfinite(a.softcap) || a.softcap < 0)
    return Invalid("softcap must be finite and >= 0 (0 disables it)");
  score->scale = a.scale;
  score->softcap = a.softcap;
  if (!IsAbsent(ops.bias)) {
    // The accumulation type, or the inputs' own 16-bit type (contract.h),
    // which the platform must read as it is (ops.h, PlatformTakesBias).
    const ffi::DataType t = ops.bias.element_type();
    if (t != AccumulationType(input_type) && !(Is16Bit(input_type) && t == input_type))
      return Invalid("bias must be " + DataTypeName(AccumulationType(input_type)) +
                     (Is16Bit(input_type) ? " or " + DataTypeName(input_type) : std::string()) +
                     " with " + DataTypeName(input_type) + " inputs, got " + DataTypeName(t));
    if (auto e = DecodeDense("bias", ops.bias, s, &score->bias_strides, score->bias_dims); e.failure())
      return e;
    score->bias = ops.bias.untyped_data();
    score->bias_type = t == ffi::DataType::BF16  ? BiasType::kBFloat16
                       : t == ffi::DataType::F16 ? BiasType::kFloat16
                                                 : BiasType::kAcc;
  }
  return ffi::Error::Success();
}

// Dropout rate and keys. The keys stay where XLA put them (the device):
// kernels resolve them per batch element with HeadDropout::For.
inline ffi::Error DecodeDropout(const AttentionShape& s, const ScoreAttrs& a,
                                const MaskOperands& ops, DropoutParams* d) {
  if (!(a.dropout_rate >= 0 && a.dropout_rate < 1))
    return Invalid("dropout_rate must be in [0, 1)");
  d->rate = a.dropout_rate;
  d->broadcast_batch_and_heads = a.broadcast_dropout;
  if (a.dropout_rate == 0) return ffi::Error::Success();
  auto dims = ops.dropout_key.dimensions();
  if (ops.dropout_key.element_type() != ffi::DataType::U32 || dims.size() != 2 || dims[1] != 2 ||
      dims[0] < 1 || s.batch % dims[0] != 0)
    return Invalid("dropout_key must be uint32 (Bkey, 2) with Bkey dividing the batch " +
                   std::to_string(s.batch) + ", got " + DimsToString(dims));
  d->keys = static_cast<const uint32_t*>(ops.dropout_key.untyped_data());
  if (auto e = DecodeOffsets(ops.offsets, &d->offsets); e.failure()) return e;
  d->key_batch = dims[0];
  return ffi::Error::Success();
}

// Everything the forward needs, validated. Results are checked against the
// shapes they must have.
inline ffi::Error DecodeFwd(const ScoreAttrs& attrs, const ffi::AnyBuffer& q,
                            const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                            const MaskOperands& ops,
                            ffi::AnyBuffer::Dimensions out_dims, ffi::DataType out_type,
                            ffi::AnyBuffer::Dimensions lse_dims, ffi::DataType lse_type,
                            FwdParams* p) {
  if (auto e = DecodeShape(q, k, v, &p->shape); e.failure()) return e;
  const AttentionShape& s = p->shape;
  if (auto e = DecodeMask(s, attrs, ops, &p->mask); e.failure()) return e;
  if (auto e = DecodeScore(s, attrs, ops, q.element_type(), &p->score); e.failure())
    return e;
  if (auto e = DecodeDropout(s, attrs, ops, &p->dropout); e.failure())
    return e;
  if (auto e = ExpectDims("out", out_dims, {s.batch, s.seqlen_q, s.num_heads_q, s.head_dim}); e.failure())
    return e;
  if (out_type != q.element_type()) return Invalid("out must have the dtype of q");
  if (auto e = ExpectDims("lse", lse_dims, {s.batch, s.num_heads_q, s.seqlen_q}); e.failure()) return e;
  if (lse_type != AccumulationType(q.element_type()))
    return Invalid("lse must be float32 (float64 for float64 inputs)");
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->q_strides = SeqStrides::Contiguous(s.seqlen_q, s.num_heads_q, s.head_dim);
  p->k_strides = SeqStrides::Contiguous(s.seqlen_k, s.num_heads_kv, s.head_dim);
  p->v_strides = p->k_strides;
  p->out_strides = p->q_strides;
  return ffi::Error::Success();
}

// The backward's extra operands (out, lse, dout) are checked against the
// forward's shapes; results dq, dk, dv against q, k, v.
inline ffi::Error DecodeBwdExtras(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                  const ffi::AnyBuffer& out, const ffi::AnyBuffer& lse,
                                  const ffi::AnyBuffer& dout,
                                  ffi::AnyBuffer::Dimensions dq_dims,
                                  ffi::AnyBuffer::Dimensions dk_dims,
                                  ffi::AnyBuffer::Dimensions dv_dims,
                                  const ffi::AnyBuffer& bias, ffi::AnyBuffer::Dimensions dbias_dims,
                                  ffi::DataType dbias_type, BwdParams* p) {
  const AttentionShape& s = p->shape;
  const int64_t B = s.batch, Sq = s.seqlen_q, Sk = s.seqlen_k, Hq = s.num_heads_q,
                Hkv = s.num_heads_kv, D = s.head_dim;
  if (auto e = ExpectDims("out", out.dimensions(), {B, Sq, Hq, D}); e.failure()) return e;
  if (auto e = ExpectDims("dout", dout.dimensions(), {B, Sq, Hq, D}); e.failure()) return e;
  if (auto e = ExpectDims("lse", lse.dimensions(), {B, Hq, Sq}); e.failure()) return e;
  if (auto e = ExpectDims("dq", dq_dims, {B, Sq, Hq, D}); e.failure()) return e;
  if (auto e = ExpectDims("dk", dk_dims, {B, Sk, Hkv, D}); e.failure()) return e;
  if (auto e = ExpectDims("dv", dv_dims, {B, Sk, Hkv, D}); e.failure()) return e;
  if (out.element_type() != q.element_type() || dout.element_type() != q.element_type())
    return Invalid("out and dout must have the dtype of q");
  if (lse.element_type() != AccumulationType(q.element_type()))
    return Invalid("lse must be float32 (float64 for float64 inputs)");
  (void)k;
  // With a bias, a (0,) dbias asks for no bias gradient (the kernels skip it).
  if (IsAbsent(bias)) {
    if (!IsAbsent(dbias_dims)) return Invalid("dbias must be (0,) without a bias");
  } else if (!IsAbsent(dbias_dims)) {
    // The kernels write dbias in the accumulation type, whatever the bias's.
    const ffi::DataType acc = AccumulationType(q.element_type());
    bool same = dbias_dims.size() == 4 && dbias_type == acc;
    for (int i = 0; same && i < 4; ++i) same = dbias_dims[i] == p->score.bias_dims[i];
    if (!same)
      return Invalid("dbias must have the shape of bias and dtype " + DataTypeName(acc) +
                     ", or be (0,) (not computed); got " + DataTypeName(dbias_type) + " " +
                     DimsToString(dbias_dims));
  }
  p->out = const_cast<void*>(out.untyped_data());
  p->lse = const_cast<void*>(lse.untyped_data());
  p->dout = dout.untyped_data();
  p->dout_strides = p->q_strides;
  p->dq_strides = p->q_strides;
  p->dk_strides = p->k_strides;
  p->dv_strides = p->k_strides;
  return ffi::Error::Success();
}

// Everything the backward needs, validated, with the result pointers set
// (dbias only when there is a bias and dbias is not (0,)); the caller
// provides p->delta.
inline ffi::Error DecodeBwd(const ScoreAttrs& attrs, const ffi::AnyBuffer& q,
                            const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                            const ffi::AnyBuffer& out, const ffi::AnyBuffer& lse,
                            const ffi::AnyBuffer& dout, const MaskOperands& ops,
                            ffi::Result<ffi::AnyBuffer>& dq, ffi::Result<ffi::AnyBuffer>& dk,
                            ffi::Result<ffi::AnyBuffer>& dv, ffi::Result<ffi::AnyBuffer>& dbias,
                            BwdParams* p) {
  if (auto e = DecodeFwd(attrs, q, k, v, ops, out.dimensions(), out.element_type(),
                         lse.dimensions(), lse.element_type(), p);
      e.failure())
    return e;
  if (auto e = DecodeBwdExtras(q, k, out, lse, dout, dq->dimensions(), dk->dimensions(),
                               dv->dimensions(), ops.bias, dbias->dimensions(),
                               dbias->element_type(), p);
      e.failure())
    return e;
  if (dq->element_type() != q.element_type() || dk->element_type() != q.element_type() ||
      dv->element_type() != q.element_type())
    return Invalid("dq, dk and dv must have the dtype of q");
  p->dq = dq->untyped_data();
  p->dk = dk->untyped_data();
  p->dv = dv->untyped_data();
  p->dbias = p->score.bias != nullptr && !IsAbsent(dbias->dimensions()) ? dbias->untyped_data()
                                                                        : nullptr;
  return ffi::Error::Success();
}

// A tangent operand: absent (0,) for zero, else the shape of its primal, in
// `type` (the primal's; the accumulation type for bias_dot, contract.h).
// Returns its data or null.
inline ffi::Error DecodeTangent(const char* name, const ffi::AnyBuffer& tangent,
                                const ffi::AnyBuffer& primal, ffi::DataType type,
                                const void** data) {
  *data = nullptr;
  if (IsAbsent(tangent)) return ffi::Error::Success();
  auto td = tangent.dimensions(), pd = primal.dimensions();
  bool same = td.size() == pd.size() && tangent.element_type() == type;
  for (size_t i = 0; same && i < td.size(); ++i) same = td[i] == pd[i];
  if (!same)
    return Invalid(std::string(name) + " must be (0,) or " + DataTypeName(type) +
                   " of its primal's shape " + DimsToString(pd) + ", got " +
                   DataTypeName(tangent.element_type()) + " " + DimsToString(td));
  *data = tangent.untyped_data();
  return ffi::Error::Success();
}

// Everything the JVP needs, validated: the forward's operands, its results
// out and lse as inputs, the tangents and the two results.
inline ffi::Error DecodeJvp(const ScoreAttrs& attrs, const ffi::AnyBuffer& q,
                            const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                            const ffi::AnyBuffer& out, const ffi::AnyBuffer& lse,
                            const MaskOperands& ops, const ffi::AnyBuffer& q_dot,
                            const ffi::AnyBuffer& k_dot, const ffi::AnyBuffer& v_dot,
                            const ffi::AnyBuffer& bias_dot, ffi::Result<ffi::AnyBuffer>& out_dot,
                            ffi::Result<ffi::AnyBuffer>& lse_dot, JvpParams* p) {
  if (auto e = DecodeFwd(attrs, q, k, v, ops, out.dimensions(), out.element_type(),
                         lse.dimensions(), lse.element_type(), p);
      e.failure())
    return e;
  const ffi::DataType t = q.element_type();
  if (auto e = DecodeTangent("q_dot", q_dot, q, t, &p->q_dot); e.failure()) return e;
  if (auto e = DecodeTangent("k_dot", k_dot, k, t, &p->k_dot); e.failure()) return e;
  if (auto e = DecodeTangent("v_dot", v_dot, v, t, &p->v_dot); e.failure()) return e;
  if (auto e = DecodeTangent("bias_dot", bias_dot, ops.bias, AccumulationType(t), &p->bias_dot);
      e.failure())
    return e;
  if (IsAbsent(ops.bias)) p->bias_dot = nullptr;  // the tangent of an absent bias is absent too
  const AttentionShape& s = p->shape;
  if (auto e = ExpectDims("out_dot", out_dot->dimensions(),
                          {s.batch, s.seqlen_q, s.num_heads_q, s.head_dim});
      e.failure())
    return e;
  if (auto e = ExpectDims("lse_dot", lse_dot->dimensions(), {s.batch, s.num_heads_q, s.seqlen_q});
      e.failure())
    return e;
  if (out_dot->element_type() != q.element_type() ||
      lse_dot->element_type() != AccumulationType(q.element_type()))
    return Invalid("out_dot must have the dtype of q, lse_dot the dtype of lse");
  p->out = const_cast<void*>(out.untyped_data());
  p->lse = const_cast<void*>(lse.untyped_data());
  p->out_dot = out_dot->untyped_data();
  p->lse_dot = lse_dot->untyped_data();
  p->q_dot_strides = p->q_strides;
  p->k_dot_strides = p->k_strides;
  p->v_dot_strides = p->k_strides;
  p->out_dot_strides = p->q_strides;
  return ffi::Error::Success();
}

}  // namespace jax_flash::ffi_decode
