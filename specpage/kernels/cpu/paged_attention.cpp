// Paged attention on CPU for short spans (decode tokens, verify spans): each
// query row reads its sequence's K/V blocks in place through the block table,
// instead of gathering them into a padded copy first.
//
// One work item is one (sequence, KV head): the query heads sharing that KV
// head and the span's tokens form its rows, so each K/V row is loaded (and
// widened to fp32) once for all of them. Scores are held for the whole
// context (a few thousand floats per row at most), softmaxed, then V is
// accumulated. Vectors are vec.h's 16 floats. bf16 caches on a CPU with
// AVX-512 BF16 take paths of their own: a verify span's many rows cost about
// half as much there (attend_rows_bf16, below), and a batch's items are
// taken a sequence (or a share of its KV heads) at a time, every head's part
// of a position read together (attend_heads_bf16).
//
// A sliding window (a layer of Gemma 3, say) leaves each row the window's
// last positions: those before them score -inf, and the tiles of sixteen
// positions that every row of an item has behind its window are skipped.
//
// Registered as torch.ops.specpage_cpu.paged_attention; the Python side is
// specpage/attention/native.py, which also holds the pure-torch reference.

#include <ATen/Parallel.h>
#include <omp.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace {

using namespace specpage_cpu;

struct Item {
  int64_t q_first, span, context, kv_head;
  const int64_t* table;
};

struct Shape {
  int64_t heads, kv_heads, groups, block_size, v_offset;
  float scale;
  int64_t window;  // keys a row sees back from its own position, itself included; 0: all
};

// The first position the span's token t sees.
inline int64_t first_visible(const Item& item, const Shape& shape, int64_t t) {
  if (shape.window == 0) return 0;
  return std::max<int64_t>(0, item.context - item.span + t - shape.window + 1);
}

// The first tile of sixteen positions that a row from token t on sees:
// earlier tiles hold only scores -inf (weights 0), so skipping them changes
// no sum (every lane's partial sums see the same positions, in the same order).
inline int64_t first_tile(const Item& item, const Shape& shape, int64_t t) {
  return first_visible(item, shape, t) / kLanes * kLanes;
}

// Positions ahead whose K (or V) row is asked for while this one is read:
// the rows of one KV head lie a position's width apart, in blocks scattered
// through the pool, which the hardware prefetcher does not follow. bf16,
// 32 sequences, 30 layers' caches read cold as in a step: 128 positions
// 424 -> 248 us a layer, 512 positions 1878 -> 900 us (2 cores).
constexpr int64_t kAhead = 16;
// ... and further ahead, into L2 only (prefetcht1): a row read from memory
// takes longer than 16 positions' work, and asking for it into L1 further
// ahead evicts what the kernel is reading (16 -> 64 into L1: 1.06-1.11x
// slower). SmolLM2's shape (3 KV heads of 64), 30 layers' caches read in
// turn, 2 cores, alternated in one process: 32 sequences of 200 and 500
// positions 0.88-0.89x and 0.87-0.88x the time a layer, one of 2,000
// 0.88-0.90x, one of 500 and a verify span of 5 level; SmolLM2-135M q4's
// forward of 32 decode rows at 200 and 500 positions 0.98x and 0.94x, of
// one at 1,000 0.96x. (The fp32 and pre-BF16 path, attend_item, reads
// ahead the same way; it was not measured apart.)
constexpr int64_t kFarAhead = 64;

// Asks for `bytes` from `at` into L1 (kLocality 3) or L2 (1).
// These helpers are always inlined: compiled apart, a function of prefetches
// alone looks to GCC's interprocedural analysis like one without effects, and
// every call to it is deleted (int4_gemv.cpp's prefetch_tile).
template <int kLocality>
__attribute__((always_inline)) inline void prefetch_bytes(const void* at, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) {
    __builtin_prefetch(static_cast<const char*>(at) + b, 0, kLocality);
  }
}

template <typename scalar_t, int64_t kChunks, int kLocality = 3>
__attribute__((always_inline)) inline void prefetch_row(const scalar_t* row) {
  prefetch_bytes<kLocality>(row, kChunks * kLanes * sizeof(scalar_t));
}

// Asks for the rows of positions [from, to), `width` elements from rows[p]
// + offset each.
template <int kLocality, typename scalar_t>
__attribute__((always_inline)) inline void prefetch_rows(const scalar_t* const* rows,
                                                         int64_t offset, int64_t width,
                                                         int64_t from, int64_t to) {
  for (int64_t p = from; p < to; ++p) {
    prefetch_bytes<kLocality>(rows[p] + offset, width * sizeof(scalar_t));
  }
}

// Asks for the rows (plus offset: the V rows) of position p + kAhead of a
// context of `context` into L1 and, where `far`, of p + kFarAhead into L2.
template <typename scalar_t, int64_t kChunks>
__attribute__((always_inline)) inline void prefetch_ahead(const scalar_t* const* rows,
                                                          int64_t offset, int64_t p,
                                                          int64_t context, bool far = true) {
  if (p + kAhead < context) prefetch_row<scalar_t, kChunks>(rows[p + kAhead] + offset);
  if (far && p + kFarAhead < context) {
    prefetch_row<scalar_t, kChunks, 1>(rows[p + kFarAhead] + offset);
  }
}

// Each position's K row of the item's KV head, walking the block table (no
// division per position); its V row lies shape.v_offset further.
template <typename scalar_t>
void key_rows(const scalar_t* cache, const Item& item, const Shape& shape, int64_t head_dim,
              std::vector<const scalar_t*>& keys) {
  const int64_t row_stride = shape.kv_heads * head_dim;  // one position of one block
  keys.resize(item.context);
  for (int64_t p = 0, block = 0; p < item.context; ++block) {
    const scalar_t* row = cache + item.table[block] * shape.block_size * row_stride
                          + item.kv_head * head_dim;
    for (int64_t o = 0; o < shape.block_size && p < item.context; ++o, ++p) {
      keys[p] = row + o * row_stride;
    }
  }
}

// Scores s[begin, padded) -> softmax weights over [first, visible), 0
// elsewhere; begin (a multiple of kLanes) <= first.
inline void softmax_row(float* s, int64_t begin, int64_t first, int64_t visible, int64_t padded) {
  for (int64_t p = begin; p < first; ++p) s[p] = -std::numeric_limits<float>::infinity();
  for (int64_t p = visible; p < padded; ++p) s[p] = -std::numeric_limits<float>::infinity();
  vfloat top = splat(-std::numeric_limits<float>::infinity());
  for (int64_t p = begin; p < padded; p += kLanes) {
    const vfloat x = load(s + p);
    top = x > top ? x : top;
  }
  float max = top[0];
  for (int64_t i = 1; i < kLanes; ++i) max = std::fmax(max, top[i]);
  vfloat total = vfloat{};
  for (int64_t p = begin; p < padded; p += kLanes) {
    const vfloat e = vexp(load(s + p) - max);
    const vfloat w = load(s + p) == -std::numeric_limits<float>::infinity() ? vfloat{} : e;
    std::memcpy(s + p, &w, sizeof(w));
    total += w;
  }
  const float inv = 1.0f / sum_lanes(total);
  for (int64_t p = begin; p < padded; p += kLanes) {
    const vfloat w = load(s + p) * inv;
    std::memcpy(s + p, &w, sizeof(w));
  }
}

// kChunks = head_dim / 16, fixed at compile time so each row lives in registers.
template <typename scalar_t, int64_t kChunks>
void attend_item(const scalar_t* q, const scalar_t* cache, scalar_t* out, const Item& item,
                 const Shape& shape, std::vector<vfloat>& vectors, std::vector<float>& scores,
                 std::vector<const scalar_t*>& keys) {
  constexpr int64_t head_dim = kChunks * kLanes;
  const int64_t groups = shape.groups, span = item.span, context = item.context;
  const int64_t rows = span * groups;
  const int64_t padded_context = (context + kLanes - 1) / kLanes * kLanes;
  vectors.resize(2 * rows * kChunks + rows * kLanes);
  scores.resize(rows * padded_context);
  vfloat* qv = vectors.data();  // [rows, kChunks], scaled
  vfloat* acc = qv + rows * kChunks;  // [rows, kChunks]
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / groups, g = r % groups;
    const scalar_t* src =
        q + ((item.q_first + t) * shape.heads + item.kv_head * groups + g) * head_dim;
    for (int64_t c = 0; c < kChunks; ++c) {
      qv[r * kChunks + c] = load(src + c * kLanes) * shape.scale;
      acc[r * kChunks + c] = vfloat{};
    }
  }
  key_rows(cache, item, shape, head_dim, keys);
  // Scores sixteen positions at a time: each row's sixteen dot products are
  // summed across their lanes together (sum_lanes16), a few shuffles per
  // score instead of fifteen dependent adds.
  vfloat* dots = acc + rows * kChunks;  // [rows, kLanes]: per position, partial sums
  const int64_t begin = first_tile(item, shape, 0);
  for (int64_t p0 = begin; p0 < context; p0 += kLanes) {
    const int64_t count = std::min(kLanes, context - p0);
    const scalar_t* const* k = keys.data() + p0;
    for (int64_t j = 0; j < count; ++j) {
      prefetch_ahead<scalar_t, kChunks>(keys.data(), 0, p0 + j, context);
      vfloat kv[kChunks];  // widened once for all rows
      for (int64_t c = 0; c < kChunks; ++c) kv[c] = load(k[j] + c * kLanes);
      for (int64_t r = 0; r < rows; ++r) {
        const vfloat* qr = qv + r * kChunks;
        vfloat dot = qr[0] * kv[0];
        for (int64_t c = 1; c < kChunks; ++c) dot += qr[c] * kv[c];
        dots[r * kLanes + j] = dot;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      vfloat* d = dots + r * kLanes;
      for (int64_t j = count; j < kLanes; ++j) d[j] = vfloat{};
      const vfloat total = sum_lanes16(d);
      std::memcpy(scores.data() + r * padded_context + p0, &total, sizeof(total));
    }
  }
  // Row r (token t = r / groups of the span) sees positions first_visible(t)
  // .. context - span + t.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / groups;
    softmax_row(scores.data() + r * padded_context, begin, first_visible(item, shape, t),
                context - span + t + 1, padded_context);
  }
  for (int64_t p = begin; p < context; ++p) {
    prefetch_ahead<scalar_t, kChunks>(keys.data(), shape.v_offset, p, context);
    const scalar_t* v = keys[p] + shape.v_offset;
    vfloat vv[kChunks];
    for (int64_t c = 0; c < kChunks; ++c) vv[c] = load(v + c * kLanes);
    for (int64_t r = 0; r < rows; ++r) {
      const vfloat w = splat(scores[r * padded_context + p]);
      for (int64_t c = 0; c < kChunks; ++c) acc[r * kChunks + c] += w * vv[c];
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / groups, g = r % groups;
    scalar_t* dst = out + ((item.q_first + t) * shape.heads + item.kv_head * groups + g) * head_dim;
    for (int64_t c = 0; c < kChunks; ++c) store(dst + c * kLanes, acc[r * kChunks + c]);
  }
}


#if defined(__AVX512BF16__)
// bf16 caches on a CPU with AVX-512 BF16, head_dim a multiple of 32: the
// same result by fewer instructions per (row, position), which is what a
// verify span's rows (span x groups) and a batch's items spend their time on.
// - Scores: sixteen positions' K rows, as pairs of bf16 (one 32-bit lane
//   each), are transposed once per tile so that each lane holds one
//   position; then each row's sixteen scores are one vector, built by
//   vdpbf16ps (bf16 pairs multiplied exactly, summed in fp32) against the
//   row's q pairs broadcast, with no sum across lanes and no stores but the
//   scores. The scale applies to the sum, as the reference's does.
// - Values: each row group's fp32 accumulators stay in registers while the
//   positions' V rows are widened once per group.
// An item may be part of a (sequence, KV head)'s rows: where there are
// fewer items than twice the threads (one stream's decode or verify step),
// all items' rows are cut into one equal share per thread, so that both
// cores have the same work and an item's K and V are read twice only where
// a cut falls inside it. (Each piece of an item read its K and V before.)
// Where there are fewer items than threads, an item's positions are cut
// among the threads for its scores instead (attend_few_bf16, below).
// With 6 rows' values accumulated at once where 4 were, at 2 threads,
// SmolLM2's 3 KV heads, context 300 and 30 layers' caches, a layer of 2 / 5
// / 8 positions took 24.6 / 42.1 / 52.9 and 23.6 / 37.9 / 53.1 us where it
// had taken 28.7 / 43.7 / 59.6 and 26.0 / 40.7 / 56.3 (runs alternated); 1
// position level.
constexpr int64_t kPairsPerTile = 16;  // 32-bit lanes of a K tile's transposed vector

// r[i] lane j <- r[j] lane i, for sixteen vectors of sixteen 32-bit lanes:
// each stage swaps one bit of the row index with that bit of the lane index.
inline void transpose16(vuint* r) {
  for (int i = 0; i < 16; ++i) {
    if (i & 1) continue;
    const vuint lo = r[i], hi = r[i + 1];
    r[i] = __builtin_shufflevector(lo, hi, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    r[i + 1] = __builtin_shufflevector(lo, hi, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  }
  for (int i = 0; i < 16; ++i) {
    if (i & 2) continue;
    const vuint lo = r[i], hi = r[i + 2];
    r[i] = __builtin_shufflevector(lo, hi, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    r[i + 2] = __builtin_shufflevector(lo, hi, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  for (int i = 0; i < 16; ++i) {
    if (i & 4) continue;
    const vuint lo = r[i], hi = r[i + 4];
    r[i] = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    r[i + 4] = __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
  for (int i = 0; i < 8; ++i) {
    const vuint lo = r[i], hi = r[i + 8];
    r[i] = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    r[i + 8] = __builtin_shufflevector(lo, hi, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
}

inline __m512bh as_bh(vuint v) {
  __m512i i;
  std::memcpy(&i, &v, sizeof(i));
  return (__m512bh)i;
}

// Scores of kRows rows (q pairs at q_rows[g]) against one transposed tile.
template <int64_t kRows, int64_t kPairs>
inline void tile_scores(const c10::BFloat16* const* q_rows, const vuint* kt, float scale,
                        float* const* out) {
  __m512 acc[kRows];
  for (int64_t g = 0; g < kRows; ++g) acc[g] = _mm512_setzero_ps();
  for (int64_t c = 0; c < kPairs; ++c) {
    const __m512bh k = as_bh(kt[c]);
    for (int64_t g = 0; g < kRows; ++g) {
      int32_t pair;  // q[2c], q[2c + 1]
      std::memcpy(&pair, q_rows[g] + 2 * c, sizeof(pair));
      acc[g] = _mm512_dpbf16_ps(acc[g], k, (__m512bh)_mm512_set1_epi32(pair));
    }
  }
  for (int64_t g = 0; g < kRows; ++g) _mm512_storeu_ps(out[g], _mm512_mul_ps(acc[g], _mm512_set1_ps(scale)));
}

// acc += scores . V over positions [begin, end) for kRows rows, in
// registers; with kAsk, each V row kAhead (and kFarAhead) positions on is
// asked for meanwhile, up to `context`.
template <int64_t kRows, int64_t kChunks, bool kAsk>
inline void add_values(vfloat (&acc)[kRows][kChunks], const float* const* weights,
                       const c10::BFloat16* const* keys, int64_t v_offset, int64_t begin,
                       int64_t end, int64_t context) {
  for (int64_t p = begin; p < end; ++p) {
    if constexpr (kAsk) prefetch_ahead<c10::BFloat16, kChunks>(keys, v_offset, p, context);
    const c10::BFloat16* v = keys[p] + v_offset;
    vfloat vv[kChunks];
    for (int64_t c = 0; c < kChunks; ++c) vv[c] = load(v + c * kLanes);
    for (int64_t g = 0; g < kRows; ++g) {
      const vfloat w = splat(weights[g][p]);
      for (int64_t c = 0; c < kChunks; ++c) acc[g][c] += w * vv[c];
    }
  }
}

// out = scores . V over positions [begin, context) for kRows rows.
template <int64_t kRows, int64_t kChunks>
inline void rows_values(const float* const* weights, const c10::BFloat16* const* keys,
                        int64_t v_offset, int64_t begin, int64_t context,
                        c10::BFloat16* const* out) {
  vfloat acc[kRows][kChunks] = {};
  add_values<kRows, kChunks, true>(acc, weights, keys, v_offset, begin, context, context);
  for (int64_t g = 0; g < kRows; ++g) {
    for (int64_t c = 0; c < kChunks; ++c) store(out[g] + c * kLanes, acc[g][c]);
  }
}

// Sums rows (fp32, at sum_rows[g]) += scores . V over positions [begin, end):
// the same sums as rows_values's over the same positions in the same order,
// taken a part at a time (the caller asks for the rows).
template <int64_t kRows, int64_t kChunks>
inline void rows_values_into(const float* const* weights, const c10::BFloat16* const* keys,
                             int64_t v_offset, int64_t begin, int64_t end,
                             float* const* sum_rows) {
  vfloat acc[kRows][kChunks];
  for (int64_t g = 0; g < kRows; ++g) {
    for (int64_t c = 0; c < kChunks; ++c) acc[g][c] = load(sum_rows[g] + c * kLanes);
  }
  add_values<kRows, kChunks, false>(acc, weights, keys, v_offset, begin, end, end);
  for (int64_t g = 0; g < kRows; ++g) {
    for (int64_t c = 0; c < kChunks; ++c) store(sum_rows[g] + c * kLanes, acc[g][c]);
  }
}

constexpr int64_t kScoreRows = 8;  // rows sharing one read of a transposed tile

struct RowItem {
  Item item;
  int64_t row_begin, row_end;  // of the item's span * groups rows
};

// The scores of an item's rows [row_first, row_first + rows) at the tiles of
// sixteen positions [tile_begin, tile_end) (multiples of kLanes), into
// scores (row r's at r * padded_context): K tile by K tile, each transposed
// once for all those rows. A position's score is its own, whichever tiles a
// call takes: the same bits however the tiles are split.
template <int64_t kChunks>
void score_tiles(const c10::BFloat16* q, const Item& item, const Shape& shape,
                 const c10::BFloat16* const* keys, int64_t row_first, int64_t rows,
                 int64_t tile_begin, int64_t tile_end, float* scores, int64_t padded_context,
                 std::vector<vuint>& kt, int64_t offset = 0, bool ask = true) {
  constexpr int64_t head_dim = kChunks * kLanes;
  constexpr int64_t kPairs = head_dim / 2;
  const int64_t groups = shape.groups, context = item.context;
  kt.resize(kPairs);
  const c10::BFloat16* q_rows[kScoreRows];
  float* score_rows[kScoreRows];
  for (int64_t p0 = tile_begin; p0 < std::min(tile_end, context); p0 += kLanes) {
    const int64_t count = std::min(kLanes, context - p0);
    for (int64_t b = 0; b < kPairs / kPairsPerTile; ++b) {
      vuint tile[16];
      for (int64_t j = 0; j < 16; ++j) {
        if (j < count) {
          // (the near row asked for with each pair block, as before: asked for
          // only with the first, the far rows gained nothing in one run)
          if (ask) prefetch_ahead<c10::BFloat16, kChunks>(keys, 0, p0 + j, context, b == 0);
          std::memcpy(&tile[j], keys[p0 + j] + offset + b * 2 * kPairsPerTile, sizeof(vuint));
        } else {
          tile[j] = vuint{};
        }
      }
      transpose16(tile);
      for (int64_t c = 0; c < 16; ++c) kt[b * kPairsPerTile + c] = tile[c];
    }
    for (int64_t r0 = 0; r0 < rows; r0 += kScoreRows) {
      const int64_t n = std::min(kScoreRows, rows - r0);
      for (int64_t g = 0; g < n; ++g) {
        const int64_t r = row_first + r0 + g, t = r / groups, h = r % groups;
        q_rows[g] = q + ((item.q_first + t) * shape.heads + item.kv_head * groups + h) * head_dim;
        score_rows[g] = scores + (r0 + g) * padded_context + p0;
      }
      with_count<kScoreRows>(n, [&](auto size) {
        tile_scores<decltype(size)::value, kPairs>(q_rows, kt.data(), shape.scale, score_rows);
      });
    }
  }
}

// Rows [row_first, row_first + rows) of an item from their scores (row r's
// at r * padded_context, positions begin.. scored): softmax, then the values.
template <int64_t kChunks>
void finish_rows(const Item& item, const Shape& shape, const c10::BFloat16* const* keys,
                 int64_t row_first, int64_t rows, int64_t begin, float* scores,
                 int64_t padded_context, c10::BFloat16* out) {
  constexpr int64_t head_dim = kChunks * kLanes;
  constexpr int64_t kValueRows = kChunks <= 4 ? 6 : 2;  // accumulators in registers
  const int64_t groups = shape.groups, span = item.span, context = item.context;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = (row_first + r) / groups;
    softmax_row(scores + r * padded_context, begin, first_visible(item, shape, t),
                context - span + t + 1, padded_context);
  }
  const float* weight_rows[kValueRows];
  c10::BFloat16* out_rows[kValueRows];
  for (int64_t r0 = 0; r0 < rows; r0 += kValueRows) {
    const int64_t n = std::min(kValueRows, rows - r0);
    for (int64_t g = 0; g < n; ++g) {
      const int64_t r = row_first + r0 + g, t = r / groups, h = r % groups;
      weight_rows[g] = scores + (r0 + g) * padded_context;
      out_rows[g] = out + ((item.q_first + t) * shape.heads + item.kv_head * groups + h) * head_dim;
    }
    with_count<kValueRows>(n, [&](auto size) {
      rows_values<decltype(size)::value, kChunks>(weight_rows, keys, shape.v_offset, begin,
                                                  context, out_rows);
    });
  }
}

template <int64_t kChunks>
void attend_rows_bf16(const c10::BFloat16* q, const c10::BFloat16* cache, c10::BFloat16* out,
                      const RowItem& part, const Shape& shape, std::vector<float>& scores,
                      std::vector<const c10::BFloat16*>& keys, std::vector<vuint>& kt) {
  const Item& item = part.item;
  const int64_t first = part.row_begin, rows = part.row_end - part.row_begin;
  const int64_t padded_context = (item.context + kLanes - 1) / kLanes * kLanes;
  scores.resize(rows * padded_context);
  key_rows(cache, item, shape, kChunks * kLanes, keys);
  const int64_t begin = first_tile(item, shape, first / shape.groups);
  score_tiles<kChunks>(q, item, shape, keys.data(), first, rows, begin, padded_context,
                       scores.data(), padded_context, kt);
  finish_rows<kChunks>(item, shape, keys.data(), first, rows, begin, scores.data(),
                       padded_context, out);
}

struct HeadsItem {
  Item item;  // item.kv_head: the first of its heads
  int64_t heads;
};

// A sequence's KV heads [kv_head, kv_head + heads) at once, a tile of sixteen
// positions at a time: each position's K (then V) rows of all those heads lie
// side by side in its block, so they are read in one pass, where an item per
// head read its part of every row in a pass of its own (a head's 128 bytes
// of every 384 for SmolLM2: the memory gave such reads 15-19 GB/s against
// 29 for whole blocks). The same bits as attend_rows_bf16 for each head: the
// scores are the positions' own, and each row's values are summed over the
// same positions in the same order (kept in fp32 between tiles). bf16, 2
// cores, 30 layers' caches read in turn (24 for the 0.5B shape), one
// process alternating the two: SmolLM2's shape, 32 sequences of 200 and 500
// positions 0.66-0.72x and 0.62-0.64x the time a layer, 8 of 300 0.68x, 32
// verify spans of 5 0.91x; 8 KV heads of 64, one sequence of 200 read from
// memory 0.83x, of 1,000 0.67-0.73x; Gemma 3's one KV head, 32 of 200,
// level (0.98x).
template <int64_t kChunks>
void attend_heads_bf16(const c10::BFloat16* q, const c10::BFloat16* cache, c10::BFloat16* out,
                       const HeadsItem& part, const Shape& shape, std::vector<float>& scores,
                       std::vector<float>& sums, std::vector<const c10::BFloat16*>& keys,
                       std::vector<vuint>& kt) {
  constexpr int64_t head_dim = kChunks * kLanes;
  constexpr int64_t kValueRows = kChunks <= 4 ? 6 : 2;
  const Item& first = part.item;
  const int64_t heads = part.heads, groups = shape.groups, context = first.context;
  const int64_t rows = first.span * groups, width = heads * head_dim;
  const int64_t padded_context = (context + kLanes - 1) / kLanes * kLanes;
  scores.resize(heads * rows * padded_context);
  sums.assign(heads * rows * head_dim, 0.0f);
  key_rows(cache, first, shape, head_dim, keys);
  const int64_t begin = first_tile(first, shape, 0);
  auto head_item = [&](int64_t h) {
    Item item = first;
    item.kv_head += h;
    return item;
  };
  // With the tile at p0 read: the next tile's rows (from `offset`, all the
  // heads') asked for into L1, those kFarAhead positions on into L2.
  auto ask_after = [&](int64_t offset, int64_t p0) {
    prefetch_rows<3>(keys.data(), offset, width, std::min(context, p0 + kLanes),
                     std::min(context, p0 + 2 * kLanes));
    prefetch_rows<1>(keys.data(), offset, width, std::min(context, p0 + kFarAhead),
                     std::min(context, p0 + kFarAhead + kLanes));
  };
  prefetch_rows<3>(keys.data(), 0, width, begin, std::min(context, begin + kLanes));
  for (int64_t p0 = begin; p0 < context; p0 += kLanes) {
    ask_after(0, p0);
    for (int64_t h = 0; h < heads; ++h) {
      score_tiles<kChunks>(q, head_item(h), shape, keys.data(), 0, rows, p0, p0 + kLanes,
                           scores.data() + h * rows * padded_context, padded_context, kt,
                           h * head_dim, false);
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t r = 0; r < rows; ++r) {
      softmax_row(scores.data() + (h * rows + r) * padded_context, begin,
                  first_visible(first, shape, r / groups), context - first.span + r / groups + 1,
                  padded_context);
    }
  }
  const int64_t v_offset = shape.v_offset;
  prefetch_rows<3>(keys.data(), v_offset, width, begin, std::min(context, begin + kLanes));
  const float* weight_rows[kValueRows];
  float* sum_rows[kValueRows];
  for (int64_t p0 = begin; p0 < context; p0 += kLanes) {
    const int64_t end = std::min(context, p0 + kLanes);
    ask_after(v_offset, p0);
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t r0 = 0; r0 < rows; r0 += kValueRows) {
        const int64_t n = std::min(kValueRows, rows - r0);
        for (int64_t g = 0; g < n; ++g) {
          weight_rows[g] = scores.data() + (h * rows + r0 + g) * padded_context;
          sum_rows[g] = sums.data() + (h * rows + r0 + g) * head_dim;
        }
        with_count<kValueRows>(n, [&](auto size) {
          rows_values_into<decltype(size)::value, kChunks>(weight_rows, keys.data(),
                                                           v_offset + h * head_dim, p0, end,
                                                           sum_rows);
        });
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = r / groups, g = r % groups;
      c10::BFloat16* dst =
          out + ((first.q_first + t) * shape.heads + (first.kv_head + h) * groups + g) * head_dim;
      const float* src = sums.data() + (h * rows + r) * head_dim;
      for (int64_t c = 0; c < kChunks; ++c) store(dst + c * kLanes, load(src + c * kLanes));
    }
  }
}

// f(i, lo, hi) for each i whose range [at[i], at[i + 1]) of things laid end
// to end (rows, tiles) meets [from, to): the overlap, counted from at[i].
template <typename F>
void for_overlaps(const std::vector<int64_t>& at, int64_t from, int64_t to, F&& f) {
  for (size_t i = 0; i + 1 < at.size(); ++i) {
    const int64_t lo = std::max(from, at[i]), hi = std::min(to, at[i + 1]);
    if (lo < hi) f(static_cast<int64_t>(i), lo - at[i], hi - at[i]);
  }
}

// Fewer items than threads (Gemma 3's one KV head of 256, one stream's
// decode or verify step): cutting rows among the threads, each would read
// and transpose all of an item's K for its few rows (two of four a decode
// step). Instead each item's tiles of positions are cut among the threads
// for the scores, so every K tile is read and transposed once; then each
// thread takes its share of the rows laid end to end for the softmax and
// the values. The same bits as attend_rows_bf16: a score is its position's
// own, and a row's softmax and values run over the same positions in the
// same order (from the item's first tile: positions before a row's window
// weigh 0 and add nothing). Gemma 3 270M, decode at 200 and 1,000
// positions, its K and V read from memory: 0.81-0.82x the time a layer;
// a decode step 0.970x (alternated in one process).
template <int64_t kChunks>
void attend_few_bf16(const c10::BFloat16* q, const c10::BFloat16* cache, c10::BFloat16* out,
                     const std::vector<Item>& items, const Shape& shape, int64_t threads) {
  const int64_t count = static_cast<int64_t>(items.size());
  std::vector<std::vector<const c10::BFloat16*>> keys(count);
  std::vector<int64_t> begins(count), padded(count);
  // where each item's scores, tiles and rows start, all items' laid end to end
  std::vector<int64_t> score_at{0}, tile_at{0}, row_at{0};
  for (int64_t i = 0; i < count; ++i) {
    const Item& item = items[i];
    key_rows(cache, item, shape, kChunks * kLanes, keys[i]);
    begins[i] = first_tile(item, shape, 0);
    padded[i] = (item.context + kLanes - 1) / kLanes * kLanes;
    row_at.push_back(row_at.back() + item.span * shape.groups);
    score_at.push_back(score_at.back() + item.span * shape.groups * padded[i]);
    tile_at.push_back(tile_at.back() + (padded[i] - begins[i]) / kLanes);
  }
  std::vector<float> scores(score_at.back());
#pragma omp parallel num_threads(threads)
  {
    const int64_t tid = omp_get_thread_num(), n = omp_get_num_threads();
    std::vector<vuint> kt;
    const int64_t tiles = tile_at.back(), rows = row_at.back();
    for_overlaps(tile_at, tiles * tid / n, tiles * (tid + 1) / n,
                 [&](int64_t i, int64_t lo, int64_t hi) {
      score_tiles<kChunks>(q, items[i], shape, keys[i].data(), 0, row_at[i + 1] - row_at[i],
                           begins[i] + lo * kLanes, begins[i] + hi * kLanes,
                           scores.data() + score_at[i], padded[i], kt);
    });
#pragma omp barrier
    for_overlaps(row_at, rows * tid / n, rows * (tid + 1) / n,
                 [&](int64_t i, int64_t lo, int64_t hi) {
      finish_rows<kChunks>(items[i], shape, keys[i].data(), lo, hi - lo, begins[i],
                           scores.data() + score_at[i] + lo * padded[i], padded[i], out);
    });
  }
}
#endif

template <typename scalar_t, int64_t kChunks>
void attend_all(const at::Tensor& q, const at::Tensor& cache, at::Tensor& out,
                const at::Tensor& block_tables, const at::Tensor& query_start,
                const at::Tensor& context_lens, const Shape& shape) {
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* cache_ptr = cache.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const int64_t* contexts = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  const int64_t num_items = context_lens.size(0) * shape.kv_heads;
  auto item_of = [&](int64_t i) {  // item i: sequence i / kv_heads, its KV head i % kv_heads
    const int64_t s = i / shape.kv_heads;
    return Item{starts[s], starts[s + 1] - starts[s], contexts[s], i % shape.kv_heads,
                tables + s * max_blocks};
  };
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && kChunks % 2 == 0) {
    // Fewer items than threads: each item's rows would be cut among threads
    // that all read its K, so its positions are cut instead (attend_few_bf16).
    const int64_t threads = at::get_num_threads();
    if (num_items < threads && !at::in_parallel_region()) {
      std::vector<Item> items;
      for (int64_t i = 0; i < num_items; ++i) items.push_back(item_of(i));
      attend_few_bf16<kChunks>(q_ptr, cache_ptr, out_ptr, items, shape, threads);
      return;
    }
    // At least twice as many items as threads: a sequence's KV heads at a
    // time, in as many shares of its heads as make twice the threads' count
    // of parts where the sequences alone do not (attend_heads_bf16).
    if (num_items >= 2 * threads) {
      const int64_t num_seqs = context_lens.size(0);
      const int64_t pieces = std::min<int64_t>(shape.kv_heads,
                                               (2 * threads + num_seqs - 1) / num_seqs);
      std::vector<HeadsItem> parts;
      for (int64_t s = 0; s < num_seqs; ++s) {
        for (int64_t k = 0; k < pieces; ++k) {
          const int64_t lo = shape.kv_heads * k / pieces, hi = shape.kv_heads * (k + 1) / pieces;
          if (lo < hi) parts.push_back({item_of(s * shape.kv_heads + lo), hi - lo});
        }
      }
      at::parallel_for(0, static_cast<int64_t>(parts.size()), 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores, sums;
        std::vector<const c10::BFloat16*> keys;
        std::vector<vuint> kt;
        for (int64_t i = begin; i < end; ++i) {
          attend_heads_bf16<kChunks>(q_ptr, cache_ptr, out_ptr, parts[i], shape, scores, sums,
                                     keys, kt);
        }
      });
      return;
    }
    // Fewer items than twice the threads (see attend_rows_bf16): all items'
    // rows laid end to end are cut into one equal share per thread: a thread
    // reads the K and V of the items its share touches, and only the items
    // across a cut are read by two.
    std::vector<RowItem> parts;
    std::vector<int64_t> share_start{0};  // each share's first part
    std::vector<int64_t> row_at{0};  // each item's first row, all items' laid end to end
    for (int64_t i = 0; i < num_items; ++i) {
      row_at.push_back(row_at.back() + item_of(i).span * shape.groups);
    }
    const int64_t total = row_at.back();
    for (int64_t t = 0; t < threads; ++t) {
      for_overlaps(row_at, total * t / threads, total * (t + 1) / threads,
                   [&](int64_t i, int64_t lo, int64_t hi) {
        parts.push_back({item_of(i), lo, hi});
      });
      share_start.push_back(static_cast<int64_t>(parts.size()));
    }
    const int64_t shares = static_cast<int64_t>(share_start.size()) - 1;
    at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      std::vector<const c10::BFloat16*> keys;
      std::vector<vuint> kt;
      for (int64_t i = share_start[begin]; i < share_start[end]; ++i) {
        attend_rows_bf16<kChunks>(q_ptr, cache_ptr, out_ptr, parts[i], shape, scores, keys, kt);
      }
    });
    return;
  }
#endif
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<vfloat> vectors;
    std::vector<float> scores;
    std::vector<const scalar_t*> keys;
    for (int64_t i = begin; i < end; ++i) {
      attend_item<scalar_t, kChunks>(q_ptr, cache_ptr, out_ptr, item_of(i), shape, vectors,
                                     scores, keys);
    }
  });
}

template <typename scalar_t>
void by_head_dim(const at::Tensor& q, const at::Tensor& cache, at::Tensor& out,
                 const at::Tensor& block_tables, const at::Tensor& query_start,
                 const at::Tensor& context_lens, const Shape& shape) {
  switch (q.size(2)) {
    case 32: attend_all<scalar_t, 2>(q, cache, out, block_tables, query_start, context_lens, shape); break;
    case 64: attend_all<scalar_t, 4>(q, cache, out, block_tables, query_start, context_lens, shape); break;
    case 80: attend_all<scalar_t, 5>(q, cache, out, block_tables, query_start, context_lens, shape); break;
    case 96: attend_all<scalar_t, 6>(q, cache, out, block_tables, query_start, context_lens, shape); break;
    case 128: attend_all<scalar_t, 8>(q, cache, out, block_tables, query_start, context_lens, shape); break;
    // Gemma 3's (all sizes but 27B)
    case 256: attend_all<scalar_t, 16>(q, cache, out, block_tables, query_start, context_lens, shape); break;
    default: TORCH_CHECK(false, "head_dim ", q.size(2), " not built (32, 64, 80, 96, 128, 256)");
  }
}

// q [num_tokens, heads, head_dim]; cache [2, num_blocks, block_size, kv_heads,
// head_dim]; block_tables [num_seqs, max_blocks] int64; query_start
// [num_seqs + 1] int64; context_lens [num_seqs] int64 (KV after this
// forward's writes); window: the keys each row sees back from its own
// position, itself included (0: all). Returns [num_tokens, heads * head_dim]
// in q's dtype.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start,
                           const at::Tensor& context_lens, double scale, int64_t window) {
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive, got ", window);
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [tokens, heads, d]");
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous(),
              "cache must be contiguous [2, blocks, block_size, kv_heads, d]");
  TORCH_CHECK(cache.scalar_type() == q.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong &&
                  block_tables.is_contiguous(), "block_tables must be contiguous int64 [seqs, blocks]");
  TORCH_CHECK(query_start.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  query_start.is_contiguous() && context_lens.is_contiguous(),
              "query_start and context_lens must be contiguous int64");
  const int64_t num_seqs = context_lens.size(0);
  TORCH_CHECK(query_start.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs,
              "query_start, context_lens and block_tables disagree on the sequences");
  const int64_t heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = cache.size(2), kv_heads = cache.size(3);
  TORCH_CHECK(cache.size(4) == head_dim && heads % kv_heads == 0, "head shapes disagree");
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const int64_t* contexts = context_lens.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == q.size(0), "query_start must cover q's rows");
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t span = starts[s + 1] - starts[s];
    TORCH_CHECK(span >= 1 && contexts[s] >= span &&
                    contexts[s] <= block_tables.size(1) * block_size,
                "sequence ", s, ": context ", contexts[s], " does not fit its span ", span,
                " and block table");
  }
  const Shape shape{heads, kv_heads, heads / kv_heads, block_size, cache.stride(0),
                    static_cast<float>(scale), window};
  at::Tensor out = at::empty({q.size(0), heads * head_dim}, q.options());
  switch (q.scalar_type()) {
    case at::kFloat: by_head_dim<float>(q, cache, out, block_tables, query_start, context_lens, shape); break;
    case at::kBFloat16: by_head_dim<c10::BFloat16>(q, cache, out, block_tables, query_start, context_lens, shape); break;
    case at::kHalf: by_head_dim<c10::Half>(q, cache, out, block_tables, query_start, context_lens, shape); break;
    default: TORCH_CHECK(false, "paged_attention takes float32, bfloat16 or float16, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(specpage_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor cache, Tensor block_tables, Tensor query_start, "
        "Tensor context_lens, float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(specpage_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
