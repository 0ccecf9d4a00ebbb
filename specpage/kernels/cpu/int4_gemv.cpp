// Products of a few bf16 rows by group-wise int4 weights on a CPU with
// AVX-512 BF16, for one stream's decode and verify steps: y [rows, out] =
// x [rows, in] @ W.T with W[o, i] = q[o, i] * scale[o, g] + offset[o, g]
// (q in 0..15, g = i / 32: a GGUF Q4_1 block, or Q4_0 with offset = -8 scale).
//
// Each vector lane is one output, so nothing is summed across lanes. The
// weights are one stream, in the order the kernel reads them: per block of
// 16 outputs and group of 32 inputs, a tile of
//   256 bytes: four 64-byte chunks of 32 16-bit words; word 2l + t of chunk
//              j holds, in its nibble k, q[16b + l][32g + 2(4j + k) + t];
// then, where every scale and offset is a float16 value (a GGUF's d and m
// always are), 320 bytes in all:
//    32 bytes: scale of the 16 outputs, fp16;
//    32 bytes: offset of the 16 outputs, fp16,
// and bias = offset - 128 scale taken in fp32 as the tile is read (one
// rounding, as layers/quant.py takes it); else (round-to-nearest's offsets
// are fp32 sums), 384 bytes:
//    64 bytes: scale of the 16 outputs, fp32;
//    64 bytes: bias = offset - 128 scale of the 16 outputs, fp32.
// The tiles' last dimension says which; fp32 scales and biases are a third
// of what a product reads, fp16 ones a fifth.
// A nibble k of a word becomes the bf16 128 + q (the bits 0x4300 | q, exact)
// with one shift and one ternary logic op, so a chunk gives four vectors of
// 16 outputs x one pair of inputs; vdpbf16ps multiplies each by that pair of
// x broadcast to every lane. Then, per group,
//   y[o] += scale[o, g] * dp[o, g] + bias[o, g] * xsum_g
// with xsum_g the sum of x's group. One sequential read per thread (output
// blocks split over threads); up to 8 x rows share each unpacking, and
// further rows take further passes over a block while its tiles are in cache.
// Against the earlier layout (two groups per 32 bytes of one output, lanes
// summed at the end) SmolLM2's 30 layers of products ran level at 1 row
// (bound by reading memory) and 1.4-1.7x faster at 2-5 rows.
//
// `next`, where given, is the tiles of the product a decoder layer computes
// after this one (decoder_stack.cpp passes it): each thread's reads ahead
// run on past the end of its share into its share of those, so that the
// next product does not start reading cold. SmolLM2's products are short
// (0.25-1.3 MB), and such a start costs every one of them.
//
// Registered as torch.ops.specpage_cpu.int4_gemv; layers/quant.py's
// int4_stream writes the layout; has_bf16_gemv (in bf16_gemv.cpp) says
// whether this build has the instructions. The same products with x taken
// to int8 (int8x_gemv, on AVX-512 VNNI) are further down.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(__AVX512BF16__) || defined(__AVX512VNNI__)
#include <immintrin.h>
#endif

#include <cmath>

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "vec.h"

namespace {

using namespace specpage_cpu;

constexpr int64_t kGroup = 32;       // inputs per scale
constexpr int64_t kBlock = 16;       // outputs per block: one vector's lanes
constexpr int64_t kNibbleBytes = kBlock * kGroup / 2;
constexpr int64_t kHalfTileBytes = kNibbleBytes + 2 * kBlock * 2;  // + fp16 scales, offsets
constexpr int64_t kFloatTileBytes = kNibbleBytes + 2 * kBlock * 4;  // + fp32 scales, biases
constexpr int64_t kMaxRows = 8;  // rows one pass over a block takes (more: passes)

// Where one thread's reads ahead go once they pass the end of its share:
// the same thread's share of the next product's tiles (or nowhere).
struct Ahead {
  const uint8_t* end;                 // one past this thread's share
  const uint8_t* next = nullptr;      // its share of the next product's tiles
  const uint8_t* next_end = nullptr;
};

// Where tile `fetch` (kTileBytes ahead of the one being read) is, once the
// reads pass the end of this thread's share: in its share of the next
// product, or nowhere.
inline const uint8_t* ahead_of(const uint8_t* fetch, int64_t tile_bytes, const Ahead& ahead) {
  if (fetch >= ahead.end && ahead.next != nullptr) {
    fetch = ahead.next + (fetch - ahead.end);
    if (fetch + tile_bytes > ahead.next_end) return nullptr;
  }
  return fetch;
}

#if defined(__AVX512BF16__) || defined(__AVX512VNNI__)
// A tile's 16 float16 values (scales or offsets) as fp32.
inline __m512 halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// Always inlined: compiled apart, a function of prefetches alone looks to
// GCC's interprocedural analysis (ipa-pure-const) like one without effects,
// and -O2 deletes every call to it. That happened here from f43da32 to
// this fix: the int4 and int8x products read with no prefetch at all (and
// none on into the next product's tiles). Restored, on SmolLM2-135M q4 (2
// threads, steps with other models' between, as bench/quantization.py
// runs them): a batch-1 decode step 0.89x (0.86-0.94, 10th-90th
// percentile), 5 rows 0.85x, 32 rows 0.97x.
__attribute__((always_inline)) inline void prefetch_tile(const uint8_t* fetch,
                                                         int64_t tile_bytes) {
  if (fetch == nullptr) return;
  for (int64_t line = 0; line < tile_bytes; line += 64) {
    __builtin_prefetch(fetch + line, 0, 2);  // into L2
  }
}

#if defined(__AVX512BF16__) || defined(__AVX512VNNI__)
// Sixteen outputs v at y + at, rounded to bf16; where widened is given, at
// widened + at instead, as the fp32 values of those bf16 (what y.float()
// would hold, with no bf16 tensor made and converted).
inline void store_out(c10::BFloat16* y, float* widened, int64_t at, vfloat v) {
  if (widened == nullptr) {
    store(y + at, v);
  } else {
    store(widened + at, rounded<c10::BFloat16>(v));
  }
}

// Output block b of y [rows, out] for kRows rows from row0, the rows a
// compile-time count so that every accumulator stays in a register:
// group(g, tile, total) adds group g's products, read from its tile, into
// total[r], tile after tile (the reads running ahead as they go).
template <int64_t kRows, int64_t kTileBytes, typename Group>
void over_groups(const uint8_t* tiles, int64_t groups, c10::BFloat16* y, float* widened,
                 int64_t out, int64_t b, int64_t row0, const Ahead& ahead, Group&& group) {
  const uint8_t* block = tiles + b * groups * kTileBytes;
  __m512 total[kRows];
  for (int64_t r = 0; r < kRows; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* tile = block + g * kTileBytes;
    prefetch_tile(ahead_of(tile + kPrefetchAhead, kTileBytes, ahead), kTileBytes);
    group(g, tile, total);
  }
  for (int64_t r = 0; r < kRows; ++r) {
    store_out(y, widened, (row0 + r) * out + b * kBlock, (vfloat)total[r]);
  }
}
#endif

#if defined(__AVX512BF16__)
struct Operands {
  const uint16_t* x;     // bf16 [rows, in]
  const uint8_t* tiles;  // [out / 16, groups, tile bytes]
  const float* xsum;     // [rows, groups]
  c10::BFloat16* y;      // [rows, out]
  int64_t in, groups, out;
};

// Two chains of vdpbf16ps per row (even and odd pairs of a group), so that
// the adds of one row do not all wait on each other; the same for every row
// count, so a row's result does not depend on how many rows a call brings
// (a verify step's tokens are the decode step's).
constexpr int kChains = 2;

// Output block b for kRows rows of x from row0 (over_groups).
template <int64_t kRows, bool kHalf>
void block_rows(const Operands& p, int64_t b, int64_t row0, const Ahead& ahead) {
  constexpr int64_t kTileBytes = kHalf ? kHalfTileBytes : kFloatTileBytes;
  constexpr int kOrOfAnd = 0xEA;  // ternary logic: (a & b) | c
  const __m512i nibble = _mm512_set1_epi16(0x000f);
  const __m512i bf16_128 = _mm512_set1_epi16(0x4300);
  over_groups<kRows, kTileBytes>(p.tiles, p.groups, p.y, nullptr, p.out, b, row0, ahead,
                                 [&](int64_t g, const uint8_t* tile, __m512* total) {
    __m512 dot[kRows][kChains];
    for (int64_t r = 0; r < kRows; ++r) {
      for (int c = 0; c < kChains; ++c) dot[r][c] = _mm512_setzero_ps();
    }
    // x's pairs of inputs in this group, as 32-bit words
    const uint32_t* xg = reinterpret_cast<const uint32_t*>(p.x + row0 * p.in + g * kGroup);
    for (int j = 0; j < 4; ++j) {
      const __m512i words = _mm512_loadu_si512(tile + 64 * j);
      const __m512i w[4] = {
          _mm512_ternarylogic_epi32(words, nibble, bf16_128, kOrOfAnd),
          _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 4), nibble, bf16_128, kOrOfAnd),
          _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 8), nibble, bf16_128, kOrOfAnd),
          _mm512_or_si512(_mm512_srli_epi16(words, 12), bf16_128)};
      for (int k = 0; k < 4; ++k) {
        for (int64_t r = 0; r < kRows; ++r) {
          const __m512i pair = _mm512_set1_epi32(static_cast<int>(xg[r * p.in / 2 + 4 * j + k]));
          dot[r][k % kChains] =
              _mm512_dpbf16_ps(dot[r][k % kChains], (__m512bh)w[k], (__m512bh)pair);
        }
      }
    }
    __m512 scale, bias;
    if constexpr (kHalf) {
      scale = halves(tile + kNibbleBytes);
      const __m512 offset = halves(tile + kNibbleBytes + 2 * kBlock);
      bias = _mm512_fnmadd_ps(scale, _mm512_set1_ps(128.0f), offset);
    } else {
      const float* scale_and_bias = reinterpret_cast<const float*>(tile + kNibbleBytes);
      scale = _mm512_loadu_ps(scale_and_bias);
      bias = _mm512_loadu_ps(scale_and_bias + kBlock);
    }
    for (int64_t r = 0; r < kRows; ++r) {
      __m512 sum = dot[r][0];
      for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, dot[r][c]);
      total[r] = _mm512_fmadd_ps(sum, scale, total[r]);
      total[r] = _mm512_fmadd_ps(bias, _mm512_set1_ps(p.xsum[(row0 + r) * p.groups + g]),
                                 total[r]);
    }
  });
}
#endif

bool is_tiles(const at::Tensor& t, std::initializer_list<int64_t> sizes) {
  return t.dim() == 3 && t.is_contiguous() && t.scalar_type() == at::kByte &&
         std::find(sizes.begin(), sizes.end(), t.size(2)) != sizes.end();
}

// A share's next unclaimed block, alone on its cache line.
struct alignas(64) Cursor {
  std::atomic<int64_t> next{0};
};

// Calls block(b, row0, count, ahead) for every block of 16 outputs b and
// every run of up to kMaxRows rows from row0, the blocks split over threads
// in one sequential share each (at::parallel_for's split), the rows of a
// block taken while its tiles are in cache; `ahead` tells a thread's reads
// where its share ends and where (`next`: the next product's tiles, split
// alike) they go on.
// No setting up on a thread's part (for_blocks' `enter`).
struct Plain {
  template <typename Body>
  void operator()(Body&& body) const { body(); }
};

template <typename F, typename Enter = Plain>
void for_blocks(int64_t rows, const at::Tensor& tiles, const std::optional<at::Tensor>& next,
                F&& block, int64_t max_rows = kMaxRows, Enter&& enter = Plain{}) {
  const int64_t blocks = tiles.size(0), block_bytes = tiles.size(1) * tiles.size(2);
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / block_bytes);
  // parallel_for's split: `used` threads, shares of `chunk` blocks
  const int64_t used = std::min<int64_t>(at::get_num_threads(), (blocks + grain - 1) / grain);
  const int64_t chunk = (blocks + used - 1) / used;
  const uint8_t* data = tiles.data_ptr<uint8_t>();
  auto ahead_for = [&](int64_t begin, int64_t end) {
    Ahead ahead{data + end * block_bytes};
    if (next.has_value() && next->numel() > 0) {  // this thread's share of next, split alike
      const int64_t next_blocks = next->size(0), next_bytes = next->size(1) * next->size(2);
      const int64_t next_chunk = (next_blocks + used - 1) / used;
      const int64_t first = std::min(next_blocks, begin / chunk * next_chunk);
      const int64_t last = std::min(next_blocks, first + next_chunk);
      ahead.next = next->data_ptr<uint8_t>() + first * next_bytes;
      ahead.next_end = next->data_ptr<uint8_t>() + last * next_bytes;
    }
    return ahead;
  };
  auto run = [&](int64_t b, const Ahead& ahead) {
    for (int64_t row0 = 0; row0 < rows; row0 += max_rows) {
      block(b, row0, std::min(max_rows, rows - row0), ahead);
    }
  };
  // Each thread takes its own share front to back, then helps the shares
  // still unfinished from where their threads have got to, in claims of
  // ~16 KB of tiles per row of x. A thread whose share is read ahead for
  // it (decoder_stack.cpp) finishes first, and the shares' reading from
  // memory ends unevenly: on SmolLM2-135M q4 (2 threads, in one process,
  // blocks of steps interleaved with steps without it), a verify step of 5
  // rows 0.96x (0.92-1.00, 10th-90th percentile), a decode step and a
  // 32-row forward level (0.99x).
  const int64_t claim = std::max<int64_t>(1, (16 << 10) / (block_bytes * rows));
  std::vector<Cursor> cursors(used);
  for (int64_t t = 0; t < used; ++t) cursors[t].next.store(t * chunk, std::memory_order_relaxed);
  at::parallel_for(0, used, 1, [&](int64_t first, int64_t last) {
    enter([&] {
    for (int64_t t = first; t < last; ++t) {
      const Ahead ahead = ahead_for(t * chunk, std::min(blocks, (t + 1) * chunk));
      for (int64_t s = 0; s < used; ++s) {
        const int64_t share = (t + s) % used, end = std::min(blocks, (share + 1) * chunk);
        for (;;) {
          const int64_t b0 = cursors[share].next.fetch_add(claim, std::memory_order_relaxed);
          if (b0 >= end) break;
          for (int64_t b = b0; b < std::min(end, b0 + claim); ++b) run(b, ahead);
        }
      }
    }
    });
  });
}

void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x must be contiguous bf16 [rows, in]");
  TORCH_CHECK(x.size(0) >= 1, op, " needs at least one row of x");
  TORCH_CHECK(x.size(1) % kGroup == 0, op, " needs in a multiple of ", kGroup, ", got ",
              x.size(1));
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& tiles,
                     const std::optional<at::Tensor>& next) {
  check_x(x, "int4_gemv");
  const int64_t rows = x.size(0), in = x.size(1), groups = in / kGroup;
  TORCH_CHECK(is_tiles(tiles, {kHalfTileBytes, kFloatTileBytes}) && tiles.size(1) == groups,
              "tiles must be contiguous uint8 [out / 16, in / 32, ", kHalfTileBytes, " or ",
              kFloatTileBytes, "] (layers/quant.py's int4_stream) for x of ", in, " inputs");
  TORCH_CHECK(!next.has_value() || is_tiles(*next, {kHalfTileBytes, kFloatTileBytes}),
              "next must be contiguous uint8 [out / 16, in / 32, ", kHalfTileBytes, " or ",
              kFloatTileBytes, "]: the next product's tiles");
  const bool half = tiles.size(2) == kHalfTileBytes;
  const int64_t out = tiles.size(0) * kBlock;
  at::Tensor y = at::empty({rows, out}, x.options());
#if defined(__AVX512BF16__)
  std::vector<float> xsum(rows * groups);  // each x row's group sums
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float total = 0.0f;
      const c10::BFloat16* group = x.data_ptr<c10::BFloat16>() + r * in + g * kGroup;
      for (int64_t i = 0; i < kGroup; ++i) total += static_cast<float>(group[i]);
      xsum[r * groups + g] = total;
    }
  }
  const Operands ops{reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()),
                     tiles.data_ptr<uint8_t>(), xsum.data(), y.data_ptr<c10::BFloat16>(), in,
                     groups, out};
  for_blocks(rows, tiles, next, [&](int64_t b, int64_t row0, int64_t count, const Ahead& ahead) {
    with_rows(count, [&](auto n) {
      if (half) {
        block_rows<decltype(n)::value, true>(ops, b, row0, ahead);
      } else {
        block_rows<decltype(n)::value, false>(ops, b, row0, ahead);
      }
    });
  });
#else
  TORCH_CHECK(false, "int4_gemv: built without AVX-512 BF16");
#endif
  return y;
}

// ---- x taken to int8 (int8x_gemv) ----
//
// The same products with x quantized as GGML's Q8 blocks quantize it, per
// row and group of 32: d = max |x| / 127, x ~ d q with q = round(x / d) in
// -127..127. Then, per group, the weights' integer levels times q are summed
// exactly in int32 by vpdpbusd (u8 x s8, four products a lane, 64 a
// vector: twice vdpbf16ps's, with no conversion of the levels to floats),
// and
//   y[o] += scale[o, g] * (d_g * dot[o, g]) + offset[o, g] * (d_g * sum_g q)
// is W x~ for x~ = d q: the weights exact, x to about 8 bits in its group.
// This is what llama.cpp computes for Q4_0/Q4_1/Q8_0 weights on a CPU.
// Tiles, per 16 outputs and group of 32 inputs:
//   q4: 256 bytes, four 64-byte chunks, byte 4l + t of chunk j holding
//       q[l][8j + t] in its low nibble and q[l][8j + 4 + t] in its high one;
//       then 16 scales and 16 offsets, fp16 (320 bytes) or fp32 (384);
//   q8: 512 bytes, eight chunks, byte 4l + t of chunk j = q[l][4j + t] + 128
//       (GGML's Q8_0 values made unsigned), then 16 fp16 scales d; the
//       offset is -128 d (544 bytes);
//   q5: levels q in 0..31 (GGML's Q5_0 values, level - 16 the weight's
//       multiple of d): their low four bits as q4's 256 bytes; then 64
//       bytes of fifth bits, byte 4l + t holding in bit 2j that of
//       q[l][8j + t] and in bit 2j + 1 that of q[l][8j + 4 + t]; then 16
//       fp16 scales d; the offset is -16 d (352 bytes: 5.5 bits a weight,
//       as the file's blocks, where q8 tiles read 8.5).
// A unpacked nibble chunk is two vectors of bytes (an and, a shift and an
// and): against the bf16 kernel above, a third of the instructions a tile.

constexpr int64_t kQ8TileBytes = kBlock * kGroup + kBlock * 2;  // levels + fp16 scales
constexpr int64_t kFifthBitBytes = kBlock * kGroup / 8;
constexpr int64_t kQ5TileBytes = kNibbleBytes + kFifthBitBytes + kBlock * 2;  // + fp16 scales

enum class Format { kQ4Half, kQ4Float, kQ8, kQ5 };

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
struct QuantizedX {
  std::vector<int8_t> q;  // [rows, in]
  std::vector<float> d;   // [rows, groups]: the group's scale
  std::vector<float> sum; // [rows, groups]: d * the sum of the group's q
};

// A group of x whose largest value is below this counts as zero, as in
// kquant_gemv.cpp's blocks: its scale and the products' would be subnormal,
// each step of whose arithmetic is a microcode assist on x86.
constexpr float kLeastGroupMax = 0x1p-90f;

// x [rows, in] bf16 to Q8 blocks of 32. A group that is not finite gets a
// NaN scale, so that its products come out NaN as the bf16 kernel's do.
// Rows past `rows`, up to `padded` (the AMX kernel's whole tiles), are 0.
QuantizedX quantize_x(const c10::BFloat16* x, int64_t rows, int64_t in, int64_t padded) {
  const int64_t groups = in / kGroup;
  QuantizedX out{std::vector<int8_t>(padded * in), std::vector<float>(padded * groups),
                 std::vector<float>(padded * groups)};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = r * groups + g;
      const __m512 a = (__m512)load(x + r * in + g * kGroup);
      const __m512 b = (__m512)load(x + r * in + g * kGroup + kLanes);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      if (!std::isfinite(_mm512_reduce_add_ps(_mm512_add_ps(a, b)))) {
        out.d[at] = out.sum[at] = std::nanf("");
        continue;  // its q stay 0
      }
      if (amax < kLeastGroupMax) continue;  // d, sum and q stay 0
      const __m512 inverse = _mm512_set1_ps(127.0f / amax);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse));  // to nearest even
      const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
      int8_t* q = out.q.data() + r * in + g * kGroup;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + kLanes), _mm512_cvtsepi32_epi8(qb));
      out.d[at] = amax / 127.0f;
      out.sum[at] = out.d[at] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
    }
  }
  return out;
}

struct Int8xOperands {
  const QuantizedX* x;
  const uint8_t* tiles;  // [out / 16, groups, tile bytes]
  c10::BFloat16* y;      // [rows, out], or null where widened is given
  float* widened;        // [rows, out] (store_out), or null
  int64_t in, groups, out;
};

// Rows from which each row's vpdpbusd sum in one chain: the rows' chains
// are then enough to keep the instructions from waiting on each other.
// With two chains a row at every count, GCC's code for q8 tiles ran 7 rows
// or more at about twice the time a row that q4 tiles took (AMD EPYC, 2
// threads, 4,096 x 640 q8 tiles: 32 rows 623-656 us, 310-340 with one
// chain; 8 rows 167-190 us, 95-111), and the q4 models' head took the
// dense bf16 product past 8 rows. q4 and q5 tiles measured level either
// way. The int32 sums are exact either way: a row's bits do not change.
constexpr int64_t kOneChainFrom = 3;

template <int64_t kRows, Format kFormat>
void block_rows_int8x(const Int8xOperands& p, int64_t b, int64_t row0, const Ahead& ahead) {
  constexpr int64_t kTileBytes = kFormat == Format::kQ4Half    ? kHalfTileBytes
                                 : kFormat == Format::kQ4Float ? kFloatTileBytes
                                 : kFormat == Format::kQ5      ? kQ5TileBytes
                                                               : kQ8TileBytes;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0f);
  over_groups<kRows, kTileBytes>(p.tiles, p.groups, p.y, p.widened, p.out, b, row0, ahead,
                                 [&](int64_t g, const uint8_t* tile, __m512* total) {
    // two chains a row where there are few rows (kOneChainFrom)
    constexpr int64_t kDots = kRows >= kOneChainFrom ? 1 : 2;
    __m512i dot[kRows][kDots];
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t c = 0; c < kDots; ++c) dot[r][c] = _mm512_setzero_si512();
    }
    const int8_t* xg = p.x->q.data() + row0 * p.in + g * kGroup;
    auto word = [&](int64_t r, int64_t k) {  // x's inputs 4k..4k+3 of the group, row r
      int32_t bits;
      std::memcpy(&bits, xg + r * p.in + 4 * k, sizeof(bits));
      return _mm512_set1_epi32(bits);
    };
    if constexpr (kFormat == Format::kQ8) {
      for (int64_t j = 0; j < 8; ++j) {
        const __m512i w = _mm512_loadu_si512(tile + 64 * j);
        for (int64_t r = 0; r < kRows; ++r) {
          dot[r][j % kDots] = _mm512_dpbusd_epi32(dot[r][j % kDots], w, word(r, j));
        }
      }
    } else {
      for (int64_t j = 0; j < 4; ++j) {
        const __m512i bytes = _mm512_loadu_si512(tile + 64 * j);
        __m512i low = _mm512_and_si512(bytes, low_nibbles);
        __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
        if constexpr (kFormat == Format::kQ5) {  // 16 more where the fifth bit is set
          const __m512i fifth = _mm512_loadu_si512(tile + kNibbleBytes);
          const __m512i sixteen = _mm512_set1_epi8(16);
          low = _mm512_mask_add_epi8(
              low, _mm512_test_epi8_mask(fifth, _mm512_set1_epi8(static_cast<char>(1 << (2 * j)))),
              low, sixteen);
          high = _mm512_mask_add_epi8(
              high, _mm512_test_epi8_mask(fifth, _mm512_set1_epi8(static_cast<char>(2 << (2 * j)))),
              high, sixteen);
        }
        for (int64_t r = 0; r < kRows; ++r) {
          dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], low, word(r, 2 * j));
          dot[r][kDots - 1] = _mm512_dpbusd_epi32(dot[r][kDots - 1], high, word(r, 2 * j + 1));
        }
      }
    }
    const uint8_t* params = tile + (kFormat == Format::kQ8   ? kBlock * kGroup
                                    : kFormat == Format::kQ5 ? kNibbleBytes + kFifthBitBytes
                                                             : kNibbleBytes);
    __m512 scale, offset;
    if constexpr (kFormat == Format::kQ4Float) {
      scale = _mm512_loadu_ps(reinterpret_cast<const float*>(params));
      offset = _mm512_loadu_ps(reinterpret_cast<const float*>(params) + kBlock);
    } else {
      scale = halves(params);
      offset = kFormat == Format::kQ8   ? _mm512_mul_ps(scale, _mm512_set1_ps(-128.0f))
               : kFormat == Format::kQ5 ? _mm512_mul_ps(scale, _mm512_set1_ps(-16.0f))
                                        : halves(params + 2 * kBlock);
    }
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t at = (row0 + r) * p.groups + g;
      __m512i dots = dot[r][0];
      for (int64_t c = 1; c < kDots; ++c) dots = _mm512_add_epi32(dots, dot[r][c]);
      const __m512 sum = _mm512_cvtepi32_ps(dots);
      total[r] = _mm512_fmadd_ps(_mm512_mul_ps(sum, _mm512_set1_ps(p.x->d[at])), scale, total[r]);
      total[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(p.x->sum[at]), total[r]);
    }
  });
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
// ---- q8 products on AMX tiles (int8x_gemv from kAmxFromRows rows) ----
//
// One tdpbsud multiplies up to 16 rows of x's int8 group by a block's 32 x
// 16 levels: C [rows, 16] int32 += A [rows, 32] int8 . B [8, 64] uint8, B
// holding four inputs of each output in a 32-bit word, which is a q8 tile
// as it is stored (vpdpbusd takes 8 instructions a row for the same sums).
// The int32 sums are exact and the epilogue per row and group is
// block_rows_int8x's, in its order, so a row's outputs are bit for bit the
// vpdpbusd kernel's: which kernel a call takes does not change a token.
// SmolLM2-135M's Q8_0 vocabulary projection (49,152 x 576, 2 threads):
//   rows        1     4     5     8    16    32
//   vpdpbusd  632   699  1204  1600  3100  5744 us
//   AMX       730   808   887   959  1415  2422 us
// q4 tiles would need their nibbles unpacked to memory for the tile loads;
// done so, they ran level with vpdpbusd at 5-8 rows and slower elsewhere.

constexpr int64_t kAmxRows = 16;     // rows of a tile
constexpr int64_t kAmxFromRows = 5;  // int8x_gemv takes the tiles from this many rows

// The kernel asks Linux for the tiles' state once per process.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// for_blocks' `enter`: each thread configures its tiles for `rows` rows of x
// (others' configurations, oneDNN's, come and go between calls) and
// releases them when its share is done.
struct AmxTiles {
  int64_t rows;
  template <typename Body>
  void operator()(Body&& body) const {
    TileConfig config;
    for (int t = 0; t < 4; ++t) {  // C
      config.rows[t] = static_cast<uint8_t>(rows);
      config.bytes_per_row[t] = kBlock * 4;
    }
    for (int t = 4; t < 6; ++t) {  // A
      config.rows[t] = static_cast<uint8_t>(rows);
      config.bytes_per_row[t] = kGroup;
    }
    for (int t = 6; t < 8; ++t) {  // B
      config.rows[t] = kGroup / 4;
      config.bytes_per_row[t] = kBlock * 4;
    }
    _tile_loadconfig(&config);
    body();
    _tile_release();
  }
};

template <int64_t kRows>
void block_rows_amx(const Int8xOperands& p, int64_t b, int64_t row0, const Ahead& ahead) {
  constexpr int64_t kTileBytes = kQ8TileBytes;
  // One group's C as stored: all the tile's rows (those past kRows, the
  // padding of a call's last rows, are written and not read).
  constexpr int64_t kSumBytes = kAmxRows * kBlock * 4;
  thread_local std::vector<int32_t> buffer;  // C of every group
  const size_t sums_words = p.groups * kAmxRows * kBlock;
  if (buffer.size() < sums_words + 16) buffer.resize(sums_words + 16);
  uint8_t* sums = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
  const uint8_t* block = p.tiles + b * p.groups * kTileBytes;
  const int8_t* xq = p.x->q.data() + row0 * p.in;
  // Every group's product first, four on the tiles at a time (tile
  // registers are not renamed: a tile's next use waits for its last).
  auto product = [&](auto slot, int64_t g) {
    constexpr int kSlot = decltype(slot)::value;
    const uint8_t* tile = block + g * kTileBytes;
    prefetch_tile(ahead_of(tile + kPrefetchAhead, kTileBytes, ahead), kTileBytes);
    void* c = sums + g * kSumBytes;
    const void* a = xq + g * kGroup;
    // (the intrinsics take a tile's number as a literal: C 0-3, A 4-5, B 6-7)
    if constexpr (kSlot == 0) {
      _tile_loadd(4, a, p.in); _tile_loadd(6, tile, 64); _tile_zero(0);
      _tile_dpbsud(0, 4, 6); _tile_stored(0, c, 64);
    } else if constexpr (kSlot == 1) {
      _tile_loadd(5, a, p.in); _tile_loadd(7, tile, 64); _tile_zero(1);
      _tile_dpbsud(1, 5, 7); _tile_stored(1, c, 64);
    } else if constexpr (kSlot == 2) {
      _tile_loadd(4, a, p.in); _tile_loadd(6, tile, 64); _tile_zero(2);
      _tile_dpbsud(2, 4, 6); _tile_stored(2, c, 64);
    } else {
      _tile_loadd(5, a, p.in); _tile_loadd(7, tile, 64); _tile_zero(3);
      _tile_dpbsud(3, 5, 7); _tile_stored(3, c, 64);
    }
  };
  using S0 = std::integral_constant<int, 0>;
  using S1 = std::integral_constant<int, 1>;
  using S2 = std::integral_constant<int, 2>;
  using S3 = std::integral_constant<int, 3>;
  int64_t g = 0;
  for (; g + 4 <= p.groups; g += 4) {
    product(S0{}, g); product(S1{}, g + 1); product(S2{}, g + 2); product(S3{}, g + 3);
  }
  if (g < p.groups) product(S0{}, g);
  if (g + 1 < p.groups) product(S1{}, g + 1);
  if (g + 2 < p.groups) product(S2{}, g + 2);
  __m512 total[kRows];
  for (int64_t r = 0; r < kRows; ++r) total[r] = _mm512_setzero_ps();
  for (g = 0; g < p.groups; ++g) {
    const __m512 scale = halves(block + g * kTileBytes + kBlock * kGroup);
    const __m512 offset = _mm512_mul_ps(scale, _mm512_set1_ps(-128.0f));
    const int32_t* dots = reinterpret_cast<const int32_t*>(sums + g * kSumBytes);
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t at = (row0 + r) * p.groups + g;
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(dots + r * kBlock));
      total[r] = _mm512_fmadd_ps(_mm512_mul_ps(sum, _mm512_set1_ps(p.x->d[at])), scale, total[r]);
      total[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(p.x->sum[at]), total[r]);
    }
  }
  for (int64_t r = 0; r < kRows; ++r) {
    store_out(p.y, p.widened, (row0 + r) * p.out + b * kBlock, (vfloat)total[r]);
  }
}
#endif
#endif

bool has_int8x_gemv() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

bool has_amx_int8() {
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
  return amx_permitted();
#else
  return false;
#endif
}

enum class Kernel { kAuto, kVnni, kAmx };

at::Tensor int8x_product(const at::Tensor& x, const at::Tensor& tiles,
                         const std::optional<at::Tensor>& next, Kernel kernel,
                         bool widened = false) {
  check_x(x, "int8x_gemv");
  const int64_t rows = x.size(0), in = x.size(1), groups = in / kGroup;
  const auto sizes = {kHalfTileBytes, kFloatTileBytes, kQ8TileBytes, kQ5TileBytes};
  TORCH_CHECK(is_tiles(tiles, sizes) && tiles.size(1) == groups,
              "tiles must be contiguous uint8 [out / 16, in / 32, ", kHalfTileBytes, ", ",
              kFloatTileBytes, ", ", kQ8TileBytes, " or ", kQ5TileBytes,
              "] (layers/quant.py's int8x_stream, q8_stream or q5_stream) for x of ", in,
              " inputs");
  TORCH_CHECK(!next.has_value() || is_tiles(*next, sizes),
              "next must be contiguous uint8 [out / 16, in / 32, ", kHalfTileBytes, ", ",
              kFloatTileBytes, ", ", kQ8TileBytes, " or ", kQ5TileBytes,
              "]: the next product's tiles");
  TORCH_CHECK(kernel != Kernel::kAmx || has_amx_int8(),
              "int8x_gemv: this build or CPU has no AMX int8 tiles");
  TORCH_CHECK(kernel != Kernel::kAmx || tiles.size(2) == kQ8TileBytes,
              "int8x_gemv: the AMX kernel takes q8 tiles (", kQ8TileBytes, " bytes), got ",
              tiles.size(2));
  const int64_t out = tiles.size(0) * kBlock;
  at::Tensor y = at::empty({rows, out}, x.options().dtype(widened ? at::kFloat : at::kBFloat16));
  [[maybe_unused]] c10::BFloat16* narrow = widened ? nullptr : y.data_ptr<c10::BFloat16>();
  [[maybe_unused]] float* wide = widened ? y.data_ptr<float>() : nullptr;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const int64_t tile_bytes = tiles.size(2);
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
  const bool amx = kernel == Kernel::kAmx ||
                   (kernel == Kernel::kAuto && tile_bytes == kQ8TileBytes && rows >= kAmxFromRows &&
                    has_amx_int8());
  if (amx) {
    const int64_t tile_rows = std::min(rows, kAmxRows);
    const int64_t padded = (rows + tile_rows - 1) / tile_rows * tile_rows;
    const QuantizedX quantized = quantize_x(x.data_ptr<c10::BFloat16>(), rows, in, padded);
    const Int8xOperands ops{&quantized, tiles.data_ptr<uint8_t>(), narrow, wide, in, groups, out};
    auto block = [&](int64_t b, int64_t row0, int64_t count, const Ahead& ahead) {
      with_count<kAmxRows>(count, [&](auto n) {
        block_rows_amx<decltype(n)::value>(ops, b, row0, ahead);
      });
    };
    for_blocks(rows, tiles, next, block, tile_rows, AmxTiles{tile_rows});
    return y;
  }
#endif
  const QuantizedX quantized = quantize_x(x.data_ptr<c10::BFloat16>(), rows, in, rows);
  const Int8xOperands ops{&quantized, tiles.data_ptr<uint8_t>(), narrow, wide, in, groups, out};
  for_blocks(rows, tiles, next, [&](int64_t b, int64_t row0, int64_t count, const Ahead& ahead) {
    with_rows(count, [&](auto n) {
      constexpr int64_t kRows = decltype(n)::value;
      if (tile_bytes == kHalfTileBytes) {
        block_rows_int8x<kRows, Format::kQ4Half>(ops, b, row0, ahead);
      } else if (tile_bytes == kFloatTileBytes) {
        block_rows_int8x<kRows, Format::kQ4Float>(ops, b, row0, ahead);
      } else if (tile_bytes == kQ5TileBytes) {
        block_rows_int8x<kRows, Format::kQ5>(ops, b, row0, ahead);
      } else {
        block_rows_int8x<kRows, Format::kQ8>(ops, b, row0, ahead);
      }
    });
  });
#else
  TORCH_CHECK(false, "int8x_gemv: built without AVX-512 VNNI");
#endif
  return y;
}

at::Tensor int8x_gemv(const at::Tensor& x, const at::Tensor& tiles,
                      const std::optional<at::Tensor>& next) {
  return int8x_product(x, tiles, next, Kernel::kAuto);
}

// int8x_gemv(x, tiles).float() without the bf16 tensor: the same values,
// written as fp32 by the product's threads (the logits of a quantized head,
// which sampling reads as fp32: converting a step's 49,152 of them took
// 25-45 us of a SmolLM2 step on 2 cores, the conversion's threads reading
// what the product's had written). SmolLM2-135M q4, one stream at T 0.7,
// the two alternated every other step in one process: steps 46-68 us
// shorter (medians of four runs, speculation off and on, ~4.5-5.4 ms).
at::Tensor int8x_gemv_widened(const at::Tensor& x, const at::Tensor& tiles) {
  return int8x_product(x, tiles, std::nullopt, Kernel::kAuto, true);
}

// int8x_gemv on the kernel named ("vnni": vpdpbusd, "amx": the tiles), for
// tests and benches that compare the two.
at::Tensor int8x_gemv_on(const at::Tensor& x, const at::Tensor& tiles, c10::string_view kernel) {
  TORCH_CHECK(kernel == "vnni" || kernel == "amx",
              "int8x_gemv_on: kernel must be 'vnni' or 'amx', got '", std::string(kernel), "'");
  return int8x_product(x, tiles, std::nullopt, kernel == "amx" ? Kernel::kAmx : Kernel::kVnni);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpage_cpu, m) {
  m.def("int4_gemv(Tensor x, Tensor tiles, Tensor? next=None) -> Tensor");
  m.def("int8x_gemv(Tensor x, Tensor tiles, Tensor? next=None) -> Tensor");
  m.def("int8x_gemv_widened(Tensor x, Tensor tiles) -> Tensor");
  m.def("has_int8x_gemv() -> bool");
  m.def("int8x_gemv_on(Tensor x, Tensor tiles, str kernel) -> Tensor");
  m.def("has_amx_int8() -> bool");
}

TORCH_LIBRARY_IMPL(specpage_cpu, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int8x_gemv", &int8x_gemv);
  m.impl("int8x_gemv_widened", &int8x_gemv_widened);
  m.impl("int8x_gemv_on", &int8x_gemv_on);
}

TORCH_LIBRARY_IMPL(specpage_cpu, CompositeExplicitAutograd, m) {
  m.impl("has_int8x_gemv", &has_int8x_gemv);
  m.impl("has_amx_int8", &has_amx_int8);
}
