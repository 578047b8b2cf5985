// A decode step's Llama layers in one call (executor/fused_layers.py), and an extend step's on bf16 models whose
// extends run this library's extend attention (forward_extend).
//
// A one-token step of a small model is ~10 kernel calls per layer, and run from Python each pays a module
// call, the op's argument parsing and the dispatcher (~5-8 us) on top of its own work: on SmolLM2-135M
// (30 layers) that is about as much as the int4 linears themselves. FusedLayers binds each layer's
// weights, norms and KV buffers once, at load, and runs the layers back to back here, calling the very
// functions the ops register (ops.h) in the order the Python modules call them, so a step rounds exactly
// as the modules' step does (tests/unit/test_fused_layers.py holds the logits equal bit for bit).
//
// Per layer, as models/decoder.py + models/llama.py + attention/torch_native.py compose it:
//   (add +) RMSNorm -> qkv -> rotate-half rope on q, k -> store k, v at the step's slots
//   -> decode attention over each request's slots -> o_proj -> add + RMSNorm -> gate_up -> silu * up -> down
// (bf16 / fp16 activations: executor/fused_layers.py builds this for no other dtype)
// with the residual stream in float32. Linears: this library's packed bf16 (VDPBF16PS / AMX) and AVX-512
// int4 / int8 weight-only kernels, without bias (other kernels keep the Python path).
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "ops.h"

namespace {

// Matches executor/fused_layers.py's LinearKind.
enum class LinearKind : int64_t { bf16_packed = 0, int4_avx512 = 1, int8_avx512 = 2 };
constexpr int64_t kLinearFields = 5;  // per linear in add_layer's `shapes`: n, k, group, scale dtype, amx_min_rows
constexpr int64_t kLayerLinears = 4;  // qkv, o, gate_up, down

at::ScalarType scale_type(int64_t code) {
  switch (code) {
    case 0: return at::kFloat;
    case 1: return at::kBFloat16;
    case 2: return at::kHalf;
    default: TORCH_CHECK(false, "FusedLayers: scale dtype code ", code, " is not 0 (float32), 1 (bfloat16) or 2 (float16)");
  }
}

struct Linear {
  LinearKind kind;
  at::Tensor packed, scale;  // scale: int8's per-channel scales (undefined otherwise)
  int64_t n, k, group, amx_min_rows;
  at::ScalarType scale_dtype;

  // x [rows, k] -> [rows, n], as the module's kernel object calls its op.
  at::Tensor operator()(const at::Tensor& x) const {
    switch (kind) {
      case LinearKind::bf16_packed:
        if (amx_min_rows > 0 && x.numel() >= amx_min_rows * k)
          return llmserve::ops::bf16_linear_packed_amx(x, packed, n, std::nullopt);
        return llmserve::ops::bf16_linear_packed(x, packed, n, std::nullopt);
      case LinearKind::int4_avx512:
        return llmserve::ops::int4_weight_linear_avx512(x, packed, n, group, scale_dtype, std::nullopt, 0);
      case LinearKind::int8_avx512:
        return llmserve::ops::int8_weight_linear_avx512(x, packed, scale, n, std::nullopt, 0);
    }
    TORCH_CHECK(false, "FusedLayers: unknown linear kind");
  }
};

struct Layer {
  at::Tensor input_norm, post_attention_norm;  // [hidden], the activation dtype
  Linear qkv, o, gate_up, down;
  at::Tensor k_buf, v_buf;  // [slots, kv_heads, head_dim]: this layer's pool buffers
};

// buf[slots[t]] = rows[t] for each token t, as index_copy_ stores them: rows [tokens, kv_heads, head_dim] (heads
// contiguous, any row stride) in buf's dtype are copied row by row (slots checked in range by the caller);
// anything else takes index_copy_, whose dispatch and setup cost ~2-3 us a call (60 a step on SmolLM2: ~1%).
void store_rows(const at::Tensor& buf, const at::Tensor& slots, const at::Tensor& rows) {
  const int64_t row_elems = buf.size(1) * buf.size(2);
  if (rows.scalar_type() != buf.scalar_type() || rows.stride(2) != 1 || rows.stride(1) != rows.size(2)) {
    buf.index_copy_(0, slots, rows.to(buf.scalar_type()));
    return;
  }
  const int64_t esize = buf.element_size();
  const int64_t* slot = slots.data_ptr<int64_t>();
  char* dst = static_cast<char*>(buf.data_ptr());
  const char* src = static_cast<const char*>(rows.data_ptr());
  for (int64_t t = 0; t < rows.size(0); ++t)
    std::memcpy(dst + slot[t] * row_elems * esize, src + t * rows.stride(0) * esize, row_elems * esize);
}

class FusedLayers : public torch::CustomClassHolder {
 public:
  FusedLayers(int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
               double eps, double scaling)
      : hidden_(hidden), num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim),
        intermediate_(intermediate), eps_(eps), scaling_(scaling) {
    TORCH_CHECK(hidden > 0 && num_heads > 0 && num_kv_heads > 0 && head_dim > 0 && intermediate > 0 &&
                    num_heads % num_kv_heads == 0,
                "FusedLayers: sizes must be positive and num_heads a multiple of num_kv_heads");
  }

  // kinds: 4 LinearKind values (qkv, o, gate_up, down); weights: their packed weights; scales: int8's scales,
  // an empty tensor for the others; shapes: per linear n, k, group, scale dtype code, amx_min_rows (0: no AMX).
  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, at::Tensor k_buf, at::Tensor v_buf,
                 std::vector<int64_t> kinds, std::vector<at::Tensor> weights, std::vector<at::Tensor> scales,
                 std::vector<int64_t> shapes) {
    TORCH_CHECK(kinds.size() == kLayerLinears && weights.size() == kLayerLinears && scales.size() == kLayerLinears &&
                    shapes.size() == kLayerLinears * kLinearFields,
                "FusedLayers.add_layer: four linears (qkv, o, gate_up, down), five shape fields each");
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const int64_t expected[kLayerLinears][2] = {
        {q_size + 2 * kv_size, hidden_}, {hidden_, q_size}, {2 * intermediate_, hidden_}, {hidden_, intermediate_}};
    Linear linears[kLayerLinears];
    for (int64_t i = 0; i < kLayerLinears; ++i) {
      const int64_t* f = shapes.data() + i * kLinearFields;
      TORCH_CHECK(kinds[i] >= 0 && kinds[i] <= 2, "FusedLayers.add_layer: linear kind ", kinds[i], " unknown");
      TORCH_CHECK(f[0] == expected[i][0] && f[1] == expected[i][1], "FusedLayers.add_layer: linear ", i, " is ",
                  f[0], " x ", f[1], ", the model's shapes want ", expected[i][0], " x ", expected[i][1]);
      TORCH_CHECK(weights[i].is_contiguous(), "FusedLayers.add_layer: packed weights must be contiguous");
      const auto kind = static_cast<LinearKind>(kinds[i]);
      TORCH_CHECK(kind != LinearKind::int8_avx512 || scales[i].numel() > 0, "FusedLayers.add_layer: int8 needs scales");
      const at::Tensor scale = kind == LinearKind::int8_avx512 ? scales[i] : at::Tensor();
      linears[i] = Linear{kind, weights[i], scale, /*n=*/f[0], /*k=*/f[1], /*group=*/f[2], /*amx_min_rows=*/f[4],
                          scale_type(f[3])};
    }
    TORCH_CHECK(input_norm.numel() == hidden_ && post_attention_norm.numel() == hidden_,
                "FusedLayers.add_layer: norm weights must have hidden_size elements");
    TORCH_CHECK(k_buf.dim() == 3 && v_buf.dim() == 3 && k_buf.size(1) == num_kv_heads_ && k_buf.size(2) == head_dim_ &&
                    v_buf.sizes() == k_buf.sizes() && k_buf.is_contiguous() && v_buf.is_contiguous(),
                "FusedLayers.add_layer: KV buffers must be contiguous [slots, ", num_kv_heads_, ", ", head_dim_, "]");
    layers_.push_back(Layer{input_norm, post_attention_norm, linears[0], linears[1], linears[2], linears[3], k_buf,
                            v_buf});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // benchmarks/linear_bandwidth.py: every layer's four linears back to back on `rows` rows of `like`'s dtype (zeros),
  // as a decode step calls them from here, `repeats` times; -> the fastest pass in seconds.
  double time_linears(int64_t rows, int64_t repeats, at::Tensor like) const {
    TORCH_CHECK(rows > 0 && repeats > 0, "FusedLayers.time_linears: rows and repeats must be positive");
    const int64_t q_size = num_heads_ * head_dim_;
    const auto options = like.options();
    const at::Tensor x_hidden = at::zeros({rows, hidden_}, options), x_q = at::zeros({rows, q_size}, options);
    const at::Tensor x_inter = at::zeros({rows, intermediate_}, options);
    double best = std::numeric_limits<double>::infinity();
    for (int64_t r = 0; r < repeats; ++r) {
      const auto start = std::chrono::steady_clock::now();
      for (const Layer& layer : layers_) {
        layer.qkv(x_hidden);
        layer.o(x_q);
        layer.gate_up(x_hidden);
        layer.down(x_inter);
      }
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    return best;
  }

  // hidden [B, hidden]: the step's token embeddings (one token per request); cos, sin [B, 1, head_dim] in the
  // activation dtype; out_slots [B]: where each request's new K/V go; slot_index [B, L] and seq_lens [B]: the
  // decode attention's metadata. -> (the last layer's MLP output [B, hidden], the residual stream in float32).
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor hidden, at::Tensor cos, at::Tensor sin, at::Tensor out_slots,
                                             at::Tensor slot_index, at::Tensor seq_lens) const {
    TORCH_CHECK(seq_lens.numel() == hidden.size(0), "FusedLayers.forward: one token and one length per request");
    return run(hidden, cos, sin, out_slots, "forward", [&](const Layer& layer, const at::Tensor& q, const at::Tensor&,
                                                           const at::Tensor&) {
      return llmserve::ops::decode_attention(q.contiguous(), layer.k_buf, layer.v_buf, slot_index, seq_lens, scaling_, 0);
    });
  }

  // An extend step (bf16, this library's extend attention as attention/torch_native.py's _extend runs it):
  // hidden [T, hidden] the new tokens' embeddings, cos / sin [T, 1, head_dim], out_slots [T]; the extends as
  // extend_attention_batch takes them (prefix_slots, q_starts, extend_lens, prefix_lens, impl); the requests
  // adding one token to a cached prefix (a mixed step's riders) as one decode: their rows one_tokens [n] and the
  // decode metadata one_slot_index [n, L], one_seq_lens [n] (n may be 0). -> as forward.
  std::tuple<at::Tensor, at::Tensor> forward_extend(at::Tensor hidden, at::Tensor cos, at::Tensor sin,
                                                    at::Tensor out_slots, at::Tensor prefix_slots,
                                                    std::vector<int64_t> q_starts, std::vector<int64_t> extend_lens,
                                                    std::vector<int64_t> prefix_lens, int64_t impl,
                                                    at::Tensor one_tokens, at::Tensor one_slot_index,
                                                    at::Tensor one_seq_lens) const {
    TORCH_CHECK(one_tokens.numel() == one_seq_lens.numel(), "FusedLayers.forward_extend: one length per one-token row");
    return run(hidden, cos, sin, out_slots, "forward_extend", [&](const Layer& layer, const at::Tensor& q,
                                                                  const at::Tensor& k, const at::Tensor& v) {
      at::Tensor out = at::empty(q.sizes(), q.options());
      if (one_tokens.numel() > 0) {
        const at::Tensor rows = q.index_select(0, one_tokens);  // [n, heads, head_dim]
        out.index_copy_(0, one_tokens, llmserve::ops::decode_attention(rows.contiguous(), layer.k_buf, layer.v_buf,
                                                                       one_slot_index, one_seq_lens, scaling_, 0));
      }
      llmserve::ops::extend_attention_batch(q, k, v, layer.k_buf, layer.v_buf, prefix_slots, q_starts, extend_lens,
                                            prefix_lens, scaling_, impl, out);
      return out;
    });
  }

 private:
  // The layers over the step's tokens, `attend` (layer, rotated q, rotated k, v) -> [tokens, heads, head_dim]
  // after this step's k, v are stored.
  template <class Attend>
  std::tuple<at::Tensor, at::Tensor> run(at::Tensor hidden, const at::Tensor& cos, const at::Tensor& sin,
                                         const at::Tensor& out_slots, const char* fn, Attend&& attend) const {
    TORCH_CHECK(!layers_.empty(), "FusedLayers.", fn, ": no layers");
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == hidden_, "FusedLayers.", fn, ": hidden must be [tokens, ",
                hidden_, "]");
    const int64_t tokens = hidden.size(0);
    TORCH_CHECK(out_slots.numel() == tokens, "FusedLayers.", fn, ": one slot per token");
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const at::Tensor slots = out_slots.to(at::kLong).contiguous();
    const int64_t pool_slots = layers_.front().k_buf.size(0);
    const int64_t* slot = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t)
      TORCH_CHECK(slot[t] >= 0 && slot[t] < pool_slots, "FusedLayers.", fn, ": slot ", slot[t], " out of the pool's [0, ",
                  pool_slots, ")");
    at::Tensor residual, x;
    for (const Layer& layer : layers_) {
      if (!residual.defined()) {  // first layer: the embedding is the residual
        residual = hidden;
        x = llmserve::ops::rms_norm(hidden, layer.input_norm, eps_);
      } else {
        std::tie(x, residual) = llmserve::ops::fused_add_rms_norm(hidden, residual, layer.input_norm, eps_);
      }
      const at::Tensor qkv = layer.qkv(x);  // [tokens, q_size + 2 kv_size]
      const at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads_, head_dim_});
      const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
      auto [q_rot, k_rot] = llmserve::ops::rotary_rotate_half(q, k, cos, sin);
      store_rows(layer.k_buf, slots, k_rot);
      store_rows(layer.v_buf, slots, v);
      const at::Tensor attn = attend(layer, q_rot, k_rot, v);  // [tokens, heads, head_dim]
      hidden = layer.o(attn.reshape({tokens, q_size}));
      std::tie(x, residual) = llmserve::ops::fused_add_rms_norm(hidden, residual, layer.post_attention_norm, eps_);
      const at::Tensor gate_up = layer.gate_up(x);  // [tokens, 2 intermediate]: gate | up
      hidden = layer.down(llmserve::ops::silu_and_mul(gate_up));  // bf16 / fp16, as layers/mlp.py calls it
    }
    return {hidden, residual};
  }

  int64_t hidden_, num_heads_, num_kv_heads_, head_dim_, intermediate_;
  double eps_, scaling_;
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.class_<FusedLayers>("FusedLayers")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &FusedLayers::add_layer)
      .def("num_layers", &FusedLayers::num_layers)
      .def("time_linears", &FusedLayers::time_linears)
      .def("forward", &FusedLayers::forward)
      .def("forward_extend", &FusedLayers::forward_extend);
}
