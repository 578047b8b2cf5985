// The tensor-level entry points of this library's kernels, for C++ callers in the library itself
// (fused_layers.cpp runs a step's layers without a Python or dispatcher hop per op). Each is
// exactly the function its op registers, so a C++ caller rounds as the op does.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace llmserve::ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> rotary_rotate_half(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                      const at::Tensor& sin);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& slots, const at::Tensor& seq_lens, double scaling, int64_t isa);
void extend_attention_batch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_pool,
                            const at::Tensor& v_pool, const at::Tensor& prefix_slots, at::IntArrayRef q_starts,
                            at::IntArrayRef extend_lens, at::IntArrayRef prefix_lens, double scale, int64_t impl,
                            at::Tensor& out);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor bf16_linear_packed(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                              const c10::optional<at::Tensor>& bias);
at::Tensor bf16_linear_packed_amx(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                  const c10::optional<at::Tensor>& bias);
at::Tensor int4_weight_linear_avx512(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t group,
                                     at::ScalarType scale_dtype, const c10::optional<at::Tensor>& bias, int64_t mode);
at::Tensor int8_weight_linear_avx512(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t n,
                                     const c10::optional<at::Tensor>& bias, int64_t mode);

}  // namespace llmserve::ops
