// Products of x [rows, in] by GGML K-quant weights (Q4_K, Q5_K, Q6_K), read
// as a GGUF stores them: W [out, in / 256 super-blocks] of
//   Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and
//        mins m[8] packed, 128 bytes of nibbles: byte i of chunk c (32
//        bytes) holds value 64c + i in its low nibble, 64c + 32 + i in its
//        high one; w = d sc[s] q - dmin m[s], s the sub-block of 32;
//   Q5_K (176 bytes): as Q4_K, with 32 bytes of fifth bits before the
//        nibbles: bit s of byte i is value 32s + i's;
//   Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16
//        int8 scales (one per 16 values), fp16 d; w = d sc[g] (q - 32).
// As llama.cpp does on a CPU, x is first taken to int8 per row and
// super-block (a Q8_K block: here d = max |x| / 127 and q = round(x / d) to
// nearest even, the sums of q per 16 for the mins and offsets), then the weights' integer levels times
// q are summed exactly in int32 with vpdpbusd, the sub-block scales applied
// to those int32 sums, and per super-block
//   y += d_w d_x sum_s sc[s] dot_s - dmin_w d_x sum_s m[s] xsum_s.
// The weights are exact; x loses what 8 bits per 256 values lose.
//
// The weights are read as tiles of 16 outputs (the same bytes, laid out at
// load so that a vector holds 4 inputs of each of 16 outputs; below), for
// up to 4 rows of x at a time, which share the unpacking; more rows take
// more passes while the tile is in cache. Each output's sums run in one
// order whatever the other rows or their number, so a row's result is the
// same bit for bit alone or in any batch (layers/products.py
// row_invariant). Threads split the tiles.
//
// Without AVX-512 VNNI and BW a portable loop computes the same sums (the
// int32 sums are exact, so only the float steps' order differs).
//
// Registered as torch.ops.specpage_cpu.kquant_tiles and kquant_untile (a
// tensor's blocks to tiles and back), kquant_quantize_x (x to Q8_K) and
// kquant_gemv (Q8_K x by one tensor's tiles, into a slice of y's columns,
// so that a fused projection's parts of several types share one x and one
// y); kquant_dequantize gives the bf16 weights for the dense products of
// many rows. layers/kquant.py holds the reference and chooses.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KQUANT_VNNI 1
#endif
#if defined(KQUANT_VNNI) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace {

using namespace specpage_cpu;

constexpr int64_t kSuper = 256;  // values per super-block (GGML's QK_K)
constexpr int64_t kQ4KBytes = 144, kQ5KBytes = 176, kQ6KBytes = 210;
// GGML's type numbers, as the GGUF names them (ggml_type)
constexpr int64_t kQ4K = 12, kQ5K = 13, kQ6K = 14;

// ---- tiles ----
//
// The kernels read a tensor's outputs 16 at a time, each super-block of a
// tile of 16 outputs as 16 x the block's bytes, the same bytes laid out so
// that a vector holds one part of every output (kquant_tiles makes them
// once, at load; kquant_untile gives the blocks back). Of a tile's
// super-block:
//   Q4_K: [0, 32) the 16 d, [32, 64) the 16 dmin (fp16), [64, 256) the
//         packed scales as 3 vectors of one int32 word of each output, [256,
//         2304) the nibbles as 32 vectors: vector v holds bytes 4v..4v+3 of
//         each output's 128 (4 inputs of sub-block 2c in the low nibbles,
//         of 2c + 1 in the high, c = v / 8);
//   Q5_K: as Q4_K, with the fifth bits, 8 vectors of bytes 4v..4v+3 of each
//         output's 32, at [256, 768) and the nibbles at [768, 2816);
//   Q6_K: [0, 3072) for h = 0, 1 and m = 0..7 three vectors of 4 bytes of
//         each output: the high pairs' bytes 32h + 4m.., the low nibbles'
//         64h + 4m.. and 64h + 32 + 4m.. (the order the kernel reads them),
//         [3072, 3328) the 16 scales of each output (scale g at 3072 + 16 g),
//         [3328, 3360) the 16 d.
// The kernels read a tile's super-block front to back: an order the
// hardware's prefetchers follow from memory (an earlier Q6_K layout read
// in three interleaved streams ran at half the bandwidth).
// Outputs past a tensor's last fill its last tile with zero bytes: d = 0.
constexpr int64_t kTile = 16;  // outputs a tile
constexpr int64_t kKScales = 64, kQ4KNibbles = 256, kQ5KHigh = 256, kQ5KNibbles = 768;
constexpr int64_t kQ6KScales = 3072, kQ6KD = 3328;

// Where byte b of output o's block lies in its tile's super-block.
int64_t tile_offset(int64_t type, int64_t o, int64_t b) {
  // a run of bytes laid out as vectors of 4 bytes of each output
  auto spread = [o](int64_t start, int64_t n) { return start + 64 * (n / 4) + 4 * o + n % 4; };
  if (type == kQ6K) {
    // the three vectors of h = n / 64 (low) or n / 32 (high), m
    auto at = [o](int64_t h, int64_t m, int64_t slot, int64_t n) {
      return 64 * (3 * (8 * h + m) + slot) + 4 * o + n % 4;
    };
    if (b < 128) return at(b / 64, (b % 32) / 4, 1 + (b % 64) / 32, b);
    if (b < 192) return at((b - 128) / 32, ((b - 128) % 32) / 4, 0, b);
    if (b < 208) return kQ6KScales + 16 * (b - 192) + o;
    return kQ6KD + 2 * o + (b - 208);
  }
  if (b < 4) return 32 * (b / 2) + 2 * o + b % 2;     // d, dmin
  if (b < 16) return kKScales + 4 * (16 * ((b - 4) / 4) + o) + (b - 4) % 4;
  if (type == kQ4K) return spread(kQ4KNibbles, b - 16);
  if (b < 48) return spread(kQ5KHigh, b - 16);
  return spread(kQ5KNibbles, b - 48);
}

// x's Q8_K block, GGML's block_q8_K: 292 bytes.
struct Q8KBlock {
  float d;
  int8_t q[kSuper];
  int16_t sums[kSuper / 16];  // of q per 16
};
static_assert(sizeof(Q8KBlock) == 292, "block_q8_K is 292 bytes");

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // (c10::Half's conversion is a dozen integer ops)
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Q4_K/Q5_K's 12 bytes to four words: bytes 0-7 sc[8], bytes 8-15 m[8], as
// llama.cpp unpacks them (6 bits each; the top 2 of sub-blocks 4-7 in the
// top bits of bytes 0-7). Words, not bytes in memory: a vector load of
// bytes just stored as words waits for the stores to retire.
inline void scale_words(const uint8_t* packed, uint32_t* u) {
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  std::memcpy(u, packed, 12);
  u[3] = ((u[2] >> 4) & kLow4) | (((u[1] >> 6) & kLow2) << 4);
  const uint32_t mins_low = u[1] & kLow6;
  u[1] = (u[2] & kLow4) | (((u[0] >> 6) & kLow2) << 4);
  u[2] = mins_low;
  u[0] &= kLow6;
}

inline void unpack_scales(const uint8_t* packed, uint8_t* scales_mins) {
  uint32_t u[4];
  scale_words(packed, u);
  std::memcpy(scales_mins, u, 16);
}

// A block of x whose largest value is below this is taken as zero (d = 0):
// its products with any weight (scales down to fp16's least, 2^-24) would
// be below the least normal float, and arithmetic on subnormal floats takes
// a microcode assist on x86, some hundred cycles an instruction. A random
// 1B model's MLP activations fell there: its 5-row down projections took
// 16 ms instead of 0.6 (docs/BENCHMARKS.md, "kquant_stack").
constexpr float kLeastBlockMax = 0x1p-90f;

template <typename scalar_t>
void quantize_row(const scalar_t* x, int64_t in, Q8KBlock* out) {
  for (int64_t b = 0; b < in / kSuper; ++b) {
    const scalar_t* v = x + b * kSuper;
    Q8KBlock& block = out[b];
    float amax = 0.0f, total = 0.0f;
    for (int64_t i = 0; i < kSuper; ++i) {
      const float f = static_cast<float>(v[i]);
      amax = std::max(amax, std::fabs(f));
      total += f;
    }
    std::memset(block.q, 0, sizeof(block.q));
    std::memset(block.sums, 0, sizeof(block.sums));
    if (!std::isfinite(total) || !std::isfinite(amax)) {
      block.d = std::nanf("");  // its products come out NaN, as a dense product's would
      continue;
    }
    if (amax < kLeastBlockMax) {
      block.d = 0.0f;  // q and sums stay 0
      continue;
    }
    const float inverse = 127.0f / amax;
    for (int64_t i = 0; i < kSuper; ++i) {
      block.q[i] = static_cast<int8_t>(std::nearbyint(static_cast<float>(v[i]) * inverse));
    }
    for (int64_t g = 0; g < kSuper / 16; ++g) {
      int sum = 0;
      for (int64_t i = 0; i < 16; ++i) sum += block.q[16 * g + i];
      block.sums[g] = static_cast<int16_t>(sum);
    }
    block.d = amax / 127.0f;
  }
}

// ---- the products of one weight row by kRows rows of x ----
//
// `x` points at the first row's Q8_K blocks, rows `stride` blocks apart;
// dots[r] gets row r's product.

#if defined(KQUANT_VNNI)
// The 32 bytes at p in both halves of a vector.
inline __m512i both_halves(const uint8_t* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A super-block's 256 levels, unsigned, as four vectors of 64: vector c
// holds values 64c..64c+63 in order (as x's q lie).
template <int64_t kType>
inline void unpack_levels(const uint8_t* block, __m512i* levels) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  if constexpr (kType == kQ4K || kType == kQ5K) {
    const uint8_t* nibbles = block + (kType == kQ4K ? 16 : 48);
    // shift counts per 16-bit word: the low half of a vector 0, the high half 4
    const __m512i shift_0_4 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    for (int c = 0; c < 4; ++c) {
      // chunk c's low nibbles are sub-block 2c, its high ones 2c + 1
      levels[c] = _mm512_and_si512(_mm512_srlv_epi16(both_halves(nibbles + 32 * c), shift_0_4), low4);
    }
    if constexpr (kType == kQ5K) {
      const __m512i high = both_halves(block + 16);  // bit s of byte i: value 32s + i's
      for (int c = 0; c < 4; ++c) {
        const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << (2 * c))),
                                               _mm256_set1_epi8(static_cast<char>(2 << (2 * c))), 1);
        const __mmask64 set = _mm512_test_epi8_mask(high, bit);
        levels[c] = _mm512_mask_add_epi8(levels[c], set, levels[c], _mm512_set1_epi8(16));
      }
    }
  } else {
    const uint8_t* low = block;         // 128 bytes
    const uint8_t* high = block + 128;  // 64 bytes
    const __m512i low2 = _mm512_set1_epi8(0x03);
    const __m512i shift_0_2 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i shift_4_6 = _mm512_add_epi16(shift_0_2, _mm512_set1_epi16(4));
    for (int h = 0; h < 2; ++h) {
      const __m512i nibbles = _mm512_loadu_si512(low + 64 * h);
      const __m512i pairs = both_halves(high + 32 * h);
      // values 128h + 0..63: low nibbles, bits 0-1 (first 32) and 2-3 of the pairs;
      // 128h + 64..127: high nibbles, bits 4-5 and 6-7
      const __m512i top_a = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(pairs, shift_0_2), low2), 4);
      const __m512i top_b = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(pairs, shift_4_6), low2), 4);
      levels[2 * h] = _mm512_or_si512(_mm512_and_si512(nibbles, low4), top_a);
      levels[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(nibbles, 4), low4), top_b);
    }
  }
}

// ---- the products of a tile of 16 outputs by kRows rows of x ----
//
// `tile` points at the tile's first super-block, `x` at the first row's
// Q8_K blocks, rows `stride` blocks apart; total[r] gets row r's 16 outputs.
// Each lane is one output: a vector of 64 levels holds 4 consecutive inputs
// of each of the 16 outputs, and vpdpbusd against those 4 inputs of x
// (broadcast) adds each output's 4 products to its lane. Per sub-block of
// 32 (Q6_K: of 16) the int32 sums are multiplied by each output's scale
// (vpmulld), so a super-block's sum is exact in int32, then
//   total += float(sum) (d_w d_x) - float(sum_s m[s] xsum_s) (dmin_w d_x)
// as the per-output kernels did. No horizontal sums: each output's terms
// add in super-block order, whatever the rows.

// Byte `kByte` of each int32 lane of u, as an int32.
template <int kByte>
inline __m512i byte_of(__m512i u) {
  if constexpr (kByte == 3) return _mm512_srli_epi32(u, 24);
  return _mm512_and_si512(_mm512_srli_epi32(u, 8 * kByte), _mm512_set1_epi32(0xff));
}

// A tile's first pass over x's rows reads it from memory: each line is
// asked for into L2 twice, kPrefetchFar and kPrefetchAhead bytes ahead (a
// request the memory system let go far ahead is made again near). Asked
// for once, at either distance, a product of one row read from memory took
// 1.11-1.13x a plain read of its bytes (read_through); asked for twice,
// 1.03-1.04x; at 4 rows 1.29 -> 1.19x (Q4_K 8192x2048 and Q6_K 2048x8192,
// Intel Xeon, alternated call by call). Later passes find the tile in
// cache, where the far requests would only cost (9% at 4 rows, in L2).
// The requests go out a vector's lines at a time, beside the loads of that
// vector, not a super-block's (36 or 53 lines) at once: a burst that long
// held the loads behind it. Spread so, a 3B model's products of one row,
// each read from memory in a step's order, took 1.045 -> 1.027x a plain
// read of their bytes, a 1B's 1.074 -> 1.015x; 16 rows from memory 8-11%
// less time, one row in L2 on one thread Q4_K 43 -> 52 GB/s (Xeon).
// (vec.h's prefetch_ahead, which read_through.cpp's floor calls too.)

inline __m512i load_vector(const uint8_t* p) { return _mm512_loadu_si512(p); }

// x's four int8 at p in every int32 lane.
inline __m512i four_of(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  return _mm512_set1_epi32(word);
}

template <int64_t kRows, int64_t kType>
void tile_product(const uint8_t* tile, int64_t supers, const Q8KBlock* x, int64_t stride,
                  __m512* total, bool first_pass) {
  constexpr int64_t kBytes = kTile * (kType == kQ4K ? kQ4KBytes : kQ5KBytes);
  constexpr int64_t kNibbles = kType == kQ4K ? kQ4KNibbles : kQ5KNibbles;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i low6 = _mm512_set1_epi32(0x3f3f3f3f), k4 = _mm512_set1_epi32(0x0f0f0f0f),
                k2 = _mm512_set1_epi32(0x03030303);
  for (int64_t r = 0; r < kRows; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* t = tile + s * kBytes;
    prefetch_ahead(t, kNibbles, first_pass);
    // the 16 outputs' packed scales as scale_words unpacks one output's:
    // bytes of u0 sc[0..3], u1 sc[4..7], u2 m[0..3], u3 m[4..7]
    __m512i u0 = load_vector(t + kKScales), u1 = load_vector(t + kKScales + 64),
            u2 = load_vector(t + kKScales + 128);
    const __m512i u3 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), k4),
                                       _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, 6), k2), 4));
    const __m512i mins_low = _mm512_and_si512(u1, low6);
    u1 = _mm512_or_si512(_mm512_and_si512(u2, k4),
                         _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, 6), k2), 4));
    u2 = mins_low;
    u0 = _mm512_and_si512(u0, low6);
    __m512i sum[kRows], msum[kRows];
    for (int64_t r = 0; r < kRows; ++r) sum[r] = msum[r] = _mm512_setzero_si512();
    // chunk c: sub-blocks 2c (low nibbles) and 2c + 1 (high)
    auto chunk = [&](auto c_constant) {
      constexpr int c = decltype(c_constant)::value;
      __m512i lo[kRows], hi[kRows];
      for (int64_t r = 0; r < kRows; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
      for (int i4 = 0; i4 < 8; ++i4) {
        prefetch_ahead(t + kNibbles + 64 * (8 * c + i4), 64, first_pass);
        const __m512i v = load_vector(t + kNibbles + 64 * (8 * c + i4));
        __m512i level_lo = _mm512_and_si512(v, low4);
        __m512i level_hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if constexpr (kType == kQ5K) {
          // bit 2c (2c + 1) of each byte: the fifth bit of the low (high) nibbles
          const __m512i high = load_vector(t + kQ5KHigh + 64 * i4);
          const __m512i sixteen = _mm512_set1_epi8(16);
          level_lo = _mm512_mask_add_epi8(level_lo, _mm512_test_epi8_mask(high, _mm512_set1_epi8(static_cast<char>(1 << (2 * c)))),
                                          level_lo, sixteen);
          level_hi = _mm512_mask_add_epi8(level_hi, _mm512_test_epi8_mask(high, _mm512_set1_epi8(static_cast<char>(2 << (2 * c)))),
                                          level_hi, sixteen);
        }
        for (int64_t r = 0; r < kRows; ++r) {
          const int8_t* q = x[r * stride + s].q + 64 * c + 4 * i4;
          lo[r] = _mm512_dpbusd_epi32(lo[r], level_lo, four_of(q));
          hi[r] = _mm512_dpbusd_epi32(hi[r], level_hi, four_of(q + 32));
        }
      }
      const __m512i sc_lo = byte_of<(2 * c) % 4>(c < 2 ? u0 : u1);
      const __m512i sc_hi = byte_of<(2 * c + 1) % 4>(c < 2 ? u0 : u1);
      // m[2c] and m[2c + 1] as the two int16 of each lane, against x's sums
      // of those sub-blocks (at most 32 x 127: int16) by vpmaddwd
      const __m512i m_pair = _mm512_or_si512(byte_of<(2 * c) % 4>(c < 2 ? u2 : u3),
                                             _mm512_slli_epi32(byte_of<(2 * c + 1) % 4>(c < 2 ? u2 : u3), 16));
      for (int64_t r = 0; r < kRows; ++r) {
        const int16_t* sums = x[r * stride + s].sums + 4 * c;
        const uint32_t pair = static_cast<uint16_t>(sums[0] + sums[1]) |
                              static_cast<uint32_t>(static_cast<uint16_t>(sums[2] + sums[3])) << 16;
        sum[r] = _mm512_add_epi32(sum[r], _mm512_add_epi32(_mm512_mullo_epi32(lo[r], sc_lo),
                                                           _mm512_mullo_epi32(hi[r], sc_hi)));
        msum[r] = _mm512_add_epi32(msum[r], _mm512_madd_epi16(m_pair, _mm512_set1_epi32(static_cast<int>(pair))));
      }
    };
    chunk(std::integral_constant<int, 0>{});
    chunk(std::integral_constant<int, 1>{});
    chunk(std::integral_constant<int, 2>{});
    chunk(std::integral_constant<int, 3>{});
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32)));
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512 dx = _mm512_set1_ps(x[r * stride + s].d);
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_mul_ps(d, dx), total[r]);
      total[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum[r]), _mm512_mul_ps(dmin, dx), total[r]);
    }
  }
}

// Q6_K: per 128 values h and four inputs m of each of its 32-value
// quarters, the four level vectors of those inputs (their low nibbles with
// the pairs' bits 0-1, 2-3, 4-5, 6-7); a 16's sum starts at -32 xsum, its
// offset, then takes its scale.
template <int64_t kRows>
void tile_product_q6(const uint8_t* tile, int64_t supers, const Q8KBlock* x, int64_t stride,
                     __m512* total, bool first_pass) {
  constexpr int64_t kBytes = kTile * kQ6KBytes;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int64_t r = 0; r < kRows; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* t = tile + s * kBytes;
    prefetch_ahead(t + kQ6KScales, kBytes - kQ6KScales, first_pass);
    __m512i sum[kRows];
    for (int64_t r = 0; r < kRows; ++r) sum[r] = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      for (int half = 0; half < 2; ++half) {
        // the 16s of values 128h + 16 half + 32 k, k = 0..3 (A, C, B, D)
        __m512i acc[kRows][4];
        for (int64_t r = 0; r < kRows; ++r) {
          const int16_t* sums = x[r * stride + s].sums + 8 * h + half;
          for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_set1_epi32(-32 * sums[2 * k]);
        }
        for (int m = 4 * half; m < 4 * half + 4; ++m) {
          const uint8_t* vectors = t + 192 * (8 * h + m);
          prefetch_ahead(vectors, 192, first_pass);
          const __m512i pairs = load_vector(vectors);
          const __m512i low = load_vector(vectors + 64), low8 = load_vector(vectors + 128);
          // values 128h + 4m (+ 32, + 64, + 96): the low nibbles of low,
          // low8, then their high ones, with pairs' bits 0-1, 2-3, 4-5, 6-7
#if defined(__GFNI__)
          // each as one gf2p8affine (pair k moved to bits 4-5, the rest 0)
          // and one vpternlog ((nibble & 0xf) | pair): 10 operations where
          // shifts, ands and ors take 17, and a Q6_K product read from
          // memory takes ~8% less time
          auto pair = [&](int k) {
            const __m512i to_bits_4_5 = _mm512_set1_epi64(static_cast<long long>(
                (uint64_t{1} << (2 * k)) << 24 | (uint64_t{1} << (2 * k + 1)) << 16));
            return _mm512_gf2p8affine_epi64_epi8(pairs, to_bits_4_5, 0);
          };
          auto with = [&](__m512i nibbles, __m512i top) {
            return _mm512_ternarylogic_epi32(nibbles, top, low4, 0xEC);  // (a & c) | b
          };
          const __m512i level[4] = {with(low, pair(0)), with(low8, pair(1)),
                                    with(_mm512_srli_epi16(low, 4), pair(2)),
                                    with(_mm512_srli_epi16(low8, 4), pair(3))};
#else
          const __m512i top2 = _mm512_set1_epi8(0x30);
          const __m512i level[4] = {
              _mm512_or_si512(_mm512_and_si512(low, low4), _mm512_and_si512(_mm512_slli_epi16(pairs, 4), top2)),
              _mm512_or_si512(_mm512_and_si512(low8, low4), _mm512_and_si512(_mm512_slli_epi16(pairs, 2), top2)),
              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low, 4), low4), _mm512_and_si512(pairs, top2)),
              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low8, 4), low4),
                              _mm512_and_si512(_mm512_srli_epi16(pairs, 2), top2))};
#endif
          for (int64_t r = 0; r < kRows; ++r) {
            const int8_t* q = x[r * stride + s].q + 128 * h + 4 * m;
            for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_dpbusd_epi32(acc[r][k], level[k], four_of(q + 32 * k));
          }
        }
        for (int k = 0; k < 4; ++k) {
          const int g = 8 * h + 2 * k + half;
          const __m512i scale = _mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(t + kQ6KScales + 16 * g)));
          for (int64_t r = 0; r < kRows; ++r) {
            sum[r] = _mm512_add_epi32(sum[r], _mm512_mullo_epi32(acc[r][k], scale));
          }
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + kQ6KD)));
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512 dx = _mm512_set1_ps(x[r * stride + s].d);
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_mul_ps(d, dx), total[r]);
    }
  }
}

// A super-block's weights in fp32 as GGML computes them ((d sc) q - dmin m,
// or (d sc) (q - 32)), rounded to bf16.
template <int64_t kType>
void dequantize_block(const uint8_t* block, c10::BFloat16* out) {
  alignas(64) uint8_t levels[kSuper];
  {
    __m512i vectors[4];
    unpack_levels<kType>(block, vectors);
    for (int c = 0; c < 4; ++c) _mm512_store_si512(levels + 64 * c, vectors[c]);
  }
  float scale[kSuper / 16], min[kSuper / 16] = {};  // per 16 values
  if constexpr (kType == kQ6K) {
    const float d = half_at(block + 208);
    for (int g = 0; g < 16; ++g) scale[g] = d * static_cast<float>(reinterpret_cast<const int8_t*>(block + 192)[g]);
  } else {
    uint8_t scales_mins[16];
    unpack_scales(block + 4, scales_mins);
    const float d = half_at(block), dmin = half_at(block + 2);
    for (int g = 0; g < 16; ++g) {
      scale[g] = d * static_cast<float>(scales_mins[g / 2]);
      min[g] = dmin * static_cast<float>(scales_mins[8 + g / 2]);
    }
  }
  const __m512i offset = _mm512_set1_epi32(kType == kQ6K ? 32 : 0);
  for (int g = 0; g < 16; ++g) {
    const __m512i q = _mm512_sub_epi32(
        _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(levels + 16 * g))), offset);
    // one rounding, as GGML's: Q4_K/Q5_K's product is exact (d sc has 17
    // bits, q 5), Q6_K subtracts nothing
    const __m512 w = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(scale[g]), _mm512_cvtepi32_ps(q)),
                                   _mm512_set1_ps(min[g]));
    store(out + 16 * g, (vfloat)w);
  }
}
#else
// The portable way: the same int32 sums, per sub-block, in plain loops.
template <int64_t kRows, int64_t kType>
void row_product(const uint8_t* w, int64_t supers, const Q8KBlock* x, int64_t stride,
                 float* dots) {
  constexpr int64_t kBytes = kType == kQ4K ? kQ4KBytes : kType == kQ5K ? kQ5KBytes : kQ6KBytes;
  float total[kRows] = {};
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* block = w + s * kBytes;
    uint8_t levels[kSuper];
    int32_t scales[kSuper / 16];  // per 16 values
    int32_t mins[8] = {};
    float d, dmin = 0.0f;
    if constexpr (kType == kQ4K || kType == kQ5K) {
      const uint8_t* nibbles = block + (kType == kQ4K ? 16 : 48);
      uint8_t scales_mins[16];
      unpack_scales(block + 4, scales_mins);
      for (int c = 0; c < 4; ++c) {
        for (int i = 0; i < 32; ++i) {
          levels[64 * c + i] = nibbles[32 * c + i] & 0x0f;
          levels[64 * c + 32 + i] = nibbles[32 * c + i] >> 4;
        }
      }
      if constexpr (kType == kQ5K) {
        for (int i = 0; i < kSuper; ++i) levels[i] |= ((block[16 + i % 32] >> (i / 32)) & 1) << 4;
      }
      for (int g = 0; g < 16; ++g) scales[g] = scales_mins[g / 2];
      for (int sub = 0; sub < 8; ++sub) mins[sub] = scales_mins[8 + sub];
      d = half_at(block);
      dmin = half_at(block + 2);
    } else {
      for (int i = 0; i < kSuper; ++i) {
        const int h = i / 128, j = i % 128;
        const uint8_t nibble = block[64 * h + j % 64] >> (4 * (j / 64)) & 0x0f;
        const uint8_t pair = block[128 + 32 * h + j % 32] >> (2 * (j / 32)) & 0x03;
        levels[i] = nibble | pair << 4;
      }
      for (int g = 0; g < 16; ++g) scales[g] = reinterpret_cast<const int8_t*>(block + 192)[g];
      d = half_at(block + 208);
    }
    for (int64_t r = 0; r < kRows; ++r) {
      const Q8KBlock& xb = x[r * stride + s];
      int32_t sum = 0, min_sum = 0;
      for (int g = 0; g < 16; ++g) {
        int32_t dot = 0;
        for (int i = 0; i < 16; ++i) dot += levels[16 * g + i] * xb.q[16 * g + i];
        if constexpr (kType == kQ6K) dot -= 32 * xb.sums[g];
        sum += scales[g] * dot;
        min_sum += mins[g / 2] * xb.sums[g];
      }
      total[r] += d * xb.d * static_cast<float>(sum);
      total[r] -= dmin * xb.d * static_cast<float>(min_sum);
    }
  }
  for (int64_t r = 0; r < kRows; ++r) dots[r] = total[r];
}

template <int64_t kType>
void dequantize_block(const uint8_t* block, c10::BFloat16* out) {
  float values[kSuper];
  if constexpr (kType == kQ6K) {
    const float d = half_at(block + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
    for (int i = 0; i < kSuper; ++i) {
      const int h = i / 128, j = i % 128;
      const int nibble = block[64 * h + j % 64] >> (4 * (j / 64)) & 0x0f;
      const int pair = block[128 + 32 * h + j % 32] >> (2 * (j / 32)) & 0x03;
      values[i] = d * static_cast<float>(scales[i / 16]) * static_cast<float>((nibble | pair << 4) - 32);
    }
  } else {
    const uint8_t* nibbles = block + (kType == kQ4K ? 16 : 48);
    uint8_t scales_mins[16];
    unpack_scales(block + 4, scales_mins);
    const float d = half_at(block), dmin = half_at(block + 2);
    for (int i = 0; i < kSuper; ++i) {
      const int sub = i / 32, c = i / 64;
      int q = nibbles[32 * c + i % 32] >> (4 * (sub % 2)) & 0x0f;
      if constexpr (kType == kQ5K) q |= ((block[16 + i % 32] >> sub) & 1) << 4;
      values[i] = d * static_cast<float>(scales_mins[sub]) * static_cast<float>(q) -
                  dmin * static_cast<float>(scales_mins[8 + sub]);
    }
  }
  for (int64_t i = 0; i < kSuper; i += kLanes) store(out + i, load(values + i));
}
#endif

int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4K: return kQ4KBytes;
    case kQ5K: return kQ5KBytes;
    case kQ6K: return kQ6KBytes;
    default:
      TORCH_CHECK(false, "kquant: type ", type, " is not one of Q4_K (12), Q5_K (13), Q6_K (14)");
  }
}

// Each byte's place in a tile's super-block, output by output (tile_offset).
std::vector<int64_t> tile_offsets(int64_t type) {
  const int64_t bytes = block_bytes(type);
  std::vector<int64_t> offsets(kTile * bytes);
  for (int64_t o = 0; o < kTile; ++o) {
    for (int64_t b = 0; b < bytes; ++b) offsets[o * bytes + b] = tile_offset(type, o, b);
  }
  return offsets;
}

// f(offset in the tile, offset in the blocks) for every byte of a tile's
// first `count` outputs: the tile as supers super-blocks of 16 x bytes, the
// blocks as count rows of supers x bytes.
template <typename F>
void for_tile_bytes(int64_t type, int64_t supers, int64_t count,
                    const std::vector<int64_t>& offsets, F&& f) {
  const int64_t bytes = block_bytes(type);
  for (int64_t o = 0; o < count; ++o) {
    for (int64_t s = 0; s < supers; ++s) {
      for (int64_t b = 0; b < bytes; ++b) {
        f(s * kTile * bytes + offsets[o * bytes + b], (o * supers + s) * bytes + b);
      }
    }
  }
}

// Tile t's outputs back as blocks: `count` rows of supers x bytes at out.
void untile(const uint8_t* tile, int64_t type, int64_t supers, int64_t count,
            const std::vector<int64_t>& offsets, uint8_t* out) {
  for_tile_bytes(type, supers, count, offsets,
                 [&](int64_t in_tile, int64_t in_blocks) { out[in_blocks] = tile[in_tile]; });
}

// A tile's 16 outputs of one row (the first `count`) into y, fp32 or bf16
// (rounded to nearest even, as torch rounds fp32 to bf16).
inline void store_outputs(float* y, const float* values, int64_t count) {
  std::memcpy(y, values, count * sizeof(float));
}

inline void store_outputs(c10::BFloat16* y, const float* values, int64_t count) {
  if (count == kTile) {
    store(y, load(values));
  } else {
    for (int64_t i = 0; i < count; ++i) y[i] = c10::BFloat16(values[i]);
  }
}

template <int64_t kType, typename out_t>
void product(const at::Tensor& xq, const at::Tensor& tiles, int64_t out, out_t* y,
             int64_t y_stride) {
  const int64_t rows = xq.size(0), count = tiles.size(0);
  const int64_t supers = xq.size(1) / static_cast<int64_t>(sizeof(Q8KBlock));
  const auto* x = reinterpret_cast<const Q8KBlock*>(xq.data_ptr<uint8_t>());
  const uint8_t* w = tiles.data_ptr<uint8_t>();
  const int64_t tile_bytes = tiles.size(1);
  // ~16 KB of weights per claim, so that two threads split even a short product
  const int64_t grain = std::max<int64_t>(1, (16 << 10) / tile_bytes);
#if defined(KQUANT_VNNI)
  at::parallel_for(0, count, grain, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t outputs = std::min<int64_t>(kTile, out - kTile * t);
      for (int64_t row0 = 0; row0 < rows; row0 += 4) {
        with_count<4>(std::min<int64_t>(4, rows - row0), [&](auto n) {
          constexpr int64_t kRows = decltype(n)::value;
          __m512 total[kRows];
          if constexpr (kType == kQ6K) {
            tile_product_q6<kRows>(w + t * tile_bytes, supers, x + row0 * supers, supers, total,
                                   row0 == 0);
          } else {
            tile_product<kRows, kType>(w + t * tile_bytes, supers, x + row0 * supers, supers, total,
                                       row0 == 0);
          }
          for (int64_t r = 0; r < kRows; ++r) {
            alignas(64) float values[kTile];
            _mm512_store_ps(values, total[r]);
            store_outputs(y + (row0 + r) * y_stride + kTile * t, values, outputs);
          }
        });
      }
    }
  });
#else
  const std::vector<int64_t> offsets = tile_offsets(kType);
  const int64_t row_bytes = supers * block_bytes(kType);
  at::parallel_for(0, count, grain, [&](int64_t first, int64_t last) {
    std::vector<uint8_t> blocks(kTile * row_bytes);
    for (int64_t t = first; t < last; ++t) {
      const int64_t outputs = std::min<int64_t>(kTile, out - kTile * t);
      untile(w + t * tile_bytes, kType, supers, outputs, offsets, blocks.data());
      for (int64_t o = 0; o < outputs; ++o) {
        for (int64_t row0 = 0; row0 < rows; row0 += 8) {
          with_rows(std::min<int64_t>(8, rows - row0), [&](auto n) {
            constexpr int64_t kRows = decltype(n)::value;
            float dots[kRows];
            row_product<kRows, kType>(blocks.data() + o * row_bytes, supers, x + row0 * supers,
                                      supers, dots);
            for (int64_t r = 0; r < kRows; ++r) {
              y[(row0 + r) * y_stride + kTile * t + o] = static_cast<out_t>(dots[r]);
            }
          });
        }
      }
    }
  });
#endif
}

// A GGUF tensor's blocks [out, supers x bytes] as tiles [ceil(out / 16),
// supers x 16 x bytes].
at::Tensor kquant_tiles(const at::Tensor& blocks, int64_t type) {
  const int64_t bytes = block_bytes(type);
  TORCH_CHECK(blocks.dim() == 2 && blocks.is_contiguous() && blocks.scalar_type() == at::kByte &&
                  blocks.size(1) % bytes == 0,
              "kquant_tiles: blocks must be contiguous uint8 [out, in / 256 * ", bytes, "]");
  const int64_t out = blocks.size(0), supers = blocks.size(1) / bytes;
  const int64_t count = (out + kTile - 1) / kTile;
  at::Tensor tiles = at::zeros({count, supers * kTile * bytes}, blocks.options());
  const std::vector<int64_t> offsets = tile_offsets(type);
  const uint8_t* from = blocks.data_ptr<uint8_t>();
  uint8_t* to = tiles.data_ptr<uint8_t>();
  at::parallel_for(0, count, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      uint8_t* tile = to + t * tiles.size(1);
      const uint8_t* rows = from + kTile * t * supers * bytes;
      for_tile_bytes(type, supers, std::min<int64_t>(kTile, out - kTile * t), offsets,
                     [&](int64_t in_tile, int64_t in_blocks) { tile[in_tile] = rows[in_blocks]; });
    }
  });
  return tiles;
}

void check_tiles(const char* name, const at::Tensor& tiles, int64_t type, int64_t out) {
  const int64_t bytes = block_bytes(type);
  TORCH_CHECK(tiles.dim() == 2 && tiles.is_contiguous() && tiles.scalar_type() == at::kByte &&
                  tiles.size(1) % (kTile * bytes) == 0 && out > kTile * (tiles.size(0) - 1) &&
                  out <= kTile * tiles.size(0),
              name, ": tiles must be kquant_tiles' contiguous uint8 [ceil(out / 16), in / 256 * 16 * ",
              bytes, "] for out = ", out, ", got ", tiles.sizes());
}

// kquant_tiles' blocks back: [out, supers x bytes].
at::Tensor kquant_untile(const at::Tensor& tiles, int64_t type, int64_t out) {
  check_tiles("kquant_untile", tiles, type, out);
  const int64_t bytes = block_bytes(type), supers = tiles.size(1) / (kTile * bytes);
  at::Tensor blocks = at::empty({out, supers * bytes}, tiles.options());
  const std::vector<int64_t> offsets = tile_offsets(type);
  at::parallel_for(0, tiles.size(0), 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      untile(tiles.data_ptr<uint8_t>() + t * tiles.size(1), type, supers,
             std::min<int64_t>(kTile, out - kTile * t), offsets,
             blocks.data_ptr<uint8_t>() + kTile * t * supers * bytes);
    }
  });
  return blocks;
}

at::Tensor kquant_quantize_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "kquant_quantize_x: x must be contiguous fp32 or bf16 [rows, in]");
  TORCH_CHECK(x.size(1) % kSuper == 0, "kquant_quantize_x: in must be a multiple of ", kSuper,
              ", got ", x.size(1));
  const int64_t rows = x.size(0), in = x.size(1), supers = in / kSuper;
  at::Tensor xq = at::empty({rows, supers * static_cast<int64_t>(sizeof(Q8KBlock))},
                            x.options().dtype(at::kByte));
  auto* out = reinterpret_cast<Q8KBlock*>(xq.data_ptr<uint8_t>());
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      if (x.scalar_type() == at::kFloat) {
        quantize_row(x.data_ptr<float>() + r * in, in, out + r * supers);
      } else {
        quantize_row(x.data_ptr<c10::BFloat16>() + r * in, in, out + r * supers);
      }
    }
  });
  return xq;
}

// y[:, column : column + out] = x @ W.T, x as kquant_quantize_x gives it,
// W as kquant_tiles gives it; y fp32, or bf16 (each output rounded once, to
// the bits its fp32 value's cast gives).
void kquant_gemv(const at::Tensor& xq, const at::Tensor& tiles, int64_t type, int64_t out,
                 at::Tensor& y, int64_t column) {
  const int64_t bytes = block_bytes(type);
  TORCH_CHECK(xq.dim() == 2 && xq.is_contiguous() && xq.scalar_type() == at::kByte &&
                  xq.size(1) % static_cast<int64_t>(sizeof(Q8KBlock)) == 0,
              "kquant_gemv: xq must be kquant_quantize_x's uint8 [rows, in / 256 * 292]");
  const int64_t supers = xq.size(1) / static_cast<int64_t>(sizeof(Q8KBlock));
  check_tiles("kquant_gemv", tiles, type, out);
  TORCH_CHECK(tiles.size(1) == supers * kTile * bytes, "kquant_gemv: tiles of ",
              tiles.size(1) / (kTile * bytes), " super-blocks a row for x of ", supers);
  TORCH_CHECK(y.dim() == 2 && (y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16) &&
                  y.stride(1) == 1 && y.size(0) == xq.size(0) && column >= 0 &&
                  column + out <= y.size(1),
              "kquant_gemv: y must be fp32 or bf16 [rows, >= column + out] with unit column "
              "stride");
  auto into = [&](auto* to) {
    switch (type) {
      case kQ4K: product<kQ4K>(xq, tiles, out, to + column, y.stride(0)); break;
      case kQ5K: product<kQ5K>(xq, tiles, out, to + column, y.stride(0)); break;
      default: product<kQ6K>(xq, tiles, out, to + column, y.stride(0)); break;
    }
  };
  if (y.scalar_type() == at::kFloat) {
    into(y.data_ptr<float>());
  } else {
    into(y.data_ptr<c10::BFloat16>());
  }
}

// The weights of `out` outputs' tiles as bf16 [out, in] (dequantize_block).
at::Tensor kquant_dequantize(const at::Tensor& tiles, int64_t type, int64_t out) {
  check_tiles("kquant_dequantize", tiles, type, out);
  const int64_t bytes = block_bytes(type), supers = tiles.size(1) / (kTile * bytes);
  const int64_t in = supers * kSuper;
  at::Tensor w = at::empty({out, in}, tiles.options().dtype(at::kBFloat16));
  c10::BFloat16* dense = w.data_ptr<c10::BFloat16>();
  const std::vector<int64_t> offsets = tile_offsets(type);
  at::parallel_for(0, tiles.size(0), 1, [&](int64_t first, int64_t last) {
    std::vector<uint8_t> blocks(kTile * supers * bytes);
    for (int64_t t = first; t < last; ++t) {
      const int64_t outputs = std::min<int64_t>(kTile, out - kTile * t);
      untile(tiles.data_ptr<uint8_t>() + t * tiles.size(1), type, supers, outputs, offsets,
             blocks.data());
      for (int64_t at = 0; at < outputs * supers; ++at) {
        c10::BFloat16* to = dense + (kTile * t * supers + at) * kSuper;
        switch (type) {
          case kQ4K: dequantize_block<kQ4K>(blocks.data() + at * bytes, to); break;
          case kQ5K: dequantize_block<kQ5K>(blocks.data() + at * bytes, to); break;
          default: dequantize_block<kQ6K>(blocks.data() + at * bytes, to); break;
        }
      }
    }
  });
  return w;
}

bool has_kquant_vnni() {
#if defined(KQUANT_VNNI)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpage_cpu, m) {
  m.def("kquant_quantize_x(Tensor x) -> Tensor");
  m.def("kquant_tiles(Tensor blocks, int type) -> Tensor");
  m.def("kquant_untile(Tensor tiles, int type, int out) -> Tensor");
  m.def("kquant_gemv(Tensor xq, Tensor tiles, int type, int out, Tensor(a!) y, int column) -> ()");
  m.def("kquant_dequantize(Tensor tiles, int type, int out) -> Tensor");
  m.def("has_kquant_vnni() -> bool");
}

TORCH_LIBRARY_IMPL(specpage_cpu, CPU, m) {
  m.impl("kquant_quantize_x", &kquant_quantize_x);
  m.impl("kquant_tiles", &kquant_tiles);
  m.impl("kquant_untile", &kquant_untile);
  m.impl("kquant_gemv", &kquant_gemv);
  m.impl("kquant_dequantize", &kquant_dequantize);
}

TORCH_LIBRARY_IMPL(specpage_cpu, CompositeExplicitAutograd, m) {
  m.impl("has_kquant_vnni", &has_kquant_vnni);
}
