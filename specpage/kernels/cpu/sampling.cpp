// Plain temperature sampling on CPU, for rows of fp32 logits: a token's
// probability under softmax(logits / T), and a draw from that distribution
// (with one token taken out, for the token after a rejected proposal). One
// pass for the maximum, one for the weights and their sums, and a walk to
// the drawn token, instead of torch's softmax, a copy, a float64 cumulative
// sum and a search over the whole row (specpage/speculation/sampler.py,
// which remains the reference and the path for top-k, top-p and min-p).
//
// A row's weights are w_i = exp((l_i - max) / T), 0 where that is below
// e^-87.3 (a token the grammar forbids, at -inf, is never drawn); the draw
// at u is the first token whose cumulative weight exceeds u times the total
// (the inverse CDF, as sampler.sample takes it). Sums are float64 over
// chunks of 256 weights. Each row is one thread's from start to end, so a
// row's result does not depend on the other rows of the call.
//
// A verify step's sampled sequences whose proposals have no distribution
// take one_hot_acceptance: each proposal's probability, the acceptance test
// and the draw after it in one call, a row weighed only when the test
// reaches it (the verifier's _decide and the two calls above, bit for bit),
// where the two calls weighed every proposal's row and then the drawn one
// again.
//
// Greedy rows take greedy_tokens: each row's argmax as torch.argmax gives
// it (the first index of the largest value; the first NaN where there is
// one), in two vector passes where torch's reduction carries an index
// through every comparison (262144 logits: ~20 against ~320 microseconds).
//
// Registered as torch.ops.specpage_cpu.temperature_probabilities,
// temperature_draws, one_hot_acceptance and greedy_tokens; the Python side is
// specpage/speculation/sampling_rows.py and verifier.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

using namespace specpage_cpu;

constexpr int64_t kChunk = 256;  // weights per partial sum
constexpr float kLeast = -87.3f;  // exponents below this weigh 0

// The float64 sum of w[first, last), whole vectors, as one chunk's.
double chunk_sum(const float* w, int64_t first, int64_t last) {
  vfloat sum = vfloat{};
  for (int64_t i = first; i < last; i += kLanes) sum += load(w + i);
  double s = 0.0;
  for (int64_t j = 0; j < kLanes; ++j) s += sum[j];
  return s;
}

// A row's weights (into w, padded to whole vectors with zeros) and their
// sums per chunk; returns the total.
double weigh(const float* logits, int64_t vocab, float inverse_temperature, float* w,
             std::vector<double>& chunks) {
  const int64_t whole = vocab / kLanes * kLanes;
  vfloat top = splat(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < whole; i += kLanes) {
    const vfloat x = load(logits + i);
    top = x > top ? x : top;
  }
  float max = top[0];
  for (int64_t i = 1; i < kLanes; ++i) max = std::fmax(max, top[i]);
  for (int64_t i = whole; i < vocab; ++i) max = std::fmax(max, logits[i]);
  const int64_t padded = (vocab + kLanes - 1) / kLanes * kLanes;
  chunks.assign((padded + kChunk - 1) / kChunk, 0.0);
  if (!std::isfinite(max)) {  // every token forbidden, or not a number: nothing to weigh
    std::fill(w, w + padded, 0.0f);
    return 0.0;
  }
  // Each chunk summed just after its weights are made, while they are in cache.
  double total = 0.0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const int64_t first = static_cast<int64_t>(c) * kChunk;
    const int64_t last = std::min<int64_t>(padded, first + kChunk);
    for (int64_t i = first; i < last; i += kLanes) {
      vfloat x;
      if (i + kLanes <= vocab) {
        x = load(logits + i);
      } else {
        x = splat(-std::numeric_limits<float>::infinity());
        for (int64_t j = i; j < vocab; ++j) x[j - i] = logits[j];
      }
      const vfloat e = (x - max) * inverse_temperature;
      const vfloat weight = e < kLeast ? vfloat{} : vexp(e);
      std::memcpy(w + i, &weight, sizeof(weight));
    }
    chunks[c] = chunk_sum(w, first, last);
    total += chunks[c];
  }
  return total;
}

// The first token whose cumulative weight exceeds target; where rounding
// leaves none, the last token of any weight.
int64_t walk(const float* w, int64_t vocab, const std::vector<double>& chunks, double target) {
  double before = 0.0;
  size_t c = 0;
  while (c + 1 < chunks.size() && before + chunks[c] <= target) before += chunks[c++];
  double cumulative = before;
  for (int64_t i = static_cast<int64_t>(c) * kChunk; i < vocab; ++i) {
    cumulative += w[i];
    if (w[i] > 0.0f && cumulative > target) return i;
  }
  for (int64_t i = vocab - 1; i > 0; --i) {
    if (w[i] > 0.0f) return i;
  }
  return 0;
}

// The draw at uniform u from a row's weights (weigh's), token x taken out
// where x >= 0 and anything else has weight.
int64_t draw(std::vector<float>& w, int64_t vocab, std::vector<double>& chunks, double total,
             int64_t x, double u) {
  if (x >= 0 && w[x] > 0.0f) {
    const float kept = w[x];
    const size_t c = static_cast<size_t>(x / kChunk);
    w[x] = 0.0f;  // its chunk summed again without it, as weigh sums one
    const int64_t first = static_cast<int64_t>(c) * kChunk;
    const double s = chunk_sum(w.data(), first,
                               std::min<int64_t>(static_cast<int64_t>(w.size()), first + kChunk));
    const double rest = total - chunks[c] + s;
    if (rest > 0.0) {
      chunks[c] = s;
      total = rest;
    } else {
      w[x] = kept;  // nothing else can be drawn: the token itself
    }
  }
  return walk(w.data(), vocab, chunks, u * total);
}

// The probability of token x in a row weighed to total (weigh's).
inline float probability(const std::vector<float>& w, double total, int64_t x) {
  return total > 0.0 ? static_cast<float>(w[x] / total) : 0.0f;
}

void check_logits(const at::Tensor& logits, const at::Tensor& rows, const char* name) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              name, ": logits must be float32 [rows, vocab] with unit column stride");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(), name,
              ": rows must be contiguous int64 [n]");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < logits.size(0), name, ": row ", r[i],
                " is outside the logits' ", logits.size(0), " rows");
  }
}

void check_per_row(const at::Tensor& t, int64_t n, at::ScalarType type, const char* what) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n && t.scalar_type() == type && t.is_contiguous(),
              what, " must be contiguous [", n, "] of ", type);
}

// f(i, weights, chunk sums, total) for each i, row rows[i] weighed at
// inverse_temperature[i]; each row one thread's.
template <typename F>
void for_weighed_rows(const at::Tensor& logits, const at::Tensor& rows,
                      const at::Tensor& inverse_temperature, F&& f) {
  const int64_t vocab = logits.size(1), stride = logits.stride(0);
  const int64_t* row = rows.data_ptr<int64_t>();
  const float* inverse = inverse_temperature.data_ptr<float>();
  const float* base = logits.data_ptr<float>();
  at::parallel_for(0, rows.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w((vocab + kLanes - 1) / kLanes * kLanes);
    std::vector<double> chunks;
    for (int64_t i = begin; i < end; ++i) {
      const double total = weigh(base + row[i] * stride, vocab, inverse[i], w.data(), chunks);
      f(i, w, chunks, total);
    }
  });
}

// Per i: the probability of tokens[i] in row rows[i] at temperature
// 1 / inverse_temperature[i].
at::Tensor temperature_probabilities(const at::Tensor& logits, const at::Tensor& rows,
                                     const at::Tensor& tokens,
                                     const at::Tensor& inverse_temperature) {
  check_logits(logits, rows, "temperature_probabilities");
  const int64_t n = rows.size(0), vocab = logits.size(1);
  check_per_row(tokens, n, at::kLong, "tokens");
  check_per_row(inverse_temperature, n, at::kFloat, "inverse_temperature");
  const int64_t* token = tokens.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(token[i] >= 0 && token[i] < vocab, "token ", token[i], " is outside the ",
                vocab, "-token vocabulary");
  }
  at::Tensor out = at::empty({n}, logits.options());
  float* p = out.data_ptr<float>();
  for_weighed_rows(logits, rows, inverse_temperature,
                   [&](int64_t i, const std::vector<float>& w, const std::vector<double>&,
                       double total) {
    p[i] = probability(w, total, token[i]);
  });
  return out;
}

// Per i: a draw from row rows[i] at temperature 1 / inverse_temperature[i]
// with uniform uniforms[i], token removed[i] taken out where it is >= 0
// (when nothing else has any weight, from the whole row).
at::Tensor temperature_draws(const at::Tensor& logits, const at::Tensor& rows,
                             const at::Tensor& inverse_temperature, const at::Tensor& uniforms,
                             const at::Tensor& removed) {
  check_logits(logits, rows, "temperature_draws");
  const int64_t n = rows.size(0), vocab = logits.size(1);
  check_per_row(inverse_temperature, n, at::kFloat, "inverse_temperature");
  check_per_row(uniforms, n, at::kDouble, "uniforms");
  check_per_row(removed, n, at::kLong, "removed");
  const int64_t* out_of = removed.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(out_of[i] < vocab, "removed token ", out_of[i], " is outside the ", vocab,
                "-token vocabulary");
  }
  const double* u = uniforms.data_ptr<double>();
  at::Tensor out = at::empty({n}, rows.options());
  int64_t* drawn = out.data_ptr<int64_t>();
  for_weighed_rows(logits, rows, inverse_temperature,
                   [&](int64_t i, std::vector<float>& w, std::vector<double>& chunks,
                       double total) {
    drawn[i] = draw(w, vocab, chunks, total, out_of[i], u[i]);
  });
  return out;
}

// sampler.py's streams (Purpose) and uniform: splitmix64 over (seed,
// position, purpose), the same 53 bits.
constexpr uint64_t kSample = 1, kAccept = 3, kResidual = 4;

double seeded_uniform(uint64_t seed, int64_t position, uint64_t purpose) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull +
               static_cast<uint64_t>(position) * 0xBF58476D1CE4E5B9ull + purpose;
  for (int round = 0; round < 2; ++round) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
  }
  return static_cast<double>(x >> 11) / 9007199254740992.0;  // 2^53
}

// One-hot acceptance of each sequence's proposals (verifier.py's _decide,
// then its draw), a row weighed only when the test reaches it. meta, int64:
// per sequence s of n its first row (offsets), proposals (ks), seed and end,
// as four runs of n values, then the proposed tokens, sequence by sequence
// (one tensor: a step's few values cost less so than as several). Sequence
// s has ks[s] + 1 rows of logits from offsets[s]; proposal j is accepted
// where the uniform of (seeds[s], ends[s] + j, ACCEPT) is below its
// probability at row j (as temperature_probabilities gives it); at the
// first rejection the next token is drawn from that row with the proposal
// taken out (RESIDUAL), after the last acceptance from the row after it
// (SAMPLE), as temperature_draws draws. Seeds are sampler.py's mod 2^64
// (int64's two's complement). Returns [n, 2]: (accepted, next token).
at::Tensor one_hot_acceptance(const at::Tensor& logits, const at::Tensor& meta,
                              const at::Tensor& inverse_temperature) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "one_hot_acceptance: logits must be float32 [rows, vocab] with unit column stride");
  const int64_t n = inverse_temperature.size(0), vocab = logits.size(1);
  const int64_t stride = logits.stride(0);
  check_per_row(inverse_temperature, n, at::kFloat, "inverse_temperature");
  TORCH_CHECK(meta.dim() == 1 && meta.scalar_type() == at::kLong && meta.is_contiguous() &&
                  meta.size(0) >= 4 * n,
              "one_hot_acceptance: meta must be contiguous int64 [4 x ", n, " + proposals]");
  const int64_t* offsets = meta.data_ptr<int64_t>();
  const int64_t *ks = offsets + n, *seeds = offsets + 2 * n, *ends = offsets + 3 * n;
  const int64_t* tokens = offsets + 4 * n;
  std::vector<int64_t> first_token(n + 1, 0);
  for (int64_t s = 0; s < n; ++s) {
    TORCH_CHECK(ks[s] >= 0 && offsets[s] >= 0 && offsets[s] + ks[s] < logits.size(0),
                "one_hot_acceptance: sequence ", s, "'s ", ks[s] + 1, " rows from row ",
                offsets[s], " are outside the logits' ", logits.size(0), " rows");
    first_token[s + 1] = first_token[s] + ks[s];
  }
  TORCH_CHECK(meta.size(0) == 4 * n + first_token[n], "one_hot_acceptance: ", first_token[n],
              " proposed tokens expected, got ", meta.size(0) - 4 * n);
  for (int64_t i = 0; i < first_token[n]; ++i) {
    TORCH_CHECK(tokens[i] >= 0 && tokens[i] < vocab, "token ", tokens[i], " is outside the ",
                vocab, "-token vocabulary");
  }
  const float* inverse = inverse_temperature.data_ptr<float>();
  const float* base = logits.data_ptr<float>();
  at::Tensor out = at::empty({n, 2}, logits.options().dtype(at::kLong));
  int64_t* decided = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t stop) {
    std::vector<float> w((vocab + kLanes - 1) / kLanes * kLanes);
    std::vector<double> chunks;
    for (int64_t s = begin; s < stop; ++s) {
      const uint64_t key = static_cast<uint64_t>(seeds[s]);
      const int64_t k = ks[s];
      int64_t a = 0, next = 0;
      for (;; ++a) {
        const double total = weigh(base + (offsets[s] + a) * stride, vocab, inverse[s],
                                   w.data(), chunks);
        if (a == k) {
          next = draw(w, vocab, chunks, total, -1, seeded_uniform(key, ends[s] + a, kSample));
          break;
        }
        const int64_t x = tokens[first_token[s] + a];
        const float p = probability(w, total, x);
        if (!(seeded_uniform(key, ends[s] + a, kAccept) < static_cast<double>(p))) {
          next = draw(w, vocab, chunks, total, x, seeded_uniform(key, ends[s] + a, kResidual));
          break;
        }
      }
      decided[2 * s] = a;
      decided[2 * s + 1] = next;
    }
  });
  return out;
}

}  // namespace

// The first index of a row's largest value, or of its first NaN.
int64_t row_argmax(const float* x, int64_t n) {
  using mask = decltype(vfloat{} != vfloat{});
  const int64_t whole = n / kLanes * kLanes;
  vfloat top = splat(-std::numeric_limits<float>::infinity());
  mask unordered = mask{};
  for (int64_t i = 0; i < whole; i += kLanes) {
    const vfloat v = load(x + i);
    unordered |= v != v;
    top = v > top ? v : top;
  }
  bool nan = false;
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < kLanes; ++j) {
    nan |= unordered[j] != 0;
    max = std::max(max, top[j]);
  }
  for (int64_t i = whole; i < n; ++i) {
    nan |= std::isnan(x[i]);
    max = std::max(max, x[i]);
  }
  if (nan) return std::find_if(x, x + n, [](float v) { return std::isnan(v); }) - x;
  const vfloat target = splat(max);
  for (int64_t i = 0; i < whole; i += kLanes) {
    const mask hit = load(x + i) == target;
    for (int64_t j = 0; j < kLanes; ++j) {
      if (hit[j]) return i + j;
    }
  }
  return std::find(x + whole, x + n, max) - x;
}

// logits [rows, vocab] fp32 (unit column stride) -> each row's argmax, int64 [rows].
at::Tensor greedy_tokens(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.stride(1) == 1 && logits.size(1) >= 1,
              "greedy_tokens: logits must be float32 [rows, vocab >= 1] with unit column stride");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* src = logits.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 18) / vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dst[r] = row_argmax(src + r * stride, vocab);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(specpage_cpu, m) {
  m.def("temperature_probabilities(Tensor logits, Tensor rows, Tensor tokens, "
        "Tensor inverse_temperature) -> Tensor");
  m.def("greedy_tokens(Tensor logits) -> Tensor");
  m.def("temperature_draws(Tensor logits, Tensor rows, Tensor inverse_temperature, "
        "Tensor uniforms, Tensor removed) -> Tensor");
  m.def("one_hot_acceptance(Tensor logits, Tensor meta, Tensor inverse_temperature) -> Tensor");
}

TORCH_LIBRARY_IMPL(specpage_cpu, CPU, m) {
  m.impl("temperature_probabilities", &temperature_probabilities);
  m.impl("temperature_draws", &temperature_draws);
  m.impl("one_hot_acceptance", &one_hot_acceptance);
  m.impl("greedy_tokens", &greedy_tokens);
}
