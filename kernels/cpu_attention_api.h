// The CPU attention extension's entry points as plain C++ function pointers, for the other
// extension (cpu_fused_ops.cpp's decode step) to call without going back through Python.
//
// Two torch extensions cannot link against each other's symbols (each is a separate shared
// object, JIT-built and loaded by Python), so cpu_paged_attention.cpp hands out this table in a
// PyCapsule (`api()`), the way numpy shares its C API: the receiver checks the capsule's name,
// which carries the table's version, before using it. Both sides are built from this header.
#pragma once

#include <torch/extension.h>

namespace cpu_attention_api {

// Bump the version when a signature below changes: an extension built from the old header then
// refuses the capsule (ValueError) instead of calling through a mismatched pointer.
inline constexpr const char* CAPSULE_NAME = "cpu_paged_attention.api.v1";

struct Api {
  // New K/V rows [T, Hkv, D] into a head-major cache [Hkv, blocks, block_size, D] at their slots.
  void (*store_kv)(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k,
                   torch::Tensor v, torch::Tensor slot_mapping);
  // Attention of `query` [T, H, D] over the paged cache (seen as [blocks, block_size, Hkv, D])
  // into `out`; cpu_paged_attention.cpp says what each argument holds.
  void (*paged_attention)(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache,
                          torch::Tensor v_cache, torch::Tensor block_tables,
                          torch::Tensor seq_lens, torch::Tensor query_start_loc, double scale,
                          c10::optional<torch::Tensor> k_scale,
                          c10::optional<torch::Tensor> v_scale);
};

}  // namespace cpu_attention_api
