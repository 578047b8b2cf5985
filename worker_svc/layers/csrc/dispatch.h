// Dtype dispatch over the three activation / cache dtypes the engine runs (float32, bfloat16,
// float16): fewer template instantiations than AT_DISPATCH_FLOATING_TYPES_AND2 (which adds double),
// so the library builds faster.
#pragma once

#include <ATen/ATen.h>

namespace llmserve {

template <typename F>
void dispatch_float(at::ScalarType type, const char* what, F&& body) {
  switch (type) {
    case at::kFloat: body(float{}); break;
    case at::kBFloat16: body(c10::BFloat16{}); break;
    case at::kHalf: body(c10::Half{}); break;
    default: TORCH_CHECK(false, what, ": unsupported dtype ", type, " (float32, bfloat16 or float16)");
  }
}

}  // namespace llmserve
