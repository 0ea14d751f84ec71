// The FFI contract, written once: every jax_flash custom call's operands,
// results and attributes, in order.
//
// Everything else is generated from these lists: the XLA bindings of the
// handlers and the structs they decode into (ops.h, attrs.h), and the
// nanobind module's ffi_contract(), from which Python takes its operand
// names and its attributes' names and types (jax_flash/_ffi.py;
// tests/test_contract.py checks the lowered calls against it). Adding an
// operand or an attribute is one line here, the policy that reads it
// (decode.h, the kernels), and in Python its sharding roles (primitives.py)
// and the call site that passes it.
//
// The targets have the same operands, results and attributes on every
// platform, except the CUDA forward's and backward's extra workspace results.
#pragma once

// Operands and results: X(name, dtype, shape). dtype is one of "input" (q's
// dtype: float32, float64, bfloat16 or float16), "acc" (the accumulation type:
// float64 for float64 inputs, float32 otherwise), "int32", "uint32", "bool",
// "uint8", or two of them as "a|b": either (an absent one is given as a).
// Shapes are row-major, as XLA passes them. Optional operands are (0,) when
// absent (in any dtype); present ones may still be empty.

// Each op's operands are its own list below followed by these: the mask,
// score and dropout options every op takes.
#define JAX_FLASH_MASK_OPERANDS(X)                                                          \
  X(q_seqlens, "int32", "(B,): rows i >= q_seqlens[b] see nothing")                         \
  X(kv_seqlens, "int32", "(B,): keys j >= kv_seqlens[b] are hidden")                        \
  X(q_segment_ids, "int32", "(B, Sq), given with kv_segment_ids")                           \
  X(kv_segment_ids, "int32", "(B, Sk): i sees j only where the ids are equal")              \
  X(bias, "acc|input",                                                                      \
    "rank 4, each dim 1 or (B, Hq, Sq, Sk)'s: added to the scaled logits in the "          \
    "accumulation type. In the bfloat16/float16 inputs' own dtype the CUDA kernels read "   \
    "it as it is; the CPU handler refuses it (its lowering converts it first)")             \
  X(mask, "bool", "rank 4, broadcast like bias: False hides the pair")                      \
  X(block_mask, "bool",                                                                     \
    "(B' in 1 or B, H' in 1 or Hq, R, C), R and C 1 or at least Sq and Sk / 128 rounded "   \
    "up: False hides the 128 x 128 block of positions (mask.h)")                            \
  X(tile_map, "uint8",                                                                      \
    "shaped like block_mask but with one head (B', 1, R, C): per cell, what the "           \
    "elementwise terms (segment ids, mask) "                                                \
    "leave visible there (mask.h CellClass): 0 no pair, 1 some, 2 every pair. A hint: "     \
    "kernels that read it skip 0 cells and those terms' tests in 2 cells; with a "          \
    "block_mask it must hold it too (hidden cells 0), which the tensor-core kernels "       \
    "rely on")                                                                              \
  X(dropout_key, "uint32",                                                                  \
    "(Bkey, 2), Bkey dividing B: element b uses key b / (B / Bkey) and counter batch "      \
    "index b % (B / Bkey) (vmap over keys folds into the batch); present when "             \
    "dropout_rate > 0")                                                                     \
  X(offsets, "int32",                                                                       \
    "(4,), mask.h's Offset: positions of this chunk's first query row and key, global "     \
    "batch and query-head index of its first element; read on the kernel's device")

// Forward: out = softmax(logits) v, lse = logsumexp(logits) per row.
#define JAX_FLASH_FWD_OPERANDS(X)            \
  X(q, "input", "(B, Sq, Hq, D)")            \
  X(k, "input", "(B, Sk, Hkv, D), Hq % Hkv == 0") \
  X(v, "input", "(B, Sk, Hkv, D)")
#define JAX_FLASH_FWD_RESULTS(X) \
  X(out, "input", "like q")      \
  X(lse, "acc", "(B, Hq, Sq); -inf for rows that see nothing")
// CUDA only: the persistent forward's tile counter, owned by XLA so that the
// call can be recorded into a CUDA graph (sized at lowering by
// cuda_fwd_workspace_bytes).
#define JAX_FLASH_CUDA_FWD_EXTRA_RESULTS(X) X(workspace, "uint8", "(CudaFwdWorkspaceBytes,)")

// Backward: the forward's operands and results and dout -> the gradients.
#define JAX_FLASH_BWD_OPERANDS(X) \
  JAX_FLASH_FWD_OPERANDS(X)       \
  X(out, "input", "the forward's") \
  X(lse, "acc", "the forward's")  \
  X(dout, "input", "like out")
#define JAX_FLASH_BWD_RESULTS(X)                                                   \
  X(dq, "input", "like q")                                                         \
  X(dk, "input", "like k")                                                         \
  X(dv, "input", "like v")                                                         \
  X(dbias, "acc",                                                                  \
    "the bias's shape, in the accumulation type whatever the bias's (reverse mode "\
    "casts it to the bias's dtype); (0,) without a bias, or with a bias whose "    \
    "gradient is not wanted (the backward then does not compute it)")
// CUDA only: delta = rowsum(dout * out) and the tensor-core kernels' float32
// dQ accumulator, owned by XLA so that the call can be recorded into a CUDA
// graph (sized at lowering by cuda_bwd_workspace_bytes).
#define JAX_FLASH_CUDA_BWD_EXTRA_RESULTS(X) X(workspace, "uint8", "(CudaBwdWorkspaceBytes,)")

// Forward mode: the forward's operands and results and the tangents (each
// like its primal, or (0,) when zero) -> the tangents of out and lse.
#define JAX_FLASH_JVP_OPERANDS(X)    \
  JAX_FLASH_FWD_OPERANDS(X)          \
  X(out, "input", "the forward's")   \
  X(lse, "acc", "the forward's")     \
  X(q_dot, "input", "like q, or (0,)") \
  X(k_dot, "input", "like k, or (0,)") \
  X(v_dot, "input", "like v, or (0,)") \
  X(bias_dot, "acc", "the shape of bias, or (0,); the accumulation type whatever the bias's")
#define JAX_FLASH_JVP_RESULTS(X) \
  X(out_dot, "input", "like out") \
  X(lse_dot, "acc", "like lse")

// Attributes: X(type, name, meaning). Decoded into one struct per op
// (attrs.h); the forward and the JVP take the score attributes, the backward
// those and `deterministic`.
#define JAX_FLASH_SCORE_ATTRS(X)                                           \
  X(double, scale, "multiplies q.k")                                       \
  X(double, softcap, "logits x become softcap * tanh(x / softcap); 0 = off") \
  X(bool, is_causal, "key j <= query i (plus the chunk's diagonal)")       \
  X(int64_t, window_left, "j >= i - window_left; < 0 = unbounded")         \
  X(int64_t, window_right, "j <= i + window_right; < 0 = unbounded")       \
  X(double, dropout_rate, "drop probability in [0, 1); 0 = off")           \
  X(bool, broadcast_dropout, "one dropout mask for every batch element and head")
#define JAX_FLASH_FWD_ATTRS(X) JAX_FLASH_SCORE_ATTRS(X)
#define JAX_FLASH_JVP_ATTRS(X) JAX_FLASH_SCORE_ATTRS(X)
#define JAX_FLASH_BWD_OWN_ATTRS(X) \
  X(bool, deterministic, "bitwise-reproducible gradients (the CPU backward always is)")
#define JAX_FLASH_BWD_ATTRS(X) JAX_FLASH_SCORE_ATTRS(X) JAX_FLASH_BWD_OWN_ATTRS(X)

// The targets, by op.
#define JAX_FLASH_FWD_TARGET "jax_flash_fwd"
#define JAX_FLASH_BWD_TARGET "jax_flash_bwd"
#define JAX_FLASH_JVP_TARGET "jax_flash_jvp"

// Every op: X(target, operand list, result list, attribute list), each list
// one of the macros above (the mask operands follow each op's own operands).
#define JAX_FLASH_FFI_OPS(X)                                                                  \
  X(JAX_FLASH_FWD_TARGET, JAX_FLASH_FWD_OPERANDS, JAX_FLASH_FWD_RESULTS, JAX_FLASH_FWD_ATTRS) \
  X(JAX_FLASH_BWD_TARGET, JAX_FLASH_BWD_OPERANDS, JAX_FLASH_BWD_RESULTS, JAX_FLASH_BWD_ATTRS) \
  X(JAX_FLASH_JVP_TARGET, JAX_FLASH_JVP_OPERANDS, JAX_FLASH_JVP_RESULTS, JAX_FLASH_JVP_ATTRS)
