// A decoder layer's elementwise work on CPU, one pass each instead of torch's
// chain of ops: RMSNorm (alone, after the residual add, or a branch's norm,
// the add and the next norm), SiLU- and GELU-and-mul and the rotary
// embedding of q and k (after their norms, where a model has them); and a
// grammar's masks laid on logit rows. In a one-token step the chains'
// per-op overhead is most of what is not a product; in a 32-row step their
// passes over memory are.
//
// Each kernel rounds to the tensor's dtype where torch's chain rounds (bf16
// after every op), so a bf16 model takes the tokens of its torch ops but for
// the last bit of an fp32 sum or exp. Rows are split over threads only when
// there are enough of them to pay for waking the threads (prefill).
//
// Registered as torch.ops.specpage_cpu.*; the Python side and the pure-torch
// references are in specpage/layers/fused.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>

#include "vec.h"

namespace {

using namespace specpage_cpu;

constexpr int64_t kSerialElements = 1 << 16;  // below this many, one thread

// f(scalar_t{}) for the dtypes the kernels take (check_rows has checked it).
template <typename F>
void by_dtype(at::ScalarType type, F&& f) {
  if (type == at::kFloat) {
    f(float{});
  } else {
    f(c10::BFloat16{});
  }
}

int64_t row_grain(int64_t width) { return std::max<int64_t>(1, kSerialElements / width); }

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % kLanes == 0, name,
              " must be [rows, width] with unit column stride and width a multiple of ",
              kLanes);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", x.scalar_type());
}

// out = weight * (x * rsqrt(mean(x^2) + eps)), the sum in fp32. A weight in
// x's dtype multiplies x * rsqrt rounded to that dtype, as specpage's RMSNorm
// (and Llama's) computes it; a float32 weight for bf16 x multiplies before
// the one rounding, as Gemma's RMSNorm scales by (1 + weight) in fp32.
template <typename scalar_t, typename weight_t>
void norm_row(const scalar_t* x, const weight_t* weight, scalar_t* out, int64_t width,
              float eps) {
  vfloat squares = vfloat{};
  for (int64_t i = 0; i < width; i += kLanes) {
    const vfloat v = load(x + i);
    squares += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum_lanes(squares) / static_cast<float>(width) + eps);
  for (int64_t i = 0; i < width; i += kLanes) {
    if constexpr (std::is_same_v<weight_t, scalar_t>) {
      const vfloat normed = rounded<scalar_t>(load(x + i) * inv);
      store(out + i, load(weight + i) * normed);
    } else {
      store(out + i, load(x + i) * inv * load(weight + i));
    }
  }
}

// f(weight_t{}) for a norm's weight: x's dtype, or float32 (x bf16 only).
template <typename scalar_t, typename F>
void by_weight(const at::Tensor& weight, F&& f) {
  if (weight.scalar_type() == at::kFloat) {
    f(float{});
  } else {
    f(scalar_t{});
  }
}

void check_weight(const at::Tensor& weight, const at::Tensor& x) {
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  (weight.scalar_type() == x.scalar_type() ||
                   weight.scalar_type() == at::kFloat),
              "weight must be contiguous [width] in x's dtype or float32");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_weight(weight, x);
  const int64_t rows = x.size(0), width = x.size(1);
  at::Tensor out = at::empty({rows, width}, x.options());
  by_dtype(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    by_weight<scalar_t>(weight, [&](auto weight_tag) {
      using weight_t = decltype(weight_tag);
      const scalar_t* src = x.data_ptr<scalar_t>();
      const weight_t* w = weight.data_ptr<weight_t>();
      scalar_t* dst = out.data_ptr<scalar_t>();
      const int64_t stride = x.stride(0);
      at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          norm_row(src + r * stride, w, dst + r * width, width, static_cast<float>(eps));
        }
      });
    });
  });
  return out;
}

// (x + residual, rms_norm(x + residual)): the sum rounded to the dtype, as
// torch's add, and normed from the rounded sum; where branch_weight is
// given, x is first normed by it (rounded to the dtype, as rms_norm's
// output): Gemma 3's branch norm, its add and the next norm in one pass.
std::tuple<at::Tensor, at::Tensor> add_norm_rows(const at::Tensor& x, const at::Tensor& residual,
                                                 const at::Tensor* branch_weight,
                                                 const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual must have one shape and dtype");
  check_weight(weight, x);
  if (branch_weight != nullptr) {
    check_weight(*branch_weight, x);
    TORCH_CHECK(branch_weight->scalar_type() == weight.scalar_type(),
                "branch_weight and weight must have one dtype");
  }
  const int64_t rows = x.size(0), width = x.size(1);
  at::Tensor sum = at::empty({rows, width}, x.options());
  at::Tensor out = at::empty({rows, width}, x.options());
  by_dtype(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    by_weight<scalar_t>(weight, [&](auto weight_tag) {
      using weight_t = decltype(weight_tag);
      const scalar_t* a = x.data_ptr<scalar_t>();
      const scalar_t* b = residual.data_ptr<scalar_t>();
      const weight_t* w = weight.data_ptr<weight_t>();
      const weight_t* bw = branch_weight == nullptr ? nullptr : branch_weight->data_ptr<weight_t>();
      scalar_t* s = sum.data_ptr<scalar_t>();
      scalar_t* dst = out.data_ptr<scalar_t>();
      const int64_t stride_a = x.stride(0), stride_b = residual.stride(0);
      at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          scalar_t* row = s + r * width;
          const scalar_t* branch = a + r * stride_a;
          if (bw != nullptr) {  // the branch normed into the sum's row, then added there
            norm_row(branch, bw, row, width, static_cast<float>(eps));
            branch = row;
          }
          for (int64_t i = 0; i < width; i += kLanes) {
            store(row + i, load(branch + i) + load(b + r * stride_b + i));
          }
          norm_row(row, w, dst + r * width, width, static_cast<float>(eps));
        }
      });
    });
  });
  return {sum, out};
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  return add_norm_rows(x, residual, nullptr, weight, eps);
}

// add_rms_norm(rms_norm(x, branch_weight), residual, weight), value for value.
std::tuple<at::Tensor, at::Tensor> normed_add_rms_norm(const at::Tensor& x,
                                                       const at::Tensor& residual,
                                                       const at::Tensor& branch_weight,
                                                       const at::Tensor& weight, double eps) {
  return add_norm_rows(x, residual, &branch_weight, weight, eps);
}

// gate_up [rows, 2 * width] (gate, then up) -> act(gate) * up [rows, width],
// act's value rounded to the dtype before the product, as torch's two ops.
template <typename Activation>
at::Tensor gated(const at::Tensor& gate_up, Activation&& act) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % (2 * kLanes) == 0, "gate_up's width must be a multiple of ",
              2 * kLanes);
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  by_dtype(gate_up.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* src = gate_up.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    const int64_t stride = gate_up.stride(0);
    at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = src + r * stride;
        const scalar_t* up = gate + width;
        for (int64_t i = 0; i < width; i += kLanes) {
          store(dst + r * width + i, rounded<scalar_t>(act(load(gate + i))) * load(up + i));
        }
      }
    });
  });
  return out;
}

// silu(gate) * up, as F.silu(gate) * up.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  return gated(gate_up, [](vfloat g) { return g / (1.0f + vexp(-g)); });
}

// gelu(gate) * up with GELU's tanh approximation (F.gelu(gate,
// approximate="tanh") * up: Gemma's GeGLU) in torch's order, 0.5 x (1 +
// tanh(z)), with tanh(z) = 2 sigmoid(2z) - 1 by exp as SiLU takes it: one
// rounding onto fp32's grid near +-1, as torch's tanh, so that 1 + tanh(z)
// takes the same steps (and is 0 where tanh(z) rounds to -1, below about
// x = -5, as torch's).
at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up) {
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  return gated(gate_up, [](vfloat g) {
    const vfloat z = kBeta * (g + kKappa * (g * g * g));
    const vfloat tanh = 2.0f / (1.0f + vexp(-2.0f * z)) - 1.0f;
    return 0.5f * g * (1.0f + tanh);
  });
}

// x * cos + rotate_half(x) * sin for one head, each product rounded to the
// dtype before the sum, as torch's ops.
template <typename scalar_t>
void rotate_head(const scalar_t* x, const scalar_t* cos, const scalar_t* sin, scalar_t* out,
                 int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; i += kLanes) {
    const vfloat lo = load(x + i), hi = load(x + half + i);
    store(out + i, rounded<scalar_t>(lo * load(cos + i))
                       + rounded<scalar_t>(-hi * load(sin + i)));
    store(out + half + i, rounded<scalar_t>(hi * load(cos + half + i))
                              + rounded<scalar_t>(lo * load(sin + half + i)));
  }
}

// qkv [tokens, (heads + 2 kv_heads) * head_dim] -> (q [tokens, heads, head_dim],
// k [tokens, kv_heads, head_dim]) rotated by cos, sin [tokens, head_dim].
// What both rotary kernels check of their operands.
void check_rope(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [tokens, width]");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16,
              "qkv must be float32 or bfloat16, got ", qkv.scalar_type());
  const int64_t tokens = qkv.size(0), head_dim = cos.size(1);
  TORCH_CHECK(head_dim % (2 * kLanes) == 0, "head_dim must be a multiple of ", 2 * kLanes);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * head_dim, "qkv's width is not ",
              "(heads + 2 kv_heads) * head_dim");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == tokens && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type(),
              "cos and sin must be contiguous [tokens, head_dim] in qkv's dtype");
}

// Each token t's q heads of qkv rotated into q, its k heads into `keys` at
// row slots[t] (a row: kv_heads x head_dim), and where `values` is not null
// its v copied to the same row there; slots null: row t.
void rotate_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                int64_t heads, int64_t kv_heads, at::Tensor& q, void* keys, void* values,
                const int64_t* slots) {
  const int64_t tokens = qkv.size(0), head_dim = cos.size(1);
  by_dtype(qkv.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* src = qkv.data_ptr<scalar_t>();
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    scalar_t* q_out = q.data_ptr<scalar_t>();
    const int64_t stride = qkv.stride(0), rotated = heads + kv_heads;
    const int64_t kv_width = kv_heads * head_dim;
    at::parallel_for(0, tokens, row_grain(rotated * head_dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* row = src + t * stride;
        const int64_t slot = slots == nullptr ? t : slots[t];
        for (int64_t h = 0; h < rotated; ++h) {
          scalar_t* dst = h < heads ? q_out + (t * heads + h) * head_dim
                                    : static_cast<scalar_t*>(keys) + slot * kv_width
                                          + (h - heads) * head_dim;
          rotate_head(row + h * head_dim, c + t * head_dim, s + t * head_dim, dst, head_dim);
        }
        if (values != nullptr) {
          std::memcpy(static_cast<scalar_t*>(values) + slot * kv_width,
                      row + rotated * head_dim, kv_width * sizeof(scalar_t));
        }
      }
    });
  });
}

std::tuple<at::Tensor, at::Tensor> rope_qk(const at::Tensor& qkv, const at::Tensor& cos,
                                           const at::Tensor& sin, int64_t heads,
                                           int64_t kv_heads) {
  check_rope(qkv, cos, sin, heads, kv_heads);
  const int64_t tokens = qkv.size(0), head_dim = cos.size(1);
  at::Tensor q = at::empty({tokens, heads, head_dim}, qkv.options());
  at::Tensor k = at::empty({tokens, kv_heads, head_dim}, qkv.options());
  rotate_qkv(qkv, cos, sin, heads, kv_heads, q, k.data_ptr(), nullptr, nullptr);
  return {q, k};
}

// rope_qk that writes its k, and v, into a layer's paged KV cache instead of
// returning k: cache [2, blocks, block_size, kv_heads, head_dim] (K, then V),
// token t's at flat slot slot_mapping[t] (block * block_size + offset), as
// the attention backends' write_kv puts them. Returns q.
at::Tensor rope_qk_into_cache(const at::Tensor& qkv, const at::Tensor& cos,
                              const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                              at::Tensor& cache, const at::Tensor& slot_mapping) {
  check_rope(qkv, cos, sin, heads, kv_heads);
  const int64_t tokens = qkv.size(0), head_dim = cos.size(1);
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous() &&
                  cache.scalar_type() == qkv.scalar_type() && cache.size(3) == kv_heads &&
                  cache.size(4) == head_dim,
              "cache must be contiguous [2, blocks, block_size, kv_heads, head_dim] in qkv's "
              "dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64 [tokens]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = cache.size(1) * cache.size(2);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " of token ", t,
                " is outside the cache's ", num_slots, " slots");
  }
  at::Tensor q = at::empty({tokens, heads, head_dim}, qkv.options());
  char* keys = static_cast<char*>(cache.data_ptr());
  char* values = keys + cache.stride(0) * cache.element_size();
  rotate_qkv(qkv, cos, sin, heads, kv_heads, q, keys, values, slots);
  return q;
}

// rope_qk_into_cache after an RMSNorm of each q head (weight q_norm [head_dim])
// and each k head (k_norm), as Gemma 3 and Qwen3 norm them: what rms_norm
// over the heads' rows, their concatenation with v and rope_qk_into_cache
// compute, value for value (the normed heads rounded to qkv's dtype before
// they are rotated), in one call. Returns q.
at::Tensor norm_rope_qk_into_cache(const at::Tensor& qkv, const at::Tensor& q_norm,
                                   const at::Tensor& k_norm, double eps, const at::Tensor& cos,
                                   const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                                   at::Tensor& cache, const at::Tensor& slot_mapping) {
  check_rope(qkv, cos, sin, heads, kv_heads);
  const int64_t tokens = qkv.size(0), head_dim = cos.size(1);
  const at::Tensor head = qkv.narrow(1, 0, head_dim);  // a head's width: the weights'
  check_weight(q_norm, head);
  check_weight(k_norm, head);
  TORCH_CHECK(q_norm.scalar_type() == k_norm.scalar_type(),
              "q_norm and k_norm must have one dtype");
  at::Tensor normed = at::empty({tokens, qkv.size(1)}, qkv.options());
  by_dtype(qkv.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    by_weight<scalar_t>(q_norm, [&](auto weight_tag) {
      using weight_t = decltype(weight_tag);
      const scalar_t* src = qkv.data_ptr<scalar_t>();
      scalar_t* dst = normed.data_ptr<scalar_t>();
      const weight_t* wq = q_norm.data_ptr<weight_t>();
      const weight_t* wk = k_norm.data_ptr<weight_t>();
      const int64_t stride = qkv.stride(0), width = qkv.size(1);
      const int64_t rotated = heads + kv_heads;
      at::parallel_for(0, tokens, row_grain(width), [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const scalar_t* row = src + t * stride;
          scalar_t* out = dst + t * width;
          for (int64_t h = 0; h < rotated; ++h) {
            norm_row(row + h * head_dim, h < heads ? wq : wk, out + h * head_dim, head_dim,
                     static_cast<float>(eps));
          }
          std::memcpy(out + rotated * head_dim, row + rotated * head_dim,
                      kv_heads * head_dim * sizeof(scalar_t));
        }
      });
    });
  });
  return rope_qk_into_cache(normed, cos, sin, heads, kv_heads, cache, slot_mapping);
}

// Structured outputs: -inf at every token of a logit row that its grammar's
// bitmask (one bit per token, set where allowed, 32 to a little-endian int32)
// forbids, in place; tokens past the mask's width are forbidden. A mask
// mostly forbids (JSON allows a handful of tokens at most positions), so a
// byte that allows all eight is skipped and one that allows none is written
// whole; rows go to threads when there are many of them.
void grammar_mask_(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& masks) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.stride(1) == 1,
              "logits must be fp32 [rows, vocab] with adjacent columns");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "rows must be contiguous int64 [n]");
  TORCH_CHECK(masks.dim() == 2 && masks.scalar_type() == at::kByte && masks.is_contiguous() &&
                  masks.size(0) == rows.size(0),
              "masks must be contiguous uint8 [n, bytes], one per row");
  const int64_t n = rows.size(0), vocab = logits.size(1), width = masks.size(1);
  const int64_t* row_index = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(row_index[i] >= 0 && row_index[i] < logits.size(0), "row ", row_index[i],
                " is outside the logits' ", logits.size(0), " rows");
  }
  const uint8_t* bits = masks.data_ptr<uint8_t>();
  float* base = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  const float forbidden = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n, n >= 16 ? 1 : n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = base + row_index[i] * stride;
      const uint8_t* mask = bits + i * width;
      const int64_t whole = std::min(width, vocab / 8);
      int64_t b = 0;
      for (; b + 8 <= whole; b += 8) {  // 64 tokens at a time: all allowed, or none
        uint64_t word;
        std::memcpy(&word, mask + b, sizeof(word));
        if (word == ~uint64_t{0}) continue;
        if (word == 0) {
          std::fill(row + b * 8, row + b * 8 + 64, forbidden);
          continue;
        }
        for (int64_t c = b; c < b + 8; ++c) {
          const uint8_t m = mask[c];
          if (m == 0xFF) continue;
          for (int t = 0; t < 8; ++t) {
            if (!((m >> t) & 1)) row[c * 8 + t] = forbidden;
          }
        }
      }
      for (; b < whole; ++b) {
        const uint8_t m = mask[b];
        for (int t = 0; t < 8; ++t) {
          if (!((m >> t) & 1)) row[b * 8 + t] = forbidden;
        }
      }
      for (int64_t t = whole * 8; t < vocab; ++t) {  // a last part byte, then past the mask
        const int64_t b = t / 8;
        if (b >= width || !((mask[b] >> (t % 8)) & 1)) row[t] = forbidden;
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpage_cpu, m) {
  m.def("grammar_mask_(Tensor(a!) logits, Tensor rows, Tensor masks) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("normed_add_rms_norm(Tensor x, Tensor residual, Tensor branch_weight, Tensor weight, "
        "float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor gate_up) -> Tensor");
  m.def("rope_qk(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads) -> (Tensor, Tensor)");
  m.def("rope_qk_into_cache(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads, "
        "Tensor(a!) cache, Tensor slot_mapping) -> Tensor");
  m.def("norm_rope_qk_into_cache(Tensor qkv, Tensor q_norm, Tensor k_norm, float eps, "
        "Tensor cos, Tensor sin, int heads, int kv_heads, Tensor(a!) cache, "
        "Tensor slot_mapping) -> Tensor");
}

TORCH_LIBRARY_IMPL(specpage_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("normed_add_rms_norm", &normed_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.impl("rope_qk", &rope_qk);
  m.impl("rope_qk_into_cache", &rope_qk_into_cache);
  m.impl("norm_rope_qk_into_cache", &norm_rope_qk_into_cache);
  m.impl("grammar_mask_", &grammar_mask_);
}
