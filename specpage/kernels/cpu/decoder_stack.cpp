// A decoder's layers in one call, for the decode and verify steps
// specpage/layers/native_stack.py takes: per layer the same kernel calls in
// the same order as DecoderLayer.forward (the other ops of this extension,
// and oneDNN's linear where a product runs there), made from C++ through
// the dispatcher instead of one Python call each. On SmolLM2-135M's 30
// layers a step makes ~270 of them; from Python each costs a few
// microseconds of argument parsing and dispatch.
//
// A batch-1 step's products are bound by reading their weights, and its
// other ops (norms, rotary embedding, SiLU) leave memory idle on one
// thread. Each of those runs in a parallel region where the other threads
// read ahead, meanwhile, the weights of the products that follow, each
// thread the share it will compute (overlapped()); each int4 product also
// runs its reading on into the next one's (int4_gemv.cpp). On SmolLM2-135M
// q4, 2 cores, steps interleaved with steps without them in one process, the
// two took about 4% off a step (2-7% block by block of 40-60 steps); from
// one process to the next the same step moved by up to 25%.
//
// Qwen3's layers take their q/k norms (each head of q and k through an
// RMSNorm before the rotary embedding, in the same call as the rotation:
// fused_ops.cpp's norm_rope_qk_into_cache) and any layer its sliding window.
// Gemma 3's take four norms (before and after each branch; a branch's norm,
// its add and the next norm in one call), each scaling by a float32 (1 +
// weight) in the norm kernels, a GeGLU MLP (tanh GELU: fused_ops.cpp's
// gelu_tanh_and_mul, as models/gemma3.py) and, on their sliding layers, a
// rotary table of their own.
//
// Registered as torch.ops.specpage_cpu.decoder_stack.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <exception>
#include <optional>
#include <tuple>
#include <vector>

namespace {

// How a product is computed, and how many operands (after x) it takes from
// the flat operand list; layers/native_stack.py writes the same codes.
enum Kind : int64_t { kGemv = 0, kPanels = 1, kInt4 = 2, kOneDnn = 3, kInt8x = 4, kKQuant = 5 };
// K-quant products (kquant_gemv.cpp) of 1 to kKQuantRuns runs of one GGML
// type each are kinds kKQuant .. kKQuant + kKQuantRuns - 1: operands an
// int64 [runs, 3] of (type, first column, outputs), then each run's tiles.
constexpr int64_t kKQuantRuns = 4;

int64_t kquant_runs(int64_t kind) {
  return kind >= kKQuant && kind < kKQuant + kKQuantRuns ? kind - kKQuant + 1 : 0;
}

// The kinds that read int4_gemv.cpp's tiles, in output blocks of 16.
bool reads_tiles(int64_t kind) { return kind == kInt4 || kind == kInt8x; }

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using Tensor = at::Tensor;
using Pair = std::tuple<Tensor, Tensor>;

struct Ops {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rms_norm =
      op<Tensor(const Tensor&, const Tensor&, double)>("specpage_cpu::rms_norm");
  c10::TypedOperatorHandle<Pair(const Tensor&, const Tensor&, const Tensor&, double)>
      add_rms_norm = op<Pair(const Tensor&, const Tensor&, const Tensor&, double)>(
          "specpage_cpu::add_rms_norm");
  c10::TypedOperatorHandle<Pair(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                double)>
      normed_add_rms_norm = op<Pair(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                    double)>("specpage_cpu::normed_add_rms_norm");
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_and_mul =
      op<Tensor(const Tensor&)>("specpage_cpu::silu_and_mul");
  c10::TypedOperatorHandle<Tensor(const Tensor&)> gelu_tanh_and_mul =
      op<Tensor(const Tensor&)>("specpage_cpu::gelu_tanh_and_mul");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t,
                                  Tensor&, const Tensor&)>
      rope_into_cache = op<Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t,
                                  Tensor&, const Tensor&)>("specpage_cpu::rope_qk_into_cache");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, double,
                                  const Tensor&, const Tensor&, int64_t, int64_t, Tensor&,
                                  const Tensor&)>
      norm_rope_into_cache =
          op<Tensor(const Tensor&, const Tensor&, const Tensor&, double, const Tensor&,
                    const Tensor&, int64_t, int64_t, Tensor&, const Tensor&)>(
              "specpage_cpu::norm_rope_qk_into_cache");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, double, int64_t)>
      attention = op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&, double, int64_t)>("specpage_cpu::paged_attention");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&)> gemv =
      op<Tensor(const Tensor&, const Tensor&)>("specpage_cpu::bf16_gemv");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t)> panels =
      op<Tensor(const Tensor&, const Tensor&, int64_t)>("specpage_cpu::bf16_panels_product");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&)>
      int4 = op<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&)>(
          "specpage_cpu::int4_gemv");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&)>
      int8x = op<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&)>(
          "specpage_cpu::int8x_gemv");
  c10::TypedOperatorHandle<Tensor(const Tensor&)> kquant_x =
      op<Tensor(const Tensor&)>("specpage_cpu::kquant_quantize_x");
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, int64_t, int64_t, Tensor&, int64_t)>
      kquant = op<void(const Tensor&, const Tensor&, int64_t, int64_t, Tensor&, int64_t)>(
          "specpage_cpu::kquant_gemv");
};

const Ops& ops() {
  static const Ops handles;  // looked up on first use: every op is registered by then
  return handles;
}

// oneDNN's linear on its packed weight (what cpu_linear calls for rows no
// native kernel takes); looked up apart, as a build of torch without it
// fails only the plans that use it.
Tensor onednn_linear(const Tensor& x, const Tensor& packed) {
  static const auto handle =
      op<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, c10::string_view,
                c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>(
          "mkldnn::_linear_pointwise");
  return handle.call(x, packed, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(),
                     c10::string_view(""));
}

int64_t operand_count(int64_t kind) {
  switch (kind) {
    case kGemv: return 1;    // weight
    case kPanels: return 1;  // packed panels (and outs[i])
    case kInt4: return 1;    // tiles (layers/quant.py's int4_stream)
    case kInt8x: return 1;   // tiles (layers/quant.py's int8x_stream)
    case kOneDnn: return 1;  // packed weight
    default:
      TORCH_CHECK(kquant_runs(kind) > 0, "decoder_stack: unknown product kind ", kind);
      return 1 + kquant_runs(kind);  // (type, column, outputs) of each run, then its tiles
  }
}

struct Product {
  int64_t kind, out;
  const Tensor* operands;
  std::optional<Tensor> next = std::nullopt;  // the next product's tiles, read on into
};

// KQuantLinear.int8_product, then its cast to x's dtype: x to int8 once,
// each run's products into its columns of y, in x's dtype where that is
// bf16 (the kernel rounds each output as the cast of its fp32 value does).
Tensor kquant_product(const Product& p, const Tensor& x) {
  const Tensor& runs = p.operands[0];
  const int64_t count = kquant_runs(p.kind);
  TORCH_CHECK(runs.scalar_type() == at::kLong && runs.is_contiguous() && runs.dim() == 2 &&
                  runs.size(0) == count && runs.size(1) == 3,
              "decoder_stack: a K-quant product's runs must be int64 [", count, ", 3]");
  const int64_t* run = runs.data_ptr<int64_t>();
  const Tensor xq = ops().kquant_x.call(x.contiguous());
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  Tensor y = at::empty({x.size(0), p.out}, x.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  for (int64_t r = 0; r < count; ++r) {
    ops().kquant.call(xq, p.operands[1 + r], run[3 * r], run[3 * r + 2], y, run[3 * r + 1]);
  }
  return bf16 ? y : y.to(x.scalar_type());
}

Tensor product(const Product& p, const Tensor& x) {
  switch (p.kind) {
    case kGemv: return ops().gemv.call(x, p.operands[0]);
    case kPanels: return ops().panels.call(x, p.operands[0], p.out);
    case kInt4: return ops().int4.call(x, p.operands[0], p.next);
    case kInt8x: return ops().int8x.call(x, p.operands[0], p.next);
    case kOneDnn: return onednn_linear(x, p.operands[0]);
    default: return kquant_product(p, x);
  }
}

// A product's weights as its threads read them: output blocks of 16 split
// over threads as at::parallel_for splits them (the gemv and int4 kernels;
// each run's tiles of 16 outputs for the K-quant kernels); none (no parts)
// for the kernels that read otherwise.
struct Part {
  const uint8_t* data = nullptr;
  int64_t blocks = 0, block_bytes = 0;
};
struct Weight {
  std::array<Part, kKQuantRuns> parts{};
  int64_t count = 0;
};

Weight weight_of(const Product& p) {
  Weight w;
  auto add = [&w](const Tensor& t, int64_t blocks) {
    if (blocks > 0) {
      w.parts[w.count++] = {static_cast<const uint8_t*>(t.data_ptr()), blocks,
                            static_cast<int64_t>(t.nbytes()) / blocks};
    }
  };
  if (const int64_t runs = kquant_runs(p.kind)) {
    for (int64_t r = 0; r < runs; ++r) add(p.operands[1 + r], p.operands[1 + r].size(0));
    return w;
  }
  if (p.kind != kGemv && !reads_tiles(p.kind)) return w;
  const Tensor& t = p.operands[0];
  add(t, reads_tiles(p.kind) ? t.size(0) : t.size(0) / 16);
  return w;
}

// Bytes a reading-ahead thread asks for into its L2 per serial op: more
// than one op's time lets it read, less than the L2 (1 MB on the machine
// measured; 1 MB ahead measured level with 512 KB, 256 KB slower).
constexpr int64_t kReadAheadBytes = 512 << 10;
constexpr int64_t kReadAheadRows = 8;  // rows of x up to which the step reads ahead
constexpr int64_t kNoWindow = 0;  // paged_attention's window for a layer that sees all

// Thread `tid`'s reading ahead of `weights` (in the order they will be
// computed) until `done`: per weight, the share it will compute, then, by
// thread 1, thread 0's share (it comes to L3 or stays in thread 1's L2,
// either nearer than memory).
void read_ahead(const Weight* weights, int64_t count, int64_t tid, int64_t threads,
                const std::atomic<bool>& done) {
  int64_t left = kReadAheadBytes;
  for (int64_t n = 0; n < count && left > 0; ++n) {
    for (int64_t part = 0; part < weights[n].count && left > 0; ++part) {
      const Part& w = weights[n].parts[part];
      const int64_t chunk = (w.blocks + threads - 1) / threads;
      for (const int64_t share : {tid, int64_t{0}}) {
        if (share == 0 && tid != 1) break;
        const int64_t end = std::min(w.blocks, (share + 1) * chunk) * w.block_bytes;
        for (int64_t at = std::min(w.blocks, share * chunk) * w.block_bytes; at < end && left > 0;
             at += 1024, left -= 1024) {
          if (done.load(std::memory_order_relaxed)) return;
          for (int64_t line = at; line < std::min(end, at + 1024); line += 64) {
            __builtin_prefetch(w.data + line, 0, 2);  // into L2
          }
        }
      }
    }
  }
}

// Runs `serial` (one op on one thread) while the other threads read ahead
// the weights of the products that follow it; where there is no other
// thread, nothing to read ahead (products of many rows, whose other ops
// have threads of their own) or this is already a parallel region, just
// `serial`.
template <typename F>
void overlapped(F&& serial, const Weight* next, int64_t count) {
  const int64_t threads = at::get_num_threads();
  const bool readable =
      std::any_of(next, next + count, [](const Weight& w) { return w.count > 0; });
  if (threads < 2 || !readable || omp_in_parallel()) {
    serial();
    return;
  }
  std::atomic<bool> done{false};
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    const int64_t tid = omp_get_thread_num();
    if (tid == 0) {
      try {
        serial();
      } catch (...) {
        error = std::current_exception();
      }
      done.store(true, std::memory_order_relaxed);
    } else {
      read_ahead(next, count, tid, omp_get_num_threads(), done);
    }
  }
  if (error) std::rethrow_exception(error);
}

// The MLP's activation: SiLU(gate) * up, or GELU-tanh(gate) * up.
enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

// x: [rows, hidden] the embedded tokens. Per layer l: norms[2l], norms[2l+1]
// (input and post-attention), or with four a layer norms[4l..4l+3] (input,
// after attention, before and after the MLP: Gemma 3's), products
// 4l..4l+3 (qkv, o, gate_up, down),
// each a kind, outs[i] (output features, read by the panel kernel) and its
// operands in order in `operands`. Returns the stream after the last
// layer's attention, that layer's MLP branch (not yet added) and the
// stream entering each layer listed in `taps` (ascending, once each).
// qk_norms: none, or per layer l the q and k norms' weights at 2l, 2l+1;
// windows: none, or per layer the keys a query sees back (0: all);
// local_rope: none, or the (cos, sin) of the layers that local_layers marks
// (per layer 0 or 1; none: every layer takes cos, sin). group_slots and
// group_tables: none, or the slots and block tables of layer groups 1, 2, ..
// (core/layer_groups.py), slot_mapping and block_tables being group 0's,
// and per layer in layer_groups the group it reads and writes.
std::tuple<Tensor, Tensor, std::vector<Tensor>> decoder_stack(
    const Tensor& embedded, const Tensor& cos, const Tensor& sin, at::TensorList caches,
    const Tensor& slot_mapping, const Tensor& block_tables, const Tensor& query_start,
    const Tensor& context_lens, at::TensorList norms, at::IntArrayRef kinds,
    at::IntArrayRef outs, at::TensorList operands, int64_t heads, int64_t kv_heads, double eps,
    double scale, at::IntArrayRef taps, at::TensorList qk_norms, at::IntArrayRef windows,
    at::TensorList local_rope, at::IntArrayRef local_layers, int64_t activation,
    at::TensorList group_slots, at::TensorList group_tables, at::IntArrayRef layer_groups) {
  const int64_t layers = static_cast<int64_t>(caches.size());
  TORCH_CHECK(layers >= 1, "decoder_stack needs at least one layer");
  TORCH_CHECK(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * layers,
              "decoder_stack: ", layers, " layers need 0 or ", 2 * layers, " q/k norms, got ",
              qk_norms.size());
  TORCH_CHECK(windows.empty() || static_cast<int64_t>(windows.size()) == layers,
              "decoder_stack: ", layers, " layers need 0 or ", layers, " windows, got ",
              windows.size());
  TORCH_CHECK((static_cast<int64_t>(norms.size()) == 2 * layers ||
               static_cast<int64_t>(norms.size()) == 4 * layers) &&
                  static_cast<int64_t>(kinds.size()) == 4 * layers &&
                  outs.size() == kinds.size(),
              "decoder_stack: ", layers, " caches need ", 2 * layers, " or ", 4 * layers,
              " norms and ", 4 * layers, " products, got ", norms.size(), " and ", kinds.size(),
              " (", outs.size(), " outs)");
  TORCH_CHECK((local_rope.empty() && local_layers.empty()) ||
                  (local_rope.size() == 2 && static_cast<int64_t>(local_layers.size()) == layers),
              "decoder_stack: local_rope must be none or (cos, sin) with a mark per layer");
  TORCH_CHECK(activation == kSilu || activation == kGeluTanh,
              "decoder_stack: unknown activation ", activation);
  const int64_t per_layer = static_cast<int64_t>(norms.size()) / layers;  // 2 or 4
  TORCH_CHECK(group_slots.size() == group_tables.size() &&
                  (layer_groups.empty() || static_cast<int64_t>(layer_groups.size()) == layers),
              "decoder_stack: group_slots and group_tables must pair up, with a group per layer");
  for (const int64_t group : layer_groups) {
    TORCH_CHECK(group >= 0 && group <= static_cast<int64_t>(group_slots.size()),
                "decoder_stack: layer group ", group, " has no slots and tables");
  }
  std::vector<Product> products;
  products.reserve(kinds.size());
  size_t next = 0;
  for (size_t i = 0; i < kinds.size(); ++i) {
    const int64_t count = operand_count(kinds[i]);
    TORCH_CHECK(next + count <= operands.size(), "decoder_stack: too few operands for product ",
                i);
    products.push_back({kinds[i], outs[i], operands.data() + next});
    next += count;
  }
  TORCH_CHECK(next == operands.size(), "decoder_stack: ", operands.size() - next,
              " operands left over");
  std::vector<Weight> weights;
  for (size_t i = 0; i < products.size(); ++i) {
    weights.push_back(weight_of(products[i]));
    if (i + 1 < products.size() && reads_tiles(products[i].kind) &&
        products[i + 1].kind == products[i].kind) {
      products[i].next = products[i + 1].operands[0];
    }
  }
  // `serial` while the weights of products i and i + 1 are read ahead; none
  // where the other ops have rows enough to use threads of their own
  const int64_t reads_ahead = embedded.size(0) <= kReadAheadRows ? 2 : 0;
  auto before = [&](int64_t i, auto&& serial) {
    overlapped(serial, weights.data() + i,
               std::min<int64_t>(reads_ahead, static_cast<int64_t>(weights.size()) - i));
  };
  for (size_t i = 0; i < taps.size(); ++i) {
    TORCH_CHECK(taps[i] >= 0 && taps[i] < layers && (i == 0 || taps[i - 1] < taps[i]),
                "decoder_stack: taps must name layers 0..", layers - 1,
                " in ascending order, once each");
  }
  const Ops& k = ops();
  std::vector<Tensor> tapped;
  size_t tap = 0;
  Tensor x = embedded, normed, branch;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t i = 4 * l;  // this layer's first product
    before(i, [&] {
      if (l == 0) {
        normed = k.rms_norm.call(x, norms[0], eps);
      } else if (per_layer == 2) {
        std::tie(x, normed) = k.add_rms_norm.call(branch, x, norms[2 * l], eps);
      } else {  // the last layer's MLP branch normed, added, and the sum normed
        std::tie(x, normed) = k.normed_add_rms_norm.call(branch, x, norms[4 * l - 1],
                                                         norms[4 * l], eps);
      }
    });
    if (tap < taps.size() && taps[tap] == l) {
      tapped.push_back(x);
      ++tap;
    }
    const Product* p = products.data() + i;
    Tensor cache = caches[l];
    const int64_t group = layer_groups.empty() ? 0 : layer_groups[l];
    const Tensor& slots = group == 0 ? slot_mapping : group_slots[group - 1];
    const Tensor& tables = group == 0 ? block_tables : group_tables[group - 1];
    const Tensor qkv = product(p[0], normed);
    const bool local = !local_layers.empty() && local_layers[l] != 0;
    Tensor q;  // attention runs outside: it has threads of its own
    before(i + 1, [&] {
      const Tensor& c = local ? local_rope[0] : cos;
      const Tensor& s = local ? local_rope[1] : sin;
      // each head of q and k through its RMSNorm first, where the layer has them
      q = qk_norms.empty()
              ? k.rope_into_cache.call(qkv, c, s, heads, kv_heads, cache, slots)
              : k.norm_rope_into_cache.call(qkv, qk_norms[2 * l], qk_norms[2 * l + 1], eps, c,
                                            s, heads, kv_heads, cache, slots);
    });
    const Tensor attended = k.attention.call(q, cache, tables, query_start, context_lens,
                                             scale, windows.empty() ? kNoWindow : windows[l]);
    const Tensor o = product(p[1], attended);
    before(i + 2, [&] {
      if (per_layer == 2) {
        std::tie(x, normed) = k.add_rms_norm.call(o, x, norms[2 * l + 1], eps);
      } else {  // the branch normed, added, and the sum normed for the MLP
        std::tie(x, normed) = k.normed_add_rms_norm.call(o, x, norms[4 * l + 1],
                                                         norms[4 * l + 2], eps);
      }
    });
    const Tensor gate_up = product(p[2], normed);
    Tensor act;
    before(i + 3, [&] {
      act = activation == kSilu ? k.silu_and_mul.call(gate_up)
                                : k.gelu_tanh_and_mul.call(gate_up);
    });
    branch = product(p[3], act);  // (Gemma's normed as the next layer adds it)
  }
  if (per_layer == 4) branch = k.rms_norm.call(branch, norms[4 * layers - 1], eps);
  return {x, branch, tapped};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpage_cpu, m) {
  m.def("decoder_stack(Tensor embedded, Tensor cos, Tensor sin, Tensor(a!)[] caches, "
        "Tensor slot_mapping, Tensor block_tables, Tensor query_start, Tensor context_lens, "
        "Tensor[] norms, int[] kinds, int[] outs, Tensor[] operands, int heads, int kv_heads, "
        "float eps, float scale, int[] taps, Tensor[] qk_norms, int[] windows, "
        "Tensor[] local_rope, int[] local_layers, int activation, Tensor[] group_slots, "
        "Tensor[] group_tables, int[] layer_groups) "
        "-> (Tensor, Tensor, Tensor[])");
}

// Every backend: oneDNN's packed weights among the operands dispatch as MkldnnCPU.
TORCH_LIBRARY_IMPL(specpage_cpu, CompositeExplicitAutograd, m) {
  m.impl("decoder_stack", &decoder_stack);
}
