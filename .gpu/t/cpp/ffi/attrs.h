// The attributes of each op, decoded by XLA into a struct
// (XLA_FFI_REGISTER_STRUCT_ATTR_DECODING) from the lists in contract.h.
//
// A call must carry exactly the struct's attributes, each of its type
// (Python types them from the same lists, through ffi_contract()); XLA
// refuses any other call with an error naming what is wrong.
#pragma once

#include <cstdint>

#include "ffi/contract.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash::ffi_decode {

#define JAX_FLASH_ATTR_FIELD(type, name, meaning) type name;

// The forward's and the JVP's attributes.
struct ScoreAttrs {
  JAX_FLASH_SCORE_ATTRS(JAX_FLASH_ATTR_FIELD)
};

// The backward's: the score attributes, then its own (JAX_FLASH_BWD_ATTRS
// lists them in this order, which aggregate initialisation follows).
struct BwdAttrs : ScoreAttrs {
  JAX_FLASH_BWD_OWN_ATTRS(JAX_FLASH_ATTR_FIELD)
};

#undef JAX_FLASH_ATTR_FIELD

}  // namespace jax_flash::ffi_decode

// XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(T, StructMember<type>("name"), ...),
// the member list generated (the indirection expands it before the
// registration macro splits its arguments).
#define JAX_FLASH_STRUCT_MEMBER(type, name, meaning) , ::xla::ffi::StructMember<type>(#name)
#define JAX_FLASH_REGISTER_ATTRS(...) XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(__VA_ARGS__)

JAX_FLASH_REGISTER_ATTRS(::jax_flash::ffi_decode::ScoreAttrs
                             JAX_FLASH_SCORE_ATTRS(JAX_FLASH_STRUCT_MEMBER));
JAX_FLASH_REGISTER_ATTRS(::jax_flash::ffi_decode::BwdAttrs
                             JAX_FLASH_BWD_ATTRS(JAX_FLASH_STRUCT_MEMBER));
