// 4-bit weight-streaming linear (W4A16) for decode-sized batches (M = 1..64 rows):
//   y[m, n] = sum_k x[m, k] * (scale[n, g(k)] * q[n, k] + offset[n, g(k)]) + bias[n]
// with q in 0..15 and groups g of G consecutive columns, G a power of two and a multiple of 2W
// (32, 64, 128, 256 on AVX-512; also 16 on AVX2); K a multiple of 2W; the last group may be
// shorter (SmolLM2's K = 576 in groups of 128: four of 128 and one of 64, as GPTQ checkpoints
// do). G is not passed: it is the power of two that ceil(K / G) = groups pins (for 2+ groups it is
// unique). One formula covers every 4-bit format: symmetric int4 (q - 8: offset = -8 scale,
// passed as no offset), a minimum (GGUF Q4_1: w = d q + m, offset = m), a zero point
// (w = s (q - z): offset = -s z).
//
// As in linear_stream.cpp (read its top for the reasons), the time at decode is the time to stream
// the weights, and the layout is made for that: tiles of C = 4 output channels, each one contiguous
// run; inside a tile, for each step of 2W columns (W = 16 floats per vector with AVX-512, 8 with
// AVX2), the C channels' W bytes side by side, byte j holding column j in its low nibble and
// column W + j in its high nibble (on AVX-512 the 16 bytes of a step are exactly a GGUF Q4_0/Q4_1
// block's quants). Scales and offsets (float16, as GGUF stores them) are in the same tile-major
// order, [groups, C] per tile, so a thread reads three sequential streams.
//
// From a few rows both the float and the int8-activation paths take packed panels (see "From 8 rows"
// below: codes of two tiles transposed once per 64 rows, (channel, block) in the lanes; int8
// activations from 9-24 rows by ISA and group size, a8_panel_min_rows); with
// AVX-512 (VBMI), float activations take panels.h's instead (channels in the lanes, as W8A16's),
// from 8 rows where K < 2048 and from 20 where K is larger (float_panel_min_rows). Below that:
// each byte vector becomes two vectors of dequantized float weights, which every row then
// multiplies: with AVX-512, the 16 values scale * q + offset of a channel's group sit in one
// register and a permute looks the codes up in it (a zero extension, a shift and two permutes per
// 32 weights); with AVX2, codes are converted and scaled with one FMA each. One row: the codes are
// converted to floats (a zero extension, an AND, a shift, two conversions), the row's partial sums
// per group are scaled into the accumulators once per group, and the offsets enter as
// offset * sum_g(x), with the row's group sums of x computed once per call: fewer operations per
// weight where a group's table would serve one row only. With AVX2 and AVX-512 a row left over by
// the row tiles (1 row, and odd counts on AVX2; 4k + 1 rows on AVX-512, where 2 or 3 rows left take
// one narrower tile) takes tile_row_digits instead: each group of a row as exact 24-bit integers in three
// signed bytes, codes times bytes as W4A8 multiplies them, exact int32 sums (see there). The float
// paths, measured in cache, one thread, 512 x 2048 (Zen 4): 4 rows 18 -> 24 GMAC/s (groups of 32) and 27 -> 32 (128) with the tables; one row 16 and
// 21 GMAC/s with the folded sums against 14 and 21 with the tables.
#include <torch/extension.h>
#include <omp.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "panels.h"
#include "simd.h"
#include "tiles.h"

namespace {

constexpr int kChannels = 4;
#if defined(__AVX512F__)
constexpr int kRows = 4;  // 16 accumulators + 4 tables + 8 activation vectors + 2 weight vectors of 32 registers
#else
constexpr int kRows = 2;  // 8 accumulators + 4 activation vectors + 2 weight vectors of 16 registers
#endif
constexpr int64_t kStepCols = 2 * kWidth;  // columns per step: one byte vector, two float vectors
constexpr int64_t kAheadBytes = 4096;

// One channel's group: what turns its codes into weights.
struct Dequant {
#if defined(__AVX512F__)
  Vec table;  // lane q: scale * q + offset
  Dequant() = default;
  explicit Dequant(float scale, float offset)
      : table(_mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                              _mm512_set1_ps(scale), _mm512_set1_ps(offset))) {}
#else
  Vec scale, offset;
  Dequant() = default;
  explicit Dequant(float s, float o) : scale(vset1(s)), offset(vset1(o)) {}
#endif
};

// W bytes -> the weights of columns j (low nibbles) and W + j (high nibbles).
inline void dequant(const uint8_t* p, const Dequant& d, Vec& lo, Vec& hi) {
#if defined(__AVX512F__)
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_permutexvar_ps(v, d.table);  // the permute reads index bits 3:0: the low nibble
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), d.table);
#elif defined(__AVX2__)
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15))), d.scale, d.offset);
  hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d.scale, d.offset);
#else
  lo = static_cast<float>(*p & 15) * d.scale + d.offset;
  hi = static_cast<float>(*p >> 4) * d.scale + d.offset;
#endif
}

// The C channels' float16 values of one group (contiguous in the tile-major layout) as floats: one
// F16C conversion for a full tile (c10::Half's own conversion is a software routine of a dozen
// instructions, which at groups of 32 cost more than the weights' arithmetic).
template <int C>
inline void halves_to_floats(const at::Half* p, float* out) {
#if defined(__F16C__)
  if constexpr (C == 4) {
    _mm_storeu_ps(out, _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    return;
  }
#endif
  for (int c = 0; c < C; ++c) out[c] = static_cast<float>(p[c]);
}

// GGUF Q4_K's two scale levels, held as the file has them (int8 activations only): sub-block j of
// 32 weights is w = d sc_j q - dmin m_j, with 6-bit sc_j and m_j and a float16 d and dmin per
// super-block of kLevelGroups = 8 sub-blocks. Per tile and super-block, kLevelBytes bytes: d [C]
// and dmin [C] float16, then for each sub-block j its sc_j [C] and m_j [C] uint8, side by side so
// that one load, widening, conversion and multiplication serves both (int4_linear.py's pack_levels
// writes them): 4.625 bits per weight with the codes, against 5.0 for a float16 scale and minimum
// per 32, and d sc_j exact in float32 where one float16 rounds it (relative 2^-12).
constexpr int64_t kLevelGroups = 8, kLevelBytes = kChannels * (2 + 2 + 2 * kLevelGroups);

struct Operands {
  const at::Half* scale;   // tile-major [N, groups], or null: levels
  const at::Half* offset;  // tile-major [N, groups], or null: symmetric, offset = -8 * scale (or levels)
  const float* xsum;       // [M, groups]: each row's sum of x over each group (the one-row path)
  const int8_t* xp;        // [K / 32, 3, 32]: the one row's digits (digit_row), or null
  const float* xd;         // [groups]: their scale per group
  const float* bias;       // [N] or null
  int64_t groups, steps;   // groups per row; column steps per (full) group
  int64_t total_steps;     // column steps per row (the last group may have fewer than `steps`)
  const uint8_t* levels = nullptr;  // Q4_K's two levels instead of scale and offset: [N / 4, groups / 8, kLevelBytes]
};

// The tile at channel n's levels (full tiles: st = n x groups).
inline const uint8_t* tile_levels(const Operands& o, int64_t st) {
  return o.levels + st / kLevelGroups * (kLevelBytes / kChannels);
}

// W bytes -> the codes of columns j and W + j as floats.
inline void codes(const uint8_t* p, Vec& lo, Vec& hi) {
#if defined(__AVX512F__)
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
#elif defined(__AVX2__)
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
#else
  lo = static_cast<float>(*p & 15);
  hi = static_cast<float>(*p >> 4);
#endif
}

// The C channels' scales and offsets of group grp (symmetric: offset = -8 * scale).
template <int C>
inline void group_params(const Operands& o, int64_t st, int64_t grp, float* sc, float* of) {
  halves_to_floats<C>(o.scale + st + grp * C, sc);
  if (o.offset) halves_to_floats<C>(o.offset + st + grp * C, of);
  else
    for (int c = 0; c < C; ++c) of[c] = -8.f * sc[c];
}

// One row (row m of the call) x C channels: partial sums per group, folded by the group's scale.
template <int C>
inline void tile_row(const float* x, const uint8_t* wt, int64_t st, int64_t n, int64_t m, float* y,
                     const Operands& o) {
  Vec acc[C];
  float off[C] = {};
  for (int c = 0; c < C; ++c) acc[c] = vzero();
  const uint8_t* p = wt;
  int64_t s = 0;
  for (int64_t grp = 0; grp < o.groups; ++grp) {
    float sc[C], of[C];
    group_params<C>(o, st, grp, sc, of);
    const float xs = o.xsum[m * o.groups + grp];
    for (int c = 0; c < C; ++c) off[c] += of[c] * xs;
    Vec part[C];
    for (int c = 0; c < C; ++c) part[c] = vzero();
    const int64_t end = std::min(s + o.steps, o.total_steps);
    for (; s < end; ++s, p += C * kWidth) {
#if defined(__AVX2__)
      _mm_prefetch(reinterpret_cast<const char*>(p) + kAheadBytes, _MM_HINT_T0);
#endif
      const Vec xlo = vload(x + s * kStepCols), xhi = vload(x + s * kStepCols + kWidth);
      for (int c = 0; c < C; ++c) {
        Vec lo, hi;
        codes(p + c * kWidth, lo, hi);
        part[c] = vfma(xhi, hi, vfma(xlo, lo, part[c]));
      }
    }
    for (int c = 0; c < C; ++c) acc[c] = vfma(part[c], vset1(sc[c]), acc[c]);
  }
  for (int c = 0; c < C; ++c) y[n + c] = vsum(acc[c]) + off[c] + (o.bias ? o.bias[n + c] : 0.f);
}

constexpr int kLanes = kWidth >= kChannels ? static_cast<int>(kWidth) / kChannels : 1;  // int32 (and float) lanes per channel

#if defined(__AVX2__)
// 4 channels' values, each spread over its kLanes lanes: [a0 a0 a0 a0 a1 a1 a1 a1 ...] (AVX-512)
inline Vec spread4(__m128 v) {
#if defined(__AVX512F__)
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), _mm512_castps128_ps512(v));
#else
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
#endif
}

// The levels' scales and offsets of a tile's groups in turn, spread as spread4 spreads 4 values:
// next() gives group grp's (called for grp = 0, 1, ...). A sub-block's sc_j and m_j (8 bytes) are
// widened, converted and multiplied by (d, -dmin) in one 256-bit vector, then each half spread.
// A super-block's d [4] and -dmin [4] (its first 16 bytes) in one vector.
inline __m256 level_scales(const uint8_t* p) {
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                       _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1));
}

struct LevelParams {
  const uint8_t* p;
  __m256 dm;  // the super-block's d [4] and -dmin [4]
  int64_t j = 0;
  explicit LevelParams(const uint8_t* levels) : p(levels) {}
  void next(Vec& scv, Vec& ofv) {
    if (j == 0) dm = level_scales(p);
    const __m256 v = _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                           _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 4 * kChannels + 8 * j)))));
#if defined(__AVX512F__)
    scv = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), _mm512_castps256_ps512(v));
    ofv = _mm512_permutexvar_ps(_mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7), _mm512_castps256_ps512(v));
#else
    scv = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    ofv = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
#endif
    if (++j == kLevelGroups) j = 0, p += kLevelBytes;
  }
};
#endif

// Integer vectors of the weights' bytes (one step of a tile per vector) and the activations broadcast
// to every channel's lane group: the W4A8 paths below and the one-row split use them.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define FIVEFOLD_A8 1
using IVec = __m512i;
constexpr int64_t kStepsPerBlock = 1;
inline IVec wload(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline IVec lo_nibbles(IVec v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
inline IVec hi_nibbles(IVec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
inline IVec xbroadcast(const int8_t* p) {  // W = 16 bytes into each channel's 128-bit lane
  return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Vec to_float(IVec v) { return _mm512_cvtepi32_ps(v); }
#elif defined(__AVX2__)
#define FIVEFOLD_A8 1
using IVec = __m256i;
constexpr int64_t kStepsPerBlock = 2;
inline IVec wload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline IVec lo_nibbles(IVec v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline IVec hi_nibbles(IVec v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
inline IVec xbroadcast(const int8_t* p) {  // W = 8 bytes into each channel's 64-bit lane
  int64_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi64x(v);
}
inline Vec to_float(IVec v) { return _mm256_cvtepi32_ps(v); }
#endif

#if defined(FIVEFOLD_A8)
#define FIVEFOLD_W4_SPLIT 1
// One row of float activations as exact integers (see "One row" below, after the W4A8 blocks it
// shares); o.xp and o.xd hold that row's digits.
inline void tile_row_digits(const uint8_t* wt, int64_t st, int64_t n, int64_t m, float* y, const Operands& o);
#endif

// R rows x C channels starting at channel n; wt: the tile's weights, st: the tile's scales and
// offsets (index g * C + c).
template <int R, int C>
inline void tile(const float* x, int64_t K, const uint8_t* wt, int64_t st, int64_t n, float* y, int64_t N,
                 const Operands& o) {
  Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  // One loop over the column steps, the group's tables refreshed where a group starts. Nested (a
  // loop over groups around one over their steps), GCC kept the accumulators in registers but
  // stored all R x C of them to the stack on every step. W4A16 on 6144 x 4096 in groups of 128, best of 7:
  // Zen 4 at 4 rows 142 -> 191 GFLOP/s, 6 rows 139 -> 161; AVX2 forced, 2-6 rows 1.04-1.05x.
  const uint8_t* p = wt;
  Dequant d[C];
  for (int64_t s = 0, grp = 0, next = 0; s < o.total_steps; ++s, p += C * kWidth) {
    if (s == next) {
      float sc[C], of[C];
      group_params<C>(o, st, grp, sc, of);
      for (int c = 0; c < C; ++c) d[c] = Dequant(sc[c], of[c]);
      ++grp;
      next += o.steps;
    }
#if defined(__AVX2__)
    _mm_prefetch(reinterpret_cast<const char*>(p) + kAheadBytes, _MM_HINT_T0);
#endif
    Vec xlo[R], xhi[R];
    for (int r = 0; r < R; ++r) {
      xlo[r] = vload(x + r * K + s * kStepCols);
      xhi[r] = vload(x + r * K + s * kStepCols + kWidth);
    }
    for (int c = 0; c < C; ++c) {
      Vec lo, hi;
      dequant(p + c * kWidth, d[c], lo, hi);
      for (int r = 0; r < R; ++r) acc[r][c] = vfma(xhi[r], hi, vfma(xlo[r], lo, acc[r][c]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * N + n + c] = vsum(acc[r][c]) + (o.bias ? o.bias[n + c] : 0.f);
}

// All M rows against the C channels of the tile at n: groups of kRows rows, then the remainder.
template <int C>
inline void channels(const float* x, int64_t M, int64_t K, const uint8_t* wt, int64_t n, float* y, int64_t N,
                     const Operands& o) {
  const int64_t st = n * o.groups;
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) tile<kRows, C>(x + m * K, K, wt, st, n, y + m * N, N, o);
  // 2 or 3 rows left (AVX-512): one narrower tile. Against a split row each (below), best of 7 on
  // Zen 4: 2 and 3 rows 1.2-1.4x on 6144 x 4096, 1.05-1.25x on SmolLM2's matrices; 6-11 rows 1.1x.
  if constexpr (kRows > 3) {
    if (M - m == 3) {
      tile<3, C>(x + m * K, K, wt, st, n, y + m * N, N, o);
      m += 3;
    } else if (M - m == 2) {
      tile<2, C>(x + m * K, K, wt, st, n, y + m * N, N, o);
      m += 2;
    }
  }
  for (; m < M; ++m) {
#if defined(FIVEFOLD_W4_SPLIT)
    if constexpr (C == kChannels) {
      if (o.xp) {
        tile_row_digits(wt, st, n, m, y + m * N, o);
        continue;
      }
    }
#endif
    tile_row<C>(x + m * K, wt, st, n, m, y + m * N, o);
  }
}

// ---- W4A8: int8 activations, integer dot products ----
//
// Each row of x is quantized per block of kBlock = 32 columns (llama.cpp's Q8_0 block): d = amax /
// 127, xq = round(x / d). Then, with a group's weights w = s q + o and q in 0..15,
//   sum_k x w = sum_groups (s sum_blocks d_b sum_k q xq + o sum_blocks d_b sum_k xq)
// The q * xq products are summed exactly in int32: one block of one channel is at most 32 x 15 x
// 127 = 60960 in magnitude. With AVX-512 VNNI, vpdpbusd (unsigned bytes times signed bytes, four
// products into each int32 lane) takes the codes as they are; without VNNI, vpmaddubsw sums
// pairs of products into int16, which cannot saturate here: codes are at most 15, so a pair is at
// most 2 x 15 x 128 = 3840 in magnitude, and the four pairs summed before widening (vpmaddwd)
// at most 15360 < 32767. Each block's integer sum is converted to float once and scaled by d_b;
// each group's sum by s once; the offset term uses each row's group sums of the dequantized
// activations, computed once per call. The weights' layout is the W4A16 one: a tile's step of
// 2W columns is one byte vector (AVX-512: 64 bytes, 16 per channel; AVX2: 32, 8 per channel), its
// low nibbles columns j and high nibbles W + j of each channel, so the activations' matching W bytes
// are broadcast to every channel's lane group and the int32 accumulator holds kLanes lanes per
// channel, summed at the end. Per 32 weights and row: two multiply-adds of bytes, a conversion and
// an FMA, against eight FMAs (and the dequantization) on the float path.
constexpr int64_t kBlock = 32;

#if defined(FIVEFOLD_A8)
// One activation block's weights for the C channels of a tile: the codes of each step's low and
// high nibbles, unsigned bytes. A narrower last tile (C < 4) is copied into a zeroed full vector.
template <int C>
struct BlockCodes {
  IVec lo[kStepsPerBlock], hi[kStepsPerBlock];
  explicit BlockCodes(const uint8_t* p) {
    for (int64_t t = 0; t < kStepsPerBlock; ++t, p += C * kWidth) {
      IVec v;
      if constexpr (C == kChannels) {
        v = wload(p);
      } else {
        alignas(64) uint8_t buf[kChannels * kWidth] = {};
        std::memcpy(buf, p, C * kWidth);
        v = wload(buf);
      }
      lo[t] = lo_nibbles(v);
      hi[t] = hi_nibbles(v);
    }
  }
};

// init + the sum over the block of q * xq, kLanes int32 partial sums per channel (xq: the row's 32
// bytes; init: a starting value per lane, see tile_a8).
template <int C>
inline IVec block_dot(const BlockCodes<C>& b, const int8_t* xq, IVec init) {
#if defined(__AVX512F__)
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(init, b.lo[0], xbroadcast(xq)), b.hi[0], xbroadcast(xq + kWidth));
#else
  const __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16(b.lo[0], xbroadcast(xq)),
                                         _mm512_maddubs_epi16(b.hi[0], xbroadcast(xq + kWidth)));
  return _mm512_add_epi32(init, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
#else
  __m256i pairs = _mm256_maddubs_epi16(b.lo[0], xbroadcast(xq));
  pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(b.hi[0], xbroadcast(xq + kWidth)));
  pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(b.lo[1], xbroadcast(xq + 2 * kWidth)));
  pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(b.hi[1], xbroadcast(xq + 3 * kWidth)));
  return _mm256_add_epi32(init, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

#if defined(__AVX512F__)
inline IVec iset1(int32_t v) { return _mm512_set1_epi32(v); }
#else
inline IVec iset1(int32_t v) { return _mm256_set1_epi32(v); }
#endif

// ---- One row: float activations as exact integers ----
//
// The float path above spends 7 vector operations per channel and 2W weights (a zero extension,
// an AND, a shift, two conversions, two FMAs): on 2 cores it streams 4-bit weights at ~50-70% of
// DRAM's rate, compute-bound. Here each group of the row is scaled to 24-bit integers, x = d * v
// with |v| <= kDigitMax = 127 (2^16 + 2^8 + 1), just under 2^23 (d = amax / kDigitMax: the
// rounding error is at most amax * 2^-23.99, float32's own for the group's largest element), and v
// is written exactly as three signed bytes, v = 2^16 a + 2^8 b + c (c and b in [-128, 127], a in
// [-127, 127]). Each byte plane is then a W4A8 row with one scale per group: block_dot multiplies
// the codes (unsigned bytes, unpacked once per block for the three planes) by each plane's bytes
// and sums them exactly in int32 (vpdpbusd with VNNI; vpmaddubsw, whose int16 pair sums cannot
// saturate against codes of at most 15, and vpmaddwd otherwise). Once per group the three sums are
// converted and combined, 2^16 a + 2^8 b + c in two FMAs, and scaled by the group's scale times
// d; the offsets enter as on the float path (offset * sum of x, in float). Per block of 4 channels
// x 32 columns: 6 vpdpbusd and 3 unpacking operations with VNNI, where two 16-bit halves (the
// form this replaced) took 8 vpdpwssd and 6; with AVX2 33 operations instead of 44.
constexpr int64_t kDigitBlock = 3 * kBlock;  // a block's bytes in a row's digits: planes a, b, c
constexpr float kDigitMax = 8355711.f;       // 127 * (65536 + 256 + 1)

// Row x [K] (K a multiple of kBlock) -> xp [K / kBlock, 3, kBlock] bytes (each block's a, b and c
// planes in column order) and xd [groups]: each group's d.
inline void digit_row(const float* x, int64_t K, int64_t group_cols, int8_t* xp, float* xd) {
  for (int64_t g0 = 0, grp = 0; g0 < K; g0 += group_cols, ++grp) {
    const int64_t end = std::min(K, g0 + group_cols);
    float amax = 0.f;
    for (int64_t k = g0; k < end; ++k) amax = std::max(amax, std::fabs(x[k]));
    const float inv = amax > 0.f ? kDigitMax / amax : 0.f;
    xd[grp] = amax / kDigitMax;
    for (int64_t k = g0; k < end; ++k) {
      const int32_t v = static_cast<int32_t>(std::min(kDigitMax, std::max(-kDigitMax, std::nearbyint(x[k] * inv))));
      const int32_t c = static_cast<int8_t>(v & 255);  // the low byte, signed: v - c is a multiple of 256
      const int32_t v1 = (v - c) / 256;
      const int32_t b = static_cast<int8_t>(v1 & 255);
      int8_t* out = xp + (k / kBlock) * kDigitBlock + k % kBlock;
      out[0] = static_cast<int8_t>((v1 - b) / 256);
      out[kBlock] = static_cast<int8_t>(b);
      out[2 * kBlock] = static_cast<int8_t>(c);
    }
  }
}

inline void tile_row_digits(const uint8_t* wt, int64_t st, int64_t n, int64_t m, float* y, const Operands& o) {
  const int64_t blocks = o.total_steps / kStepsPerBlock, blocks_per_group = o.steps / kStepsPerBlock;
  Vec acc = vzero();
  __m128 off = _mm_setzero_ps();
  const uint8_t* p = wt;
  int64_t blk = 0;
  for (int64_t grp = 0; grp < o.groups; ++grp) {
    const __m128 sc = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(o.scale + st + grp * kChannels)));
    const __m128 of = o.offset ? _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(o.offset + st + grp * kChannels)))
                               : _mm_mul_ps(sc, _mm_set1_ps(-8.f));
    off = _mm_fmadd_ps(of, _mm_set1_ps(o.xsum[m * o.groups + grp]), off);
    IVec a = iset1(0), b = iset1(0), c = iset1(0);
    for (const int64_t end = std::min(blk + blocks_per_group, blocks); blk < end; ++blk, p += kChannels * kWidth * kStepsPerBlock) {
      _mm_prefetch(reinterpret_cast<const char*>(p) + kAheadBytes, _MM_HINT_T0);
      const BlockCodes<kChannels> codes(p);
      const int8_t* xb = o.xp + blk * kDigitBlock;
      a = block_dot(codes, xb, a);
      b = block_dot(codes, xb + kBlock, b);
      c = block_dot(codes, xb + 2 * kBlock, c);
    }
    const Vec v = vfma(to_float(a), vset1(65536.f), vfma(to_float(b), vset1(256.f), to_float(c)));
    acc = vfma(v, spread4(_mm_mul_ps(sc, _mm_set1_ps(o.xd[grp]))), acc);
  }
  alignas(64) float lanes[kWidth];
  alignas(16) float offs[4];
  vstore(lanes, acc);
  _mm_store_ps(offs, off);
  for (int ch = 0; ch < kChannels; ++ch) {
    float sum = 0.f;
    for (int l = 0; l < kLanes; ++l) sum += lanes[ch * kLanes + l];
    y[n + ch] = sum + offs[ch] + (o.bias ? o.bias[n + ch] : 0.f);
  }
}
#endif

// The quantized activations of a call.
struct Int8Rows {
  const int8_t* xq;    // [M, K]
  const float* d;      // [M, K / kBlock]: each block's scale
  const int32_t* qsum; // [M, K / kBlock]: each block's sum of codes
  const float* xsum;   // [M, groups]: each group's sum of the dequantized row, divided by kLanes
  int64_t K, blocks, groups;
  const int32_t* half_qsum = nullptr;  // [M, 2 blocks]: each half block's sum of codes (groups of 16)
  // The same rows block-major for tile_a8 (interleave_rows): one pointer walks R rows' blocks.
  const int8_t* xi = nullptr;   // [blocks, M, kBlock]
  const float* di = nullptr;    // [blocks, M]: each block's d
  const int32_t* ci = nullptr;  // [blocks, M]: -8 / kLanes x each block's code sum (symmetric codes' start)
  const int32_t* qi = nullptr;  // [blocks, M]: each block's code sum (tile_q8)
  const int32_t* hi = nullptr;  // [blocks, M, 2]: each half block's code sum (tile_q8, groups of 16)
  int64_t rows = 0;             // M
};

#if defined(FIVEFOLD_A8)
// The R rows' accumulators (kLanes lanes per channel) summed per channel, plus the bias, into
// y[m + r, n + c].
template <int R, int C>
inline void store_rows(const Vec* acc, int64_t m, int64_t n, float* y, int64_t N, const float* bias) {
  for (int r = 0; r < R; ++r) {
    alignas(64) float lanes[kWidth];
    vstore(lanes, acc[r]);
    for (int c = 0; c < C; ++c) {
      float v = bias ? bias[n + c] : 0.f;
      for (int l = 0; l < kLanes; ++l) v += lanes[c * kLanes + l];
      y[(m + r) * N + n + c] = v;
    }
  }
}

// R rows (from row m) x C channels starting at channel n. Symmetric codes (w = s (q - 8)): the
// -8 is folded into each block's integer sum, sum q xq - 8 sum xq, by starting each of a channel's
// kLanes lanes at -8 / kLanes times the block's code sum (exact: kLanes is 4 or 2), so the group
// needs no offset term: at groups of 32 (GGUF Q4_0) the offset's conversion, spread and FMA per
// block were a third of the work.
// Levels: Q4_K's two scale levels (full tiles, groups of 32, a minimum) instead of float16 ones.
template <int R, int C, bool Symmetric, bool Levels = false>
inline void tile_a8(const Int8Rows& a, int64_t m, const uint8_t* wt, int64_t st, int64_t n, float* y, int64_t N,
                    const Operands& o) {
  static_assert(!Levels || (C == kChannels && !Symmetric), "levels: full tiles with a minimum");
  Vec acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vzero();
  const uint8_t* p = wt;
  const int64_t blocks_per_group = o.steps / kStepsPerBlock;
  // The R rows of a block are adjacent in a.xi, a.di and a.ci, so three pointers walk them. Indexed
  // per row in the [M, blocks] layout, GCC ran out of general registers: on Zen 4, Q4_0's form on
  // 6144 x 4096, 4 rows took 7.5 cycles per block and row, most in address arithmetic and spills.
  const int8_t* xb = a.xi + m * kBlock;
  const float* db = a.di + m;
  const int32_t* cb = a.ci + m;
  int64_t blk = 0;
  LevelParams levels(Levels ? tile_levels(o, st) : nullptr);
  for (int64_t grp = 0; grp < o.groups; ++grp) {
    float sc[kChannels] = {}, of[kChannels] = {};
    if constexpr (!Levels) {
      halves_to_floats<C>(o.scale + st + grp * C, sc);
      if constexpr (!Symmetric) halves_to_floats<C>(o.offset + st + grp * C, of);
    }
    Vec part[R];
    for (int r = 0; r < R; ++r) part[r] = vzero();
    for (const int64_t end = std::min(blk + blocks_per_group, a.blocks); blk < end;
         ++blk, p += C * kWidth * kStepsPerBlock, xb += a.rows * kBlock, db += a.rows, cb += a.rows) {
      _mm_prefetch(reinterpret_cast<const char*>(p) + kAheadBytes, _MM_HINT_T0);
      const BlockCodes<C> codes(p);
      for (int r = 0; r < R; ++r) {
        const IVec init = Symmetric ? iset1(cb[r]) : iset1(0);
        const Vec sum = to_float(block_dot(codes, xb + r * kBlock, init));
        part[r] = vfma(sum, vset1(db[r]), part[r]);
      }
    }
    Vec scv, ofv;
    if constexpr (Levels) levels.next(scv, ofv);
    else scv = spread4(_mm_loadu_ps(sc));
    if constexpr (Symmetric) {
      for (int r = 0; r < R; ++r) acc[r] = vfma(part[r], scv, acc[r]);
    } else {
      if constexpr (!Levels) ofv = spread4(_mm_loadu_ps(of));
      for (int r = 0; r < R; ++r) acc[r] = vfma(ofv, vset1(a.xsum[(m + r) * a.groups + grp]), vfma(part[r], scv, acc[r]));
    }
  }
  store_rows<R, C>(acc, m, n, y, N, o.bias);
}

template <int C, bool Symmetric, bool Levels = false>
inline void rows_a8(const Int8Rows& a, int64_t M, const uint8_t* wt, int64_t n, float* y, int64_t N,
                    const Operands& o) {
  const int64_t st = n * o.groups;
#if defined(__AVX512F__)
  // 5-8 rows (below the panels, or beside them) in one tile: the codes streamed, unpacked and the
  // group's scales converted once, not twice (16 accumulators and 2 code vectors of 32 registers).
  // linear_stream.py --shapes llama8b (Zen 4, VNNI; 4 + the rest before, alternated twice), ms per
  // pass at 5 / 6 / 7 / 8 rows: Q4_0's form 14.6 / 16.3-16.5 / 18.9-19.2 / 21.2 -> 12.5 / 14.8-15.3 /
  // 17.1-17.2 / 19.4-19.5; a minimum per 32 17.2-20.3 / 19.3-19.9 / 22.3-23.3 / 24.2-24.5 -> 15.0-15.6 /
  // 17.6-17.8 / 19.7-19.9 / 22.3-22.5; Q4_K's levels 17.5-18.0 / 19.6-20.9 / 22.5-23.6 / 25.2-28.5 ->
  // 15.0-15.1 / 17.6-18.1 / 20.2-20.5 / 22.4-22.8. The panels at 9 rows (groups of 32) took 24.5-26.2,
  // about what 8 + 1 rows of tiles would: a8_panel_min_rows stays.
  switch (M) {
    case 5: tile_a8<5, C, Symmetric, Levels>(a, 0, wt, st, n, y, N, o); return;
    case 6: tile_a8<6, C, Symmetric, Levels>(a, 0, wt, st, n, y, N, o); return;
    case 7: tile_a8<7, C, Symmetric, Levels>(a, 0, wt, st, n, y, N, o); return;
    case 8: tile_a8<8, C, Symmetric, Levels>(a, 0, wt, st, n, y, N, o); return;
    default: break;
  }
#endif
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) tile_a8<kRows, C, Symmetric, Levels>(a, m, wt, st, n, y, N, o);
  switch (M - m) {
    case 3: tile_a8<3, C, Symmetric, Levels>(a, m, wt, st, n, y, N, o); break;
    case 2: tile_a8<2, C, Symmetric, Levels>(a, m, wt, st, n, y, N, o); break;
    case 1: tile_a8<1, C, Symmetric, Levels>(a, m, wt, st, n, y, N, o); break;
    default: break;
  }
}

template <int C>
inline void channels_a8(const Int8Rows& a, int64_t M, const uint8_t* wt, int64_t n, float* y, int64_t N,
                        const Operands& o) {
  if constexpr (C == kChannels) {
    if (o.levels) return rows_a8<C, false, true>(a, M, wt, n, y, N, o);
  }
  if (o.offset) rows_a8<C, false>(a, M, wt, n, y, N, o);
  else rows_a8<C, true>(a, M, wt, n, y, N, o);
}

// ---- From 8 rows: panels with channels and blocks in the lanes ----
//
// tile_a8 above converts and scales each block's int32 sums of each row and tile on their own: two
// vpdpbusd per conversion, FMA, scale broadcast and starting value, at any row count; the float
// path dequantizes every weight once per 4 rows. From 16 rows both ran slower than W8A16's panels.
// Here the codes of two tiles are transposed once per 64 rows and chunk of columns into panel
// vectors whose int32 lanes are (channel c, block b) for the B blocks of a span of 32 B columns
// (B = 4 with AVX-512, 2 with AVX2): vector t holds in lane Bc + b the 4 codes of channel c at
// columns 4t..4t + 3 of block b. AVX-512: the stored layout has channel c's 16 bytes of a block in
// 128-bit lane c (low nibbles columns 0-15, high 16-31), so this is a 4 x 4 transpose of dwords
// inside each 128-bit lane across the span's 4 blocks (8 unpacks, then an AND, or a shift and an
// AND, per vector). AVX2: a block is two steps of 8 bytes per channel, and a shift and a blend
// pair the two blocks' dwords. Each row's activations are laid out to match once per call (for
// column j of a block: block b's value in element b of 4 B bytes, broadcast to every lane group),
// so the lanes multiply with no horizontal sums until the very end (a channel's B lanes, once).
//   W4A8 (AVX-512 VNNI; AVX2 keeps tile_a8): 8 vpdpbusd and nothing else sum one row's 4 blocks x 4 channels; a conversion, a
//     multiply by d_b x the group's scale and an FMA per span bring them into float, the symmetric
//     -8 in the starting value (-8 x the block's code sum), a minimum as offset x d_b x code sum:
//     per 32 x 16 weights and row, 8 dot products and 3-4 other instructions against 8 and ~12.
//   W4A16: each code vector becomes 4 float vectors (shift, AND, conversion, FMA with the lanes'
//     scale and offset: the weights themselves) once for all rows, then one FMA per column and row.
#if defined(FIVEFOLD_A8)
#define FIVEFOLD_INT4_PANELS 1
constexpr int64_t kSpanBlocks = kWidth / 4, kSpanCols = kSpanBlocks * kBlock, kSpanVecs = kBlock / 4;
constexpr int kPanelTiles = 2;
constexpr int64_t kPanelRowBlock = 64;  // rows per panel build (and per accumulator buffer)
#if defined(__AVX512F__)
constexpr int64_t kFloatPanelMinRows = 8;  // FloatPanel at 8 rows: as fast as tile(); 16: 1.25x, 64: 1.65x
inline __m512i bcast4(const int32_t* p) { return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline Vec bcast_span(const float* p) { return _mm512_broadcast_f32x4(_mm_loadu_ps(p)); }
inline IVec ivset1(int32_t v) { return _mm512_set1_epi32(v); }
inline IVec ivand(IVec a, IVec b) { return _mm512_and_si512(a, b); }
inline IVec ivsrl32(IVec a, int n) { return _mm512_srli_epi32(a, n); }
#else
constexpr int64_t kFloatPanelMinRows = 8;
// the kSpanBlocks = 2 floats at p into every pair of lanes
inline Vec bcast_span(const float* p) { return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(p))); }
inline IVec ivset1(int32_t v) { return _mm256_set1_epi32(v); }
inline IVec ivand(IVec a, IVec b) { return _mm256_and_si256(a, b); }
inline IVec ivsrl32(IVec a, int n) { return _mm256_srli_epi32(a, n); }
#endif

// `have` float16 values from p as floats, lane l taking value index[l].
inline Vec span_params(const at::Half* p, int64_t have, IVec index) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << have) - 1), p));
  return _mm512_permutexvar_ps(index, v);
#else
  alignas(16) at::Half h[8] = {};
  std::memcpy(h, p, have * sizeof(at::Half));
  return _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h))), index);
#endif
}

// kWidth bytes from p (a tile's Q4_K sc or m of the span's groups, [groups][C]) as floats, lane l taking
// byte index[l] (span_params' index).
inline Vec level_bytes(const uint8_t* p, IVec index) {
#if defined(__AVX512F__)
  return _mm512_permutexvar_ps(index, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#else
  return _mm256_permutevar8x32_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))), index);
#endif
}

#if defined(__AVX512F__)
// A 4 x 4 transpose of dwords inside each 128-bit lane: dword j of r[b]'s lane c -> dword b of q[j]'s
// lane c (4 vectors of 4 channels' 16 bytes of one block each -> lane 4c + b of q[j] holding channel
// c's bytes 4j..4j + 3 of block b).
inline void transpose_dwords(const __m512i (&r)[4], __m512i (&q)[4]) {
  const __m512i t0 = _mm512_unpacklo_epi32(r[0], r[1]), t1 = _mm512_unpackhi_epi32(r[0], r[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(r[2], r[3]), t3 = _mm512_unpackhi_epi32(r[2], r[3]);
  q[0] = _mm512_unpacklo_epi64(t0, t2);
  q[1] = _mm512_unpackhi_epi64(t0, t2);
  q[2] = _mm512_unpacklo_epi64(t1, t3);
  q[3] = _mm512_unpackhi_epi64(t1, t3);
}
#endif

// The code panel of one full tile (its bytes from wt) over spans [s0, s0 + ns): codes [ns][8]
// vectors, sv and ov [ns] the lanes' group scales and offsets (symmetric: -8 x the scale when
// with_offset, else ov untouched); lanes of blocks past K hold zeros.
inline void code_panel(const uint8_t* wt, int64_t blocks, int64_t st, int64_t s0, int64_t ns, const Operands& o,
                       int64_t group_cols, bool with_offset, IVec* codes, Vec* sv, Vec* ov) {
  // lane Bc + b -> its group's value among the (up to) 4 B halves loaded from the span's first group
  alignas(64) int32_t idx[kWidth];
  for (int c = 0; c < kChannels; ++c)
    for (int b = 0; b < kSpanBlocks; ++b)
      idx[kSpanBlocks * c + b] = static_cast<int32_t>(b * kBlock / group_cols) * kChannels + c;
  const IVec index = wload(reinterpret_cast<const uint8_t*>(idx));
  for (int64_t s = 0; s < ns; ++s) {
    const int64_t blk0 = (s0 + s) * kSpanBlocks;
    IVec* out = codes + s * kSpanVecs;
#if defined(__AVX512F__)
    __m512i r[kSpanBlocks], q[4];
    for (int64_t b = 0; b < kSpanBlocks; ++b)
      r[b] = blk0 + b < blocks ? _mm512_loadu_si512(wt + (blk0 + b) * kChannels * kWidth) : _mm512_setzero_si512();
    transpose_dwords(r, q);
    for (int j = 0; j < 4; ++j) {
      out[j] = lo_nibbles(q[j]);
      out[4 + j] = hi_nibbles(q[j]);
    }
#else
    for (int64_t step = 0; step < kStepsPerBlock; ++step) {  // columns 16 step .. 16 step + 15 of both blocks
      __m256i r[kSpanBlocks];
      for (int64_t b = 0; b < kSpanBlocks; ++b)
        r[b] = blk0 + b < blocks ? wload(wt + ((blk0 + b) * kStepsPerBlock + step) * kChannels * kWidth) : _mm256_setzero_si256();
      // dword 2c + j of block b -> lane 2c + b of vector j
      const __m256i q[2] = {_mm256_blend_epi32(r[0], _mm256_slli_epi64(r[1], 32), 0xAA),
                            _mm256_blend_epi32(_mm256_srli_epi64(r[0], 32), r[1], 0xAA)};
      for (int j = 0; j < 2; ++j) {
        out[4 * step + j] = lo_nibbles(q[j]);
        out[4 * step + 2 + j] = hi_nibbles(q[j]);
      }
    }
#endif
    // the span's groups: from g0, at most B (groups of 32), each C halves in the tile-major order
    const int64_t g0 = blk0 * kBlock / group_cols, have = std::min<int64_t>(kWidth, (o.groups - g0) * kChannels);
    if (o.levels) {  // groups of 32: the span's groups lie in one super-block; lane (c, b) takes d or dmin of c
      const uint8_t* lv = tile_levels(o, st) + g0 / kLevelGroups * kLevelBytes;
      alignas(16) uint8_t sc[16] = {}, mn[16] = {};  // the span's groups' sc and m, [groups][C] as span_params reads
      for (int64_t b = 0; b < kSpanBlocks; ++b) {
        const uint8_t* sub = lv + 4 * kChannels + 2 * kChannels * (g0 % kLevelGroups + b);
        std::memcpy(sc + b * kChannels, sub, kChannels);
        std::memcpy(mn + b * kChannels, sub + kChannels, kChannels);
      }
      const __m256 dm = level_scales(lv);
      sv[s] = vmul(spread4(_mm256_castps256_ps128(dm)), level_bytes(sc, index));
      ov[s] = vmul(spread4(_mm256_extractf128_ps(dm, 1)), level_bytes(mn, index));
      continue;
    }
    sv[s] = span_params(o.scale + st + g0 * kChannels, have, index);
    if (o.offset) ov[s] = span_params(o.offset + st + g0 * kChannels, have, index);
    else if (with_offset) ov[s] = vmul(sv[s], vset1(-8.f));
  }
}

// W4A16: x [M, K] laid out as xr [M, spans, 32, B] (column j of block b of a span in element b),
// zeros past K.
struct FloatPanelRows {
  std::vector<float> xr;
  int64_t spans;
  FloatPanelRows(const float* x, int64_t M, int64_t K) : spans((K + kSpanCols - 1) / kSpanCols) {
    xr.resize(M * spans * kSpanCols);
    const int64_t blocks = K / kBlock;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t s = 0; s < spans; ++s)
        for (int64_t h = 0; h < kBlock; h += kWidth) {  // columns h..h+W-1 of the span's blocks, interleaved
          Vec v[kSpanBlocks];
          for (int64_t b = 0; b < kSpanBlocks; ++b) {
            const int64_t blk = s * kSpanBlocks + b;
            v[b] = blk < blocks ? vload(x + m * K + blk * kBlock + h) : vzero();
          }
          float* out = xr.data() + ((m * spans + s) * kBlock + h) * kSpanBlocks;
#if defined(__AVX512F__)
          // a 4 x 4 transpose inside each 128-bit lane, then one of the 128-bit lanes across vectors
          const Vec t0 = _mm512_unpacklo_ps(v[0], v[1]), t1 = _mm512_unpackhi_ps(v[0], v[1]);
          const Vec t2 = _mm512_unpacklo_ps(v[2], v[3]), t3 = _mm512_unpackhi_ps(v[2], v[3]);
          const Vec u0 = _mm512_shuffle_ps(t0, t2, 0x44), u1 = _mm512_shuffle_ps(t0, t2, 0xEE);
          const Vec u2 = _mm512_shuffle_ps(t1, t3, 0x44), u3 = _mm512_shuffle_ps(t1, t3, 0xEE);
          const Vec v0 = _mm512_shuffle_f32x4(u0, u1, 0x44), v1 = _mm512_shuffle_f32x4(u2, u3, 0x44);
          const Vec v2 = _mm512_shuffle_f32x4(u0, u1, 0xEE), v3 = _mm512_shuffle_f32x4(u2, u3, 0xEE);
          vstore(out, _mm512_shuffle_f32x4(v0, v1, 0x88));
          vstore(out + kWidth, _mm512_shuffle_f32x4(v0, v1, 0xDD));
          vstore(out + 2 * kWidth, _mm512_shuffle_f32x4(v2, v3, 0x88));
          vstore(out + 3 * kWidth, _mm512_shuffle_f32x4(v2, v3, 0xDD));
#else
          const Vec lo = _mm256_unpacklo_ps(v[0], v[1]), hi = _mm256_unpackhi_ps(v[0], v[1]);
          vstore(out, _mm256_permute2f128_ps(lo, hi, 0x20));
          vstore(out + kWidth, _mm256_permute2f128_ps(lo, hi, 0x31));
#endif
        }
  }
};

struct FloatPanel {
  static constexpr int64_t kChunkSpans = 512 / kSpanCols;  // 512 columns: a tile's float weights 8 KB
#if defined(__AVX512F__)
  static constexpr int kRows = 8;  // 16 accumulators, 2 weight vectors (6 rows: 3% slower, 12: the same)
#else
  static constexpr int kRows = 6;  // 12 accumulators, 2 weight vectors, a broadcast of 16 registers
#endif
  using Rows = FloatPanelRows;
  Vec w[kChunkSpans * kBlock];  // [span][column j of the blocks]: lanes Bc + b
  static int64_t tile_bytes(int64_t K) { return kChannels * (K / 2); }
  // The tile at wt (its first channel n) over spans [s0, s0 + ns).
  void build(const uint8_t* wt, int64_t blocks, int64_t n, int64_t s0, int64_t ns, const Operands& o, int64_t group_cols) {
    IVec codes[kChunkSpans * kSpanVecs];
    Vec sv[kChunkSpans], ov[kChunkSpans];
    code_panel(wt, blocks, n * o.groups, s0, ns, o, group_cols, /*with_offset=*/true, codes, sv, ov);
    const IVec byte = ivset1(255);
    for (int64_t s = 0; s < ns; ++s)
      for (int64_t t = 0; t < kSpanVecs; ++t)
        for (int i = 0; i < 4; ++i) {
          const IVec q = ivand(ivsrl32(codes[s * kSpanVecs + t], 8 * i), byte);
          w[s * kBlock + 4 * t + i] = vfma(to_float(q), sv[s], ov[s]);
        }
  }
  // R rows (from row m) x T tiles' panels over spans [s0, s0 + ns), added to f.
  template <int R, int T, bool Symmetric>
  static void rows(const Rows& a, int64_t m, int64_t s0, int64_t ns, const FloatPanel* p, Vec (&f)[R][T]) {
    for (int64_t s = 0; s < ns; ++s) {
      // each row's span, and the panels' columns, as pointers: indexing them in the loop below
      // cost an integer multiply and four adds per row and column (2x the FMAs' time on AVX2)
      const float* x[R];
      for (int r = 0; r < R; ++r) x[r] = a.xr.data() + ((m + r) * a.spans + s0 + s) * kBlock * kSpanBlocks;
      const Vec* w[T];
      for (int tt = 0; tt < T; ++tt) w[tt] = p[tt].w + s * kBlock;
      for (int64_t j = 0; j < kBlock; ++j) {
        Vec wj[T];
        for (int tt = 0; tt < T; ++tt) wj[tt] = w[tt][j];
        for (int r = 0; r < R; ++r) {
          const Vec xj = bcast_span(x[r] + j * kSpanBlocks);
          for (int tt = 0; tt < T; ++tt) f[r][tt] = vfma(wj[tt], xj, f[r][tt]);
        }
      }
    }
  }
};

#if defined(__AVX512VNNI__) || !defined(__AVX512F__)
#define FIVEFOLD_A8_PANELS 1
// Rows from which W4A8 takes the panels, by the group's 32-column blocks. The panels convert and
// scale a block's int32 sums once per (channel, block) lane for all rows; tile_a8 once per block,
// tile and row, but streams the codes without the transpose. So the fewer blocks a group has (the
// more conversions per weight), the earlier the panels win. Cold weights (benchmarks/linear_stream.py
// --shapes llama8b, stream-a8, tiles against panels, two runs each, Zen 4, after tile_a8's
// block-major rows): AVX-512 VNNI groups of 32 (Q4_0, Q4_1, Q4_K) tiles 1.04x at 8 rows, panels
// 1.08-1.12x from 10; of 64 tiles 1.05-1.1x at 8, even at 9-11, panels from 12-13; of 128 tiles
// 1.06x at 10, even at 12. AVX2 forced: groups of 32 tiles 1.04x at 8, even at 10, panels 1.1x at
// 12; of 64 tiles through 16 (1.06x); of 128 tiles 1.04x at 16, even at 24.
inline int64_t a8_panel_min_rows(int64_t group_cols) {
  const int64_t blocks = group_cols / kBlock;
#if defined(__AVX512F__)
  return blocks <= 1 ? 9 : blocks == 2 ? 11 : 12;
#else
  return blocks <= 1 ? 10 : blocks == 2 ? 20 : 24;
#endif
}

// W4A8: the rows laid out for the panels: xr [M, spans, 8, B] dwords of codes (vector t: block b's
// 4 bytes at columns 4t..4t + 3 in dword b), init [M, spans, B] int32 (-code_offset x each block's
// code sum: symmetric 4-bit codes 8, int8 weights entering vpdpbusd as w + 128 128, else 0),
// dv [M, spans, B] (each block's d), dq [M, spans, B] (d x code sum); zeros past K. halves (int8
// weights in groups of 16, GGUF Q6_K): init from each block's first half's code sum, init2 from its
// second half's.
struct Int8PanelRows {
  std::vector<int32_t> xr, init, init2;
  std::vector<float> dv, dq;
  int64_t spans;
  Int8PanelRows(const Int8Rows& a, int64_t M, int32_t code_offset, bool halves = false)
      : spans((a.blocks + kSpanBlocks - 1) / kSpanBlocks) {
    xr.resize(M * spans * kSpanVecs * kSpanBlocks);
    init.assign(M * spans * kSpanBlocks, 0);
    if (halves) init2.assign(M * spans * kSpanBlocks, 0);
    dv.assign(M * spans * kSpanBlocks, 0.f);
    dq.assign(M * spans * kSpanBlocks, 0.f);
#if defined(__AVX512F__)
    // dword t of block b -> element 4t + b: one two-source permute per 16 dwords
    alignas(64) int32_t lo[16], hi[16];
    for (int t = 0; t < 4; ++t)
      for (int b = 0; b < 4; ++b) lo[4 * t + b] = b * 8 + t, hi[4 * t + b] = b * 8 + t + 4;
    const __m512i ilo = _mm512_load_si512(lo), ihi = _mm512_load_si512(hi);
#endif
    for (int64_t m = 0; m < M; ++m)
      for (int64_t s = 0; s < spans; ++s) {
        const int64_t have = std::min<int64_t>(kSpanBlocks, a.blocks - s * kSpanBlocks) * kBlock;  // bytes of the span in K
        alignas(64) int8_t src[kSpanCols] = {};
        std::memcpy(src, a.xq + m * a.K + s * kSpanCols, have);
        int32_t* out = xr.data() + (m * spans + s) * kSpanVecs * kSpanBlocks;
#if defined(__AVX512F__)
        const __m512i z0 = _mm512_load_si512(src), z1 = _mm512_load_si512(src + 64);
        _mm512_storeu_si512(out, _mm512_permutex2var_epi32(z0, ilo, z1));
        _mm512_storeu_si512(out + 16, _mm512_permutex2var_epi32(z0, ihi, z1));
#else  // dword t of block b -> element 2t + b: an interleave of the two blocks' dwords
        const __m256i z0 = wload(reinterpret_cast<const uint8_t*>(src)), z1 = wload(reinterpret_cast<const uint8_t*>(src + 32));
        const __m256i lo = _mm256_unpacklo_epi32(z0, z1), hi = _mm256_unpackhi_epi32(z0, z1);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8), _mm256_permute2x128_si256(lo, hi, 0x31));
#endif
      }
    for (int64_t m = 0; m < M; ++m)
      for (int64_t blk = 0; blk < a.blocks; ++blk) {
        const int64_t s = blk / kSpanBlocks, b = blk % kSpanBlocks, at = (m * spans + s) * kSpanBlocks + b;
        const int64_t from = m * a.blocks + blk;
        const int32_t qs = a.qsum[from];
        const float d = a.d[from];
        init[at] = -code_offset * (halves ? a.half_qsum[2 * from] : qs);
        if (halves) init2[at] = -code_offset * a.half_qsum[2 * from + 1];
        dv[at] = d;
        dq[at] = d * static_cast<float>(qs);
      }
  }
};

struct Int8Panel {
  static constexpr int64_t kChunkSpans = 1024 / kSpanCols;  // 1024 columns: a tile's codes 4 KB
#if defined(__AVX512F__)
  static constexpr int kRows = 4;  // 8 int32 + 8 float accumulators, 2 weight vectors
#else
  static constexpr int kRows = 3;  // 6 int16 + 6 float accumulators, 2 weight vectors, a broadcast of 16
#endif
  using Rows = Int8PanelRows;
  IVec codes[kChunkSpans * kSpanVecs];
  Vec sv[kChunkSpans], ov[kChunkSpans];
  static int64_t tile_bytes(int64_t K) { return kChannels * (K / 2); }
  void build(const uint8_t* wt, int64_t blocks, int64_t n, int64_t s0, int64_t ns, const Operands& o, int64_t group_cols) {
    code_panel(wt, blocks, n * o.groups, s0, ns, o, group_cols, /*with_offset=*/false, codes, sv, ov);
  }
  // Q: Int8Panel, or (AVX-512 VNNI, Symmetric) Int8WeightPanel<false>: codes and sv alike.
  template <int R, int T, bool Symmetric, class Q>
  static void rows(const Rows& a, int64_t m, int64_t s0, int64_t ns, const Q* p, Vec (&f)[R][T]) {
#if !defined(__AVX512F__)
    // AVX2: vpmaddubsw sums each lane's code pairs times activations into int16; the 8 vectors of a
    // span (a block's 32 columns per lane) stay in int16: a pair is at most 2 x 15 x 127 = 3810, so
    // eight are at most 30480 < 32767 (no saturation), then vpmaddwd widens each lane's two halves.
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t s = 0; s < ns; ++s) {
      const int64_t span = s0 + s;
      const int32_t* x[R];
      for (int r = 0; r < R; ++r) x[r] = a.xr.data() + ((m + r) * a.spans + span) * kSpanVecs * kSpanBlocks;
      __m256i h[R][T];
      for (int r = 0; r < R; ++r)
        for (int tt = 0; tt < T; ++tt) h[r][tt] = _mm256_setzero_si256();
      for (int64_t t = 0; t < kSpanVecs; ++t) {
        __m256i w[T];
        for (int tt = 0; tt < T; ++tt) w[tt] = p[tt].codes[s * kSpanVecs + t];
        for (int r = 0; r < R; ++r) {
          int64_t v;
          std::memcpy(&v, x[r] + t * kSpanBlocks, sizeof(v));
          const __m256i xt = _mm256_set1_epi64x(v);
          for (int tt = 0; tt < T; ++tt) h[r][tt] = _mm256_add_epi16(h[r][tt], _mm256_maddubs_epi16(w[tt], xt));
        }
      }
      for (int r = 0; r < R; ++r) {
        const int64_t at = ((m + r) * a.spans + span) * kSpanBlocks;
        const Vec d = bcast_span(a.dv.data() + at);
        int64_t init2;
        std::memcpy(&init2, a.init.data() + at, sizeof(init2));
        const __m256i init = _mm256_set1_epi64x(init2);
        for (int tt = 0; tt < T; ++tt) {
          __m256i i = _mm256_madd_epi16(h[r][tt], ones);
          if constexpr (Symmetric) i = _mm256_add_epi32(i, init);
          f[r][tt] = vfma(_mm256_cvtepi32_ps(i), vmul(d, p[tt].sv[s]), f[r][tt]);
        }
        if constexpr (!Symmetric) {
          const Vec dq = bcast_span(a.dq.data() + at);
          for (int tt = 0; tt < T; ++tt) f[r][tt] = vfma(p[tt].ov[s], dq, f[r][tt]);
        }
      }
    }
#else
    for (int64_t s = 0; s < ns; ++s) {
      const int64_t span = s0 + s;
      __m512i i[R][T];
      for (int r = 0; r < R; ++r) {
        const __m512i init = Symmetric ? bcast4(a.init.data() + ((m + r) * a.spans + span) * kSpanBlocks) : _mm512_setzero_si512();
        for (int tt = 0; tt < T; ++tt) i[r][tt] = init;
      }
      const int32_t* x[R];  // as in FloatPanel::rows: pointers, not indices, in the loop
      for (int r = 0; r < R; ++r) x[r] = a.xr.data() + ((m + r) * a.spans + span) * kSpanVecs * kSpanBlocks;
      for (int64_t t = 0; t < kSpanVecs; ++t) {
        __m512i w[T];
        for (int tt = 0; tt < T; ++tt) w[tt] = p[tt].codes[s * kSpanVecs + t];
        for (int r = 0; r < R; ++r) {
          const __m512i xt = bcast4(x[r] + t * kSpanBlocks);
          for (int tt = 0; tt < T; ++tt) i[r][tt] = _mm512_dpbusd_epi32(i[r][tt], w[tt], xt);
        }
      }
      for (int r = 0; r < R; ++r) {
        const int64_t at = ((m + r) * a.spans + span) * kSpanBlocks;
        const Vec d = bcast_span(a.dv.data() + at);
        for (int tt = 0; tt < T; ++tt) f[r][tt] = vfma(_mm512_cvtepi32_ps(i[r][tt]), _mm512_mul_ps(d, p[tt].sv[s]), f[r][tt]);
        if constexpr (!Symmetric) {
          const Vec dq = bcast_span(a.dq.data() + at);
          for (int tt = 0; tt < T; ++tt) f[r][tt] = vfma(p[tt].ov[s], dq, f[r][tt]);
        }
      }
    }
#endif
  }
};
#endif

// R rows (from row m) of the panels over spans [s0, s0 + ns), added to acc [rows, T, 16] (first:
// from zero; acc_row: row m's row in acc).
template <class P, int R, int T, bool Symmetric>
inline void panel_rows(const typename P::Rows& a, int64_t m, int64_t s0, int64_t ns, const P* panels, float* acc,
                       int64_t acc_row, bool first) {
  Vec f[R][T];
  for (int r = 0; r < R; ++r)
    for (int tt = 0; tt < T; ++tt) f[r][tt] = first ? vzero() : vload(acc + ((acc_row + r) * T + tt) * kWidth);
  P::template rows<R, T, Symmetric>(a, m, s0, ns, panels, f);
  for (int r = 0; r < R; ++r)
    for (int tt = 0; tt < T; ++tt) vstore(acc + ((acc_row + r) * T + tt) * kWidth, f[r][tt]);
}

// The last rest < R rows.
template <class P, int R, int T, bool Symmetric>
inline void panel_rest(int64_t rest, const typename P::Rows& a, int64_t m, int64_t s0, int64_t ns, const P* panels,
                       float* acc, int64_t acc_row, bool first) {
  if constexpr (R > 0) {
    if (rest == R) panel_rows<P, R, T, Symmetric>(a, m, s0, ns, panels, acc, acc_row, first);
    else panel_rest<P, R - 1, T, Symmetric>(rest, a, m, s0, ns, panels, acc, acc_row, first);
  }
}

// Whether the per-tile kernels run beside the panels (which take min_rows rows and more): for
// every channel below that, else for those past the last pair of full tiles.
inline bool tiles_beside_panels(int64_t M, int64_t N, int64_t min_rows) {
  return M < min_rows || N % (kChannels * kPanelTiles) != 0;
}

// Rows [m0, m0 + rows) against the kPanelTiles full tiles from channel n (their bytes from wt):
// every chunk of spans, then each channel's 4 lanes summed (plus the bias) into y.
// o: the weights' operands as P::build takes them (o.bias: [N] or null).
template <class P, bool Symmetric, class Ops>
void panel_tiles(const typename P::Rows& a, int64_t K, int64_t m0, int64_t rows, const uint8_t* wt, int64_t n, float* y,
                 int64_t N, const Ops& o, int64_t group_cols) {
  constexpr int T = kPanelTiles;
  P panels[T];
  alignas(64) float acc[kPanelRowBlock * T * kWidth];
  const int64_t tile_bytes = P::tile_bytes(K), blocks = K / kBlock;
  for (int64_t s0 = 0; s0 < a.spans; s0 += P::kChunkSpans) {
    const int64_t ns = std::min(P::kChunkSpans, a.spans - s0);
    for (int tt = 0; tt < T; ++tt)
      panels[tt].build(wt + tt * tile_bytes, blocks, n + tt * kChannels, s0, ns, o, group_cols);
    const bool first = s0 == 0;
    int64_t r = 0;
    for (; r + P::kRows <= rows; r += P::kRows) panel_rows<P, P::kRows, T, Symmetric>(a, m0 + r, s0, ns, panels, acc, r, first);
    if (r < rows) panel_rest<P, P::kRows - 1, T, Symmetric>(rows - r, a, m0 + r, s0, ns, panels, acc, r, first);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int tt = 0; tt < T; ++tt)
      for (int c = 0; c < kChannels; ++c) {
        const int64_t ch = n + tt * kChannels + c;
        const float* lanes = acc + (r * T + tt) * kWidth + c * kSpanBlocks;
        float sum = 0.f;
        for (int64_t b = 0; b < kSpanBlocks; ++b) sum += lanes[b];
        y[(m0 + r) * N + ch] = (o.bias ? o.bias[ch] : 0.f) + sum;
      }
}

// The pairs of full tiles against all M rows (threads split the pairs and blocks of 64 rows);
// returns the channels done (the rest: an odd tile, the narrow last one).
template <class P, bool Symmetric, class Ops>
int64_t run_panels(const typename P::Rows& a, int64_t M, int64_t K, const uint8_t* wp, int64_t N, float* y,
                   const Ops& o, int64_t group_cols) {
  const int64_t units = N / (kChannels * kPanelTiles), tile_bytes = P::tile_bytes(K);
#pragma omp parallel for schedule(static) collapse(2) if (N * K > (1 << 15))
  for (int64_t u = 0; u < units; ++u)
    for (int64_t m0 = 0; m0 < M; m0 += kPanelRowBlock)
      panel_tiles<P, Symmetric>(a, K, m0, std::min(kPanelRowBlock, M - m0), wp + u * kPanelTiles * tile_bytes,
                                u * kPanelTiles * kChannels, y, N, o, group_cols);
  return units * kPanelTiles * kChannels;
}
#endif
#endif

// ---- int8 weights (fivefold::stream_pack's layout, GGUF Q8_0) times int8 activations ----
//
// The same activation blocks; the weights are stream_pack's tile-major int8 (tiles of 4 channels,
// each step of W columns the 4 channels' W bytes side by side), so a block of 32 columns is
// 32 / W steps and a step's vector holds each channel's W consecutive weights in its lane group,
// as a 4-bit step's low nibbles do. VNNI: vpdpbusd takes unsigned bytes, so each weight enters as
// w + 128 (an XOR of the sign bit) and the 128 x sum(xq) it adds is folded out by starting each
// lane at -128 / kLanes x the block's code sum (exact). Without VNNI: llama.cpp's sign trick,
// vpmaddubsw(|w|, x * sign(w)): |w| <= 128 and |x| <= 127 keep a pair under 32512, so each step's
// pairs are widened (vpmaddwd) before they are added.
#if defined(FIVEFOLD_A8)
constexpr int64_t kQ8Steps = kBlock / kWidth;  // steps of W columns per activation block

// Six-bit weights (q6_pack: GGUF Q6_K's codes w in [-32, 31] kept at 6 bits, as the file holds
// them, where int8 took 9 bits with the scales against the file's 6.56): each step's byte vector
// of S = C W bytes holds u = w + 32 as S / 2 bytes of nibbles (byte i: u_i's low 4 bits, u_{i+S/2}'s
// in its high 4) and S / 4 bytes of the top 2 bits (byte i: u_{i + qS/4}'s at bits 2q, 2q + 1). u
// is unsigned and at most 63, so it enters vpdpbusd as it is (the 32 x sum(xq) folded out by the
// lanes' start, as the +128 of the int8 form), and vpmaddubsw cannot saturate on it (a pair is at
// most 2 x 63 x 128 = 16128): no sign trick without VNNI either.
constexpr int64_t kSixStepBytes = 3 * kChannels * kWidth / 4;  // a full tile's step of 6-bit weights

// A step's S bytes u = w + 32 from its 3S/4 stored bytes (full tiles only).
inline IVec six_load(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i nibbles = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), _mm256_srli_epi16(lo, 4), 1),
                                           _mm512_set1_epi8(15));
  // the S/4 bytes of top bits into each 128-bit lane q, shifted right by 2q there
  const __m512i top = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32)));
  const __m512i bits = _mm512_and_si512(_mm512_srlv_epi64(top, _mm512_setr_epi64(0, 0, 2, 2, 4, 4, 6, 6)), _mm512_set1_epi8(3));
  return _mm512_or_si512(nibbles, _mm512_slli_epi16(bits, 4));
#else
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i nibbles = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(lo, 4), lo), _mm256_set1_epi8(15));
  int64_t top8;
  std::memcpy(&top8, p + 16, 8);
  const __m256i bits = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(top8), _mm256_setr_epi64x(0, 2, 4, 6)),
                                        _mm256_set1_epi8(3));
  return _mm256_or_si256(nibbles, _mm256_slli_epi16(bits, 4));
#endif
}

// Bytes of a tile's step: int8 weights C W, 6-bit ones 3/4 of a full tile's.
template <int C, bool Six>
constexpr int64_t q8_step_bytes() { return Six ? kSixStepBytes : C * kWidth; }

// The offset each weight byte enters the unsigned dot products with: int8 weights w + 128 (VNNI;
// none for the sign trick), 6-bit ones w + 32 on every ISA.
template <bool Six>
constexpr int32_t q8_code_offset() {
#if defined(__AVX512VNNI__)
  return Six ? 32 : 128;
#else
  return Six ? 32 : 0;
#endif
}

template <int C, bool Six = false>
struct BlockBytes {
  static_assert(!Six || C == kChannels, "6-bit weights come in full tiles");
  IVec v[kQ8Steps];
  explicit BlockBytes(const int8_t* p) {
    for (int64_t t = 0; t < kQ8Steps; ++t, p += q8_step_bytes<C, Six>()) {
      if constexpr (Six) {
        v[t] = six_load(reinterpret_cast<const uint8_t*>(p));
        continue;
      } else if constexpr (C == kChannels) {
        v[t] = wload(reinterpret_cast<const uint8_t*>(p));
      } else {
        alignas(64) int8_t buf[kChannels * kWidth] = {};
        std::memcpy(buf, p, C * kWidth);
        v[t] = wload(reinterpret_cast<const uint8_t*>(buf));
      }
#if defined(__AVX512VNNI__)
      v[t] = _mm512_xor_si512(v[t], _mm512_set1_epi8(static_cast<char>(0x80)));  // w + 128 as unsigned
#endif
    }
  }
};

// Steps [T0, T1) of a block (all of it, or one half of 16 columns for Q6_K's groups); qsum: the
// sum of the activation codes of those columns (the fold of the weights' offset).
template <int C, int T0 = 0, int T1 = kQ8Steps, bool Six = false>
inline IVec block_dot_q8(const BlockBytes<C, Six>& b, const int8_t* xq, int32_t qsum) {
#if defined(__AVX512VNNI__)
  IVec acc = _mm512_set1_epi32(-(q8_code_offset<Six>() / kLanes) * qsum);
  for (int64_t t = T0; t < T1; ++t) acc = _mm512_dpbusd_epi32(acc, b.v[t], xbroadcast(xq + t * kWidth));
  return acc;
#elif defined(__AVX512F__)
  IVec acc = _mm512_set1_epi32(-(q8_code_offset<Six>() / kLanes) * qsum);
  if constexpr (Six) {
    for (int64_t t = T0; t < T1; ++t)
      acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(b.v[t], xbroadcast(xq + t * kWidth)),
                                                    _mm512_set1_epi16(1)));
    return acc;
  }
  for (int64_t t = T0; t < T1; ++t) {
    const __m512i x = xbroadcast(xq + t * kWidth);
    const __m512i signed_x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(b.v[t]), _mm512_setzero_si512(), x);
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(b.v[t]), signed_x),
                                                  _mm512_set1_epi16(1)));
  }
  return acc;
#else
  IVec acc = _mm256_set1_epi32(-(q8_code_offset<Six>() / kLanes) * qsum);
  if constexpr (Six) {
    for (int64_t t = T0; t < T1; ++t)
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(b.v[t], xbroadcast(xq + t * kWidth)),
                                                    _mm256_set1_epi16(1)));
    return acc;
  }
  for (int64_t t = T0; t < T1; ++t) {
    const __m256i x = xbroadcast(xq + t * kWidth);
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(b.v[t]), _mm256_sign_epi8(x, b.v[t])),
                                                  _mm256_set1_epi16(1)));
  }
  return acc;
#endif
}

// A Q8 weight's scales, one per channel and group: float32 [N, groups] row-major (fivefold's own
// group-quantized W8A16), or float16 in int4_pack_groups' tile-major order (a GGUF's Q8_0 blocks:
// the file's bytes, and a tile's scales one contiguous run read beside its weights, where the
// row-major table is four more streams, one per channel).
struct Q8Scales {
  const float* f32;       // [N, groups] row-major, or null
  const at::Half* f16;    // tile-major [N, groups], or null
  int64_t groups;
};

// The C channels' scales of group grp for the tile at channel n, spread to their lane groups (a
// narrower tile's missing channels 0), built in registers: scalar stores followed by a vector load
// of the same bytes stall on store forwarding, and at one scale per 32 weights that stall cost half
// the kernel's time.
template <bool Half, int C>
inline Vec q8_scales(const Q8Scales& s, int64_t n, int64_t grp) {
  if constexpr (Half) {
    const at::Half* p = s.f16 + n * s.groups + grp * C;
    if constexpr (C == 4) return spread4(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    return spread4(_mm_setr_ps(static_cast<float>(p[0]), C > 1 ? static_cast<float>(p[1]) : 0.f,
                               C > 2 ? static_cast<float>(p[2]) : 0.f, 0.f));
  } else {
    const float* p = s.f32 + n * s.groups + grp;
    const int64_t g = s.groups;
    return spread4(_mm_setr_ps(p[0], C > 1 ? p[g] : 0.f, C > 2 ? p[2 * g] : 0.f, C > 3 ? p[3 * g] : 0.f));
  }
}

// R rows (from row m) x C channels starting at channel n; scales: one per channel and group of
// group_cols columns (a multiple of 32), or one per channel (groups = 1, group_cols = K).
template <bool Half, int R, int C, bool Six = false>
inline void tile_q8(const Int8Rows& a, int64_t m, const int8_t* wt, int64_t n, float* y, int64_t N,
                    const Q8Scales& scale, int64_t group_cols, const float* bias) {
  Vec acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vzero();
  const int8_t* p = wt;
  const int64_t blocks_per_group = group_cols / kBlock;
  int64_t blk = 0;
  if (group_cols == kBlock / 2) {  // GGUF Q6_K: a scale per half block, each half its own dot product
    // Running pointers, one load of both halves' float16 scales, and one FMA into each accumulator
    // per block (both halves summed first: at one row that FMA's latency is the loop's chain).
    // 4096 x 1024 from L3, 2 threads, 1 / 2 / 4 rows: int8 codes 60 / 101-115 / 180 -> 53 / 89 /
    // 158 us, 6-bit ones 89 / 130 / 212 -> 86 / 122 / 190.
    constexpr int kHalf = static_cast<int>(kQ8Steps / 2);
    const int64_t rows = a.rows, blocks = a.blocks;
    const int8_t* xb = a.xi + m * kBlock;
    const float* db = a.di + m;
    const int32_t* hb = a.hi + 2 * m;
    const at::Half* sh = Half ? scale.f16 + n * scale.groups : nullptr;  // tile-major: group g's C channels at g C
    for (; blk < blocks; ++blk, p += q8_step_bytes<C, Six>() * kQ8Steps, xb += rows * kBlock, db += rows, hb += 2 * rows) {
      _mm_prefetch(reinterpret_cast<const char*>(p) + kAheadBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p) + kAheadBytes + 64, _MM_HINT_T0);
      const BlockBytes<C, Six> bytes(p);
      Vec s0, s1;
      if constexpr (Half && C == kChannels) {  // groups 2 blk and 2 blk + 1: 8 float16 side by side
        const __m256 both = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sh + 2 * blk * C)));
        s0 = spread4(_mm256_castps256_ps128(both));
        s1 = spread4(_mm256_extractf128_ps(both, 1));
      } else {
        s0 = q8_scales<Half, C>(scale, n, 2 * blk);
        s1 = q8_scales<Half, C>(scale, n, 2 * blk + 1);
      }
      for (int r = 0; r < R; ++r) {
        const Vec half0 = vmul(to_float(block_dot_q8<C, 0, kHalf, Six>(bytes, xb + r * kBlock, hb[2 * r])), s0);
        const Vec both = vfma(to_float(block_dot_q8<C, kHalf, 2 * kHalf, Six>(bytes, xb + r * kBlock, hb[2 * r + 1])), s1,
                              half0);
        acc[r] = vfma(both, vset1(db[r]), acc[r]);
      }
    }
    store_rows<R, C>(acc, m, n, y, N, bias);
    return;
  }
  if (blocks_per_group == 1) {  // GGUF Q8_0: a scale per block, folded into the block's activation scale
    for (; blk < a.blocks; ++blk, p += q8_step_bytes<C, Six>() * kQ8Steps) {
      _mm_prefetch(reinterpret_cast<const char*>(p) + kAheadBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p) + kAheadBytes + 64, _MM_HINT_T0);
      const BlockBytes<C, Six> bytes(p);
      const Vec scv = q8_scales<Half, C>(scale, n, blk);
      const int8_t* xb = a.xi + (blk * a.rows + m) * kBlock;
      const float* db = a.di + blk * a.rows + m;
      const int32_t* qb = a.qi + blk * a.rows + m;
      for (int r = 0; r < R; ++r)
        acc[r] = vfma(to_float(block_dot_q8(bytes, xb + r * kBlock, qb[r])), vmul(vset1(db[r]), scv), acc[r]);
    }
    store_rows<R, C>(acc, m, n, y, N, bias);
    return;
  }
  for (int64_t grp = 0; grp < scale.groups; ++grp) {
    Vec part[R];
    for (int r = 0; r < R; ++r) part[r] = vzero();
    for (const int64_t end = std::min(blk + blocks_per_group, a.blocks); blk < end; ++blk, p += q8_step_bytes<C, Six>() * kQ8Steps) {
      _mm_prefetch(reinterpret_cast<const char*>(p) + kAheadBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p) + kAheadBytes + 64, _MM_HINT_T0);
      const BlockBytes<C, Six> bytes(p);
      const int8_t* xb = a.xi + (blk * a.rows + m) * kBlock;
      const float* db = a.di + blk * a.rows + m;
      const int32_t* qb = a.qi + blk * a.rows + m;
      for (int r = 0; r < R; ++r) part[r] = vfma(to_float(block_dot_q8(bytes, xb + r * kBlock, qb[r])), vset1(db[r]), part[r]);
    }
    const Vec scv = q8_scales<Half, C>(scale, n, grp);
    for (int r = 0; r < R; ++r) acc[r] = vfma(part[r], scv, acc[r]);
  }
  store_rows<R, C>(acc, m, n, y, N, bias);
}

template <bool Half, int C, bool Six>
inline void rows_q8(const Int8Rows& a, int64_t M, const int8_t* wt, int64_t n, float* y, int64_t N,
                    const Q8Scales& scale, int64_t group_cols, const float* bias) {
#if defined(__AVX512F__)
  // 5-8 rows in one pass over the weights (4 rows, then the rest, streamed them twice): Q8_0's form
  // on 8B shapes (linear_stream.py, alternated twice) at 5 / 6 / 7 / 8 rows 21.2-22.3 / 23.3-24.4 /
  // 26.9-28.4 / 27.2 -> 19.9-20.3 / 20.7-21.8 / 19.9-20.5 / 21.6-21.8 ms per pass. AVX2's 16
  // registers hold 4.
  switch (M) {
    case 5: tile_q8<Half, 5, C, Six>(a, 0, wt, n, y, N, scale, group_cols, bias); return;
    case 6: tile_q8<Half, 6, C, Six>(a, 0, wt, n, y, N, scale, group_cols, bias); return;
    case 7: tile_q8<Half, 7, C, Six>(a, 0, wt, n, y, N, scale, group_cols, bias); return;
    case 8: tile_q8<Half, 8, C, Six>(a, 0, wt, n, y, N, scale, group_cols, bias); return;
    default: break;
  }
#endif
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) tile_q8<Half, kRows, C, Six>(a, m, wt, n, y, N, scale, group_cols, bias);
  switch (M - m) {
    case 3: tile_q8<Half, 3, C, Six>(a, m, wt, n, y, N, scale, group_cols, bias); break;
    case 2: tile_q8<Half, 2, C, Six>(a, m, wt, n, y, N, scale, group_cols, bias); break;
    case 1: tile_q8<Half, 1, C, Six>(a, m, wt, n, y, N, scale, group_cols, bias); break;
    default: break;
  }
}

template <int C, bool Six>
inline void channels_q8(const Int8Rows& a, int64_t M, const int8_t* wt, int64_t n, float* y, int64_t N,
                        const Q8Scales& scale, int64_t group_cols, const float* bias) {
  if (scale.f16) rows_q8<true, C, Six>(a, M, wt, n, y, N, scale, group_cols, bias);
  else rows_q8<false, C, Six>(a, M, wt, n, y, N, scale, group_cols, bias);
}

#if defined(__AVX512VNNI__)
#define FIVEFOLD_Q8_PANELS 1
// int8 weights from a few rows (AVX-512 VNNI): the panels above with int8 weights. tile_q8 converts
// and scales every block's sums per row and tile (2 vpdpbusd per conversion, FMA and broadcasts),
// so from 4 rows it ran compute-bound: on SmolLM2's shapes at 64 rows 1.7x slower than Q4_0's
// panels. Here a span's 8 steps of a tile (4 blocks x 2 steps of 16 columns) take the same dword
// transpose as the 4-bit codes, vector t = 4h + j holding in lane 4c + b channel c's bytes
// 4j..4j + 3 of step h of block b, i.e. columns 4t..4t + 3 of the block, as w + 128 (an XOR of the
// sign bit: vpdpbusd's unsigned operand); the 128 x sum(xq) this adds is folded out by each lane's
// starting value, -128 x the block's code sum (Int8PanelRows' code_offset). The lanes' scales (a
// channel's scale of block b's group) multiply d_b once per span and row. Groups of 16 (Halves,
// GGUF Q6_K): vectors 0-3 are a block's first 16 columns, 4-7 its second, each half summed from its
// own start and scaled by its own group's scale. AVX2 keeps tile_q8: the same panels with
// llama.cpp's sign trick (|w| and w kept, vpsignb + vpmaddubsw + vpmaddwd + vpaddd per vector and
// row) ran 8B shapes at 0.55x the tiles at 4 rows, 0.87x at 16 and 1.1-1.2x at 64 (AVX2 forced on
// Zen 4): the sign trick costs the panels what it costs the tiles, and the transposes are extra.
struct Q8Operands {
  Q8Scales scale;
  const float* bias;  // [N] or null
};

// Rows from which int8 weights take the panels (halves: groups of 16). Cold weights
// (benchmarks/linear_stream.py --shapes llama8b, stream-a8, float16 scales as the layers hold them,
// tiles against panels, two runs each, Zen 4), ms per pass: Q8_0's form 8 rows 27.0 against 30.0,
// 10 rows 34.3 against 33.0, 16 rows 51 against 41, 64 rows 185 against 105; Q6_K's 6 rows 28.7
// against 30.5, 8 rows 36.9 against 32.9, 16 rows 72 against 47, 64 rows 285 against 130 (tile_q8
// takes two dot products per block there). Below these the panels' transposes, not the weights'
// bytes, set their time (Q8_0's form at 4 rows: 25 ms against the tiles' 16.6). 6-bit weights
// (six): from 5 rows, where tile_q8 (4 rows a pass) streams the weights twice and unpacks them
// twice: Q6_K's form at 5 / 6 / 7 / 8 rows 30.1-30.2 / 28.7-31.7 / 29.1-35.6 / 29.9-38.8 ms on the
// panels against 32.0 / 35.0-35.8 / 40.0-40.2 / 43.1 on the tiles (alternated twice); at 4 rows
// the tiles 22.7-24.6 against the panels' 24.5-25.7.
inline int64_t q8_panel_min_rows(bool halves, bool six = false) { return six ? 5 : halves ? 8 : 10; }

// Six: 6-bit weights (q6_pack), unpacked to u = w + 32 before the transpose (code offset 32).
template <bool Halves, bool Six = false>
struct Int8WeightPanel {
  static constexpr int64_t kChunkSpans = 1024 / kSpanCols;  // 1024 columns: a tile's bytes 4 KB (3 KB in 6 bits)
  static constexpr int kRows = 4;                           // 8 int32 + 8 float accumulators, 2 weight vectors
  static constexpr int64_t kStep = q8_step_bytes<kChannels, Six>();
  using Rows = Int8PanelRows;
  IVec codes[kChunkSpans * kSpanVecs];
  Vec sv[kChunkSpans], sv2[Halves ? kChunkSpans : 1];  // the lanes' scales (sv2: of the second halves)
  static int64_t tile_bytes(int64_t K) { return K / kWidth * kStep; }
  void build(const uint8_t* wt, int64_t blocks, int64_t n, int64_t s0, int64_t ns, const Q8Operands& o,
             int64_t group_cols) {
    const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t s = 0; s < ns; ++s) {
      const int64_t blk0 = (s0 + s) * kSpanBlocks;
      const uint8_t* span_bytes = wt + blk0 * kQ8Steps * kStep;
      for (int64_t line = 0; line < kSpanBlocks * kQ8Steps * kStep / 64; ++line)  // the next chunk's span: 8 (6) cache lines
        _mm_prefetch(reinterpret_cast<const char*>(span_bytes) + kAheadBytes + 64 * line, _MM_HINT_T0);
      for (int64_t h = 0; h < kQ8Steps; ++h) {
        __m512i r[kSpanBlocks], q[4];
        for (int64_t b = 0; b < kSpanBlocks; ++b) {
          const uint8_t* step = wt + ((blk0 + b) * kQ8Steps + h) * kStep;
          r[b] = blk0 + b >= blocks ? _mm512_setzero_si512() : Six ? six_load(step) : _mm512_loadu_si512(step);
        }
        transpose_dwords(r, q);
        for (int j = 0; j < 4; ++j) codes[s * kSpanVecs + 4 * h + j] = Six ? q[j] : _mm512_xor_si512(q[j], sign);
      }
      sv[s] = span_scales(o.scale, n, blk0, blocks, group_cols, 0);
      if constexpr (Halves) sv2[s] = span_scales(o.scale, n, blk0, blocks, group_cols, 1);
    }
  }
  // Lane 4c + b: channel n + c's scale for block blk0 + b (its half `half` with groups of 16), 0 past
  // K. Permutes of the float16 tile-major table, gathers from the float32 one: built from scalars
  // (c10's float16 conversion, a store, a load) the panels took 60 us for 4 rows of 1536 x 576 in
  // cache (Q8_0's form), against 43 us this way.
  static Vec span_scales(const Q8Scales& sc, int64_t n, int64_t blk0, int64_t blocks, int64_t group_cols, int half) {
    const int64_t nb = std::min<int64_t>(kSpanBlocks, blocks - blk0);
    const __mmask16 live = static_cast<__mmask16>(0x1111 * ((1u << nb) - 1));
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i c = _mm512_srli_epi32(lane, 2), b = _mm512_and_si512(lane, _mm512_set1_epi32(3));
    const bool halves = group_cols == kBlock / 2, per_block = group_cols == kBlock, one = sc.groups == 1;
    if (sc.f16 && (halves || per_block)) {
      // groups from g0 = blk0 (or 2 blk0), kChannels values each: element 4 (group - g0) + c
      const int64_t g0 = halves ? 2 * blk0 : blk0, have = std::min<int64_t>(2 * kWidth, (sc.groups - g0) * kChannels);
      const at::Half* p = sc.f16 + n * sc.groups + g0 * kChannels;
      const auto part = [&](int64_t from) {
        const int64_t k = std::clamp<int64_t>(have - from, 0, kWidth);
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << k) - 1), p + from));
      };
      const __m512i index = halves ? _mm512_add_epi32(_mm512_slli_epi32(b, 3), _mm512_add_epi32(c, _mm512_set1_epi32(4 * half)))
                                   : _mm512_add_epi32(_mm512_slli_epi32(b, 2), c);
      return _mm512_maskz_permutex2var_ps(live, part(0), index, part(kWidth));
    }
    if (!sc.f16 && (halves || per_block || one)) {
      const __m512i group = one ? _mm512_setzero_si512()
                          : halves ? _mm512_add_epi32(_mm512_slli_epi32(b, 1), _mm512_set1_epi32(static_cast<int32_t>(2 * blk0 + half)))
                                   : _mm512_add_epi32(b, _mm512_set1_epi32(static_cast<int32_t>(blk0)));
      const __m512i index = _mm512_add_epi32(_mm512_mullo_epi32(c, _mm512_set1_epi32(static_cast<int32_t>(sc.groups))), group);
      return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, index, sc.f32 + n * sc.groups, 4);
    }
    alignas(64) float lanes[kWidth] = {};  // other group sizes (and float16 per channel): rare, scalars
    for (int ci = 0; ci < kChannels; ++ci)
      for (int64_t bi = 0; bi < nb; ++bi) {
        const int64_t grp = halves ? 2 * (blk0 + bi) + half : (blk0 + bi) * kBlock / group_cols;
        lanes[kSpanBlocks * ci + bi] = sc.f16 ? static_cast<float>(sc.f16[n * sc.groups + grp * kChannels + ci])
                                              : sc.f32[(n + ci) * sc.groups + grp];
      }
    return vload(lanes);
  }
  template <int R, int T, bool Symmetric>
  static void rows(const Rows& a, int64_t m, int64_t s0, int64_t ns, const Int8WeightPanel* p, Vec (&f)[R][T]) {
    if constexpr (!Halves) {
      Int8Panel::rows<R, T, true>(a, m, s0, ns, p, f);
    } else {  // groups of 16: each half's 4 vectors from its own start (a.init, a.init2), scaled by sv, sv2
      // the dot products as Int8Panel::rows's, per half: one helper for both ran Q8_0's form on 8B
      // shapes at 64 rows in 121 ms a pass against 106-108 (alternated twice), so the loop is twice
      for (int64_t s = 0; s < ns; ++s) {
        const int64_t span = s0 + s;
        const int32_t* x[R];
        for (int r = 0; r < R; ++r) x[r] = a.xr.data() + ((m + r) * a.spans + span) * kSpanVecs * kSpanBlocks;
        for (int half = 0; half < 2; ++half) {
          const int32_t* start = (half ? a.init2 : a.init).data();
          __m512i i[R][T];
          for (int r = 0; r < R; ++r) {
            const __m512i init = bcast4(start + ((m + r) * a.spans + span) * kSpanBlocks);
            for (int tt = 0; tt < T; ++tt) i[r][tt] = init;
          }
          for (int64_t t = 4 * half; t < 4 * half + 4; ++t) {
            __m512i w[T];
            for (int tt = 0; tt < T; ++tt) w[tt] = p[tt].codes[s * kSpanVecs + t];
            for (int r = 0; r < R; ++r) {
              const __m512i xt = bcast4(x[r] + t * kSpanBlocks);
              for (int tt = 0; tt < T; ++tt) i[r][tt] = _mm512_dpbusd_epi32(i[r][tt], w[tt], xt);
            }
          }
          for (int r = 0; r < R; ++r) {
            const Vec d = bcast_span(a.dv.data() + ((m + r) * a.spans + span) * kSpanBlocks);
            for (int tt = 0; tt < T; ++tt)
              f[r][tt] = vfma(_mm512_cvtepi32_ps(i[r][tt]), _mm512_mul_ps(d, half ? p[tt].sv2[s] : p[tt].sv[s]), f[r][tt]);
          }
        }
      }
    }
  }
};
#endif
#endif

// Each row's blocks of kBlock columns to int8: d = amax / 127, q = round(x / d) (ties to even),
// as fivefold/models/int8_primitives.py's quantize_activations computes them. x [M, K] -> xq [M, K],
// d [M, K / kBlock]. Compiled without -ffast-math: it may turn x / d into x * (1 / d), which rounds
// differently at ties, and a test compares the bytes with the reference's.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
// One block of 32: its scale, its codes.
inline float quantize_block(const float* xb, int8_t* qb) {
#if defined(__AVX512F__)
  const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float scale = amax / 127.f;
  if (scale > 0.f) {  // cvtps rounds to nearest even (MXCSR's default); |x / scale| <= 127 already
    const __m512 s = _mm512_set1_ps(scale);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_div_ps(a, s))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_div_ps(b, s))));
  } else {
    std::memset(qb, 0, kBlock);
  }
  return scale;
#elif defined(__AVX2__)
  const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) m = _mm256_max_ps(m, _mm256_and_ps(v[i] = _mm256_loadu_ps(xb + 8 * i), mask));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float scale = _mm_cvtss_f32(h) / 127.f;
  if (scale > 0.f) {
    const __m256 s = _mm256_set1_ps(scale);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_div_ps(v[i], s));
    // packs work within 128-bit lanes: [a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7], then put in order
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  } else {
    std::memset(qb, 0, kBlock);
  }
  return scale;
#else
  float amax = 0.f;
  for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
  const float scale = amax / 127.f;
  for (int64_t j = 0; j < kBlock; ++j)
    qb[j] = scale > 0.f ? static_cast<int8_t>(std::nearbyint(std::clamp(xb[j] / scale, -127.f, 127.f))) : 0;
  return scale;
#endif
}

void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* d) {
  const int64_t blocks = M * (K / kBlock);
#pragma omp parallel for schedule(static) if (blocks > 2048)
  for (int64_t b = 0; b < blocks; ++b) d[b] = quantize_block(x + b * kBlock, xq + b * kBlock);
}
#pragma GCC pop_options

// Each row's sum of codes per block, qsum [M, blocks], and over each group of the dequantized
// activations, d * q, divided by kLanes (tile_a8 adds offset * xsum to each of a channel's kLanes
// lanes), xsum [M, groups].
void int8_group_sums(const int8_t* xq, const float* d, int64_t M, int64_t K, int64_t group_cols, int32_t* qsum,
                     float* xsum) {
  const int64_t blocks = K / kBlock, groups = (K + group_cols - 1) / group_cols;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) xsum[m * groups + g] = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {
      int sum = 0;
      for (int64_t j = 0; j < kBlock; ++j) sum += xq[(m * blocks + b) * kBlock + j];
      qsum[m * blocks + b] = sum;
      xsum[m * groups + b * kBlock / group_cols] += d[m * blocks + b] * static_cast<float>(sum) / kLanes;
    }
  }
}

void check_layout(const torch::Tensor& w, const char* op) {
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kWidth && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), op,
              ": the weight must come from this build's int4_pack (uint8 [N, K/", kStepCols, ", ", kWidth, "]), got ",
              w.scalar_type(), " ", w.sizes());
}

// The group size that `groups` groups of K columns have (see the top), or 0 if none fits.
int64_t group_columns(int64_t K, int64_t groups) {
  if (groups <= 0) return 0;
  int64_t g = 1;
  while (g < (K + groups - 1) / groups) g *= 2;
  return (g % kStepCols == 0 && (K + g - 1) / g == groups) ? g : 0;
}

}  // namespace

// q: uint8 [N, K] of values 0..15 (K a multiple of 2W) -> uint8 [N, K / 2W, W] in the kernel's
// layout (see the top: two columns per byte, tile-major; the N % C rows left over form one
// narrower tile). One pass over q, tiles spread over the threads, instead of torch's pairing and
// then relayout's strided copy: a GGUF load packs 7 G codes this way. Zen 4, 2 threads, 14336 x
// 4096: 52-55 -> 43 ms against the torch ops (alternated builds), 12.8 ms on fresh memory. Most of
// its time is the faults of its output's huge pages, which compact memory once it is fragmented.
torch::Tensor int4_pack(torch::Tensor q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kUInt8, "int4_pack: expects uint8 [N, K], got ",
              q.scalar_type(), " ", q.sizes());
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(K % kStepCols == 0, "int4_pack: K (", K, ") must be a multiple of ", kStepCols);
  const torch::Tensor src = q.contiguous();
  auto out = empty_on_huge_pages({N, K / kStepCols, kWidth}, q.options());
  const int64_t steps = K / kStepCols, tiles = (N + kChannels - 1) / kChannels;
  const uint8_t* in = src.data_ptr<uint8_t>();
  uint8_t* packed = out.data_ptr<uint8_t>();
  std::atomic<bool> out_of_range{false};
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    uint8_t seen = 0;  // every value OR-ed: above 15 iff one of them is
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kChannels, C = std::min<int64_t>(kChannels, N - n0);
      uint8_t* dst = packed + n0 * steps * kWidth;
      for (int64_t s = 0; s < steps; ++s)
        for (int64_t c = 0; c < C; ++c, dst += kWidth) {
          const uint8_t* lo = in + (n0 + c) * K + s * kStepCols;
          for (int64_t i = 0; i < kWidth; ++i) {
            dst[i] = static_cast<uint8_t>(lo[i] | (lo[kWidth + i] << 4));
            seen |= lo[i] | lo[kWidth + i];
          }
        }
    }
    if (seen > 15) out_of_range = true;
  });
  TORCH_CHECK(!out_of_range, "int4_pack: values must be in 0..15");
  return out;
}

// The inverse: -> uint8 [N, K] of values 0..15, row-major.
torch::Tensor int4_unpack(torch::Tensor w) {
  check_layout(w, "int4_unpack");
  const int64_t N = w.size(0), steps = w.size(1);
  auto bytes = torch::empty({N, steps * kWidth}, w.options());
  relayout(bytes, w, kChannels, /*to_packed=*/false);
  const auto b = bytes.view({N, steps, 1, kWidth});
  return torch::cat({b.bitwise_and(15), b.bitwise_right_shift(4)}, 2).view({N, steps * kStepCols});
}

// Group scales or offsets [N, groups] (float16) -> the same shape in the kernel's tile-major order
// (and back with to_packed = false).
torch::Tensor int4_pack_groups(torch::Tensor s, bool to_packed) {
  TORCH_CHECK(s.dim() == 2, "int4_pack_groups: expects [N, groups], got ", s.sizes());
  const torch::Tensor src = s.to(torch::kHalf).contiguous();
  auto out = torch::empty_like(src);
  if (to_packed) relayout(src, out.view({s.size(0), s.size(1), 1}), kChannels, true);
  else relayout(out, src.view({s.size(0), s.size(1), 1}), kChannels, false);
  return out;
}

namespace {

// One call's scratch (quantized rows, their scales and sums), carved from a buffer each thread
// keeps across calls: a decode step makes ~120 calls whose scratch is a few KB, and four
// torch::empty per call (allocator, TensorImpl, posix_memalign) cost ~5% of a SmolLM2 token on
// Zen 4 (perf). Requests above kScratchKeep bytes (prefill sizes) get a temporary tensor, so a
// thread never holds more than that. A call takes its pieces before running; the one nested
// taker (run_int8's fallback without integer dot products, into run_float) is done with the
// outer pieces before it takes its own, so one buffer per thread is enough.
constexpr int64_t kScratchKeep = 1 << 20;
constexpr int64_t kScratchAlign = 64;

class Scratch {
 public:
  explicit Scratch(int64_t bytes) {
    if (bytes > kScratchKeep) {
      temporary_ = torch::empty({bytes + kScratchAlign}, torch::TensorOptions().dtype(torch::kUInt8));
      base_ = temporary_.data_ptr<uint8_t>();
    } else {
      thread_local std::vector<uint8_t> kept;
      if (static_cast<int64_t>(kept.size()) < bytes + kScratchAlign) kept.resize(bytes + kScratchAlign);
      base_ = kept.data();
    }
    base_ += (kScratchAlign - reinterpret_cast<uintptr_t>(base_) % kScratchAlign) % kScratchAlign;
  }
  // The bytes `take` will hand out for n values of T (rounded up to the alignment).
  template <typename T>
  static int64_t size(int64_t n) { return (n * static_cast<int64_t>(sizeof(T)) + kScratchAlign - 1) / kScratchAlign * kScratchAlign; }
  template <typename T>
  T* take(int64_t n) {
    T* out = reinterpret_cast<T*>(base_);
    base_ += size<T>(n);
    return out;
  }

 private:
  torch::Tensor temporary_;
  uint8_t* base_;
};

// The checked operands of a call on weights w (int4_pack's layout) of K columns.
Operands checked_operands(const char* op, const torch::Tensor& w, int64_t K, const torch::Tensor& scale,
                          const c10::optional<torch::Tensor>& offset_opt, const c10::optional<torch::Tensor>& bias_opt,
                          torch::Tensor& offset, torch::Tensor& bias, int64_t& group_cols) {
  const int64_t N = w.size(0);
  if (scale.scalar_type() == torch::kUInt8) {  // Q4_K's two levels (see kLevelBytes)
    constexpr int64_t row_bytes = kLevelBytes / kChannels;
    TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && N % kChannels == 0 && scale.is_contiguous() &&
                    scale.size(1) % row_bytes == 0 && scale.size(1) / row_bytes * kLevelGroups * kBlock == K,
                op, ": two-level scales must be uint8 [N, K / 256 x ", row_bytes, "] with N a multiple of ", kChannels,
                " (pack_levels), got ", scale.sizes(), " for N = ", N, ", K = ", K);
    TORCH_CHECK(!(offset_opt.has_value() && offset_opt->defined()), op, ": two-level scales hold their minimums");
    if (bias_opt.has_value() && bias_opt->defined() && bias_opt->numel() > 0) {
      bias = bias_opt->to(torch::kFloat32).contiguous();
      TORCH_CHECK(bias.numel() == N, op, ": bias must have ", N, " elements");
    }
    group_cols = kBlock;
    Operands o{nullptr, nullptr, nullptr, nullptr, nullptr, bias.defined() ? bias.data_ptr<float>() : nullptr,
               K / kBlock, kBlock / kStepCols, K / kStepCols};
    o.levels = scale.data_ptr<uint8_t>();
    return o;
  }
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && scale.scalar_type() == torch::kHalf && scale.is_contiguous(),
              op, ": scale must be float16 [", N, ", groups] from int4_pack_groups, got ", scale.sizes());
  const int64_t groups = scale.size(1);
  group_cols = group_columns(K, groups);
  TORCH_CHECK(group_cols > 0, op, ": ", groups, " groups do not split K = ", K,
              " into groups of a power of two columns, a multiple of ", kStepCols);
  if (offset_opt.has_value() && offset_opt->defined()) {
    offset = *offset_opt;
    TORCH_CHECK(offset.sizes() == scale.sizes() && offset.scalar_type() == torch::kHalf && offset.is_contiguous(),
                op, ": offset must be float16 shaped like scale");
  }
  if (bias_opt.has_value() && bias_opt->defined() && bias_opt->numel() > 0) {
    bias = bias_opt->to(torch::kFloat32).contiguous();
    TORCH_CHECK(bias.numel() == N, op, ": bias must have ", N, " elements");
  }
  return Operands{scale.data_ptr<at::Half>(), offset.defined() ? offset.data_ptr<at::Half>() : nullptr,
                  /*xsum=*/nullptr, /*xp=*/nullptr, /*xd=*/nullptr, bias.defined() ? bias.data_ptr<float>() : nullptr,
                  groups, group_cols / kStepCols, K / kStepCols};
}

// Every tile of the weight (threads split the tiles) against all M rows: body(C, byte offset of the
// tile, n) with C the tile's channels as a template constant; channel_bytes: K / 2 for 4-bit codes,
// K for int8 weights.
template <typename Body>
void for_each_tile(int64_t N, int64_t channel_bytes, int64_t K, Body&& body) {
  const int64_t tile_bytes = channel_bytes, num_tiles = N / kChannels;  // bytes per channel; full tiles
#pragma omp parallel for schedule(static) if (N * K > (1 << 15))
  for (int64_t t = 0; t < num_tiles; ++t) body(std::integral_constant<int, kChannels>{}, t * kChannels * tile_bytes, t * kChannels);
  const int64_t n = num_tiles * kChannels;
  switch (N - n) {  // the narrower last tile
    case 3: body(std::integral_constant<int, 3>{}, n * tile_bytes, n); break;
    case 2: body(std::integral_constant<int, 2>{}, n * tile_bytes, n); break;
    case 1: body(std::integral_constant<int, 1>{}, n * tile_bytes, n); break;
    default: break;
  }
}

#if defined(FIVEFOLD_FLOAT_PANELS) && defined(__AVX512F__)
#define FIVEFOLD_INT4_FLOAT_PANELS 1
// W4A16 from float_panel_min_rows(K) rows with AVX-512: panels.h's float panels. Columns [k0, k0 + cols)
// of the channels [n0, n0 + fpanel::kLanes) (whole tiles) as floats scale * q + offset into
// buf [cols][fpanel::kLanes]: a step's low and high nibbles are its first W columns and its next W,
// each laid out as an int8 step is (byte W c + j: channel c, column j), so they take the int8
// weights' transposes (TileColumns). A step lies in one group. Zen 4, best of 7 against FloatPanel
// below: SmolLM2's 3072 x 576 in groups of 32 at 8 and 12 rows 1.1-1.3x; Llama-3-8B's 6144 x 4096
// in groups of 128 at 8 rows alike, 10-14 rows 1.03-1.1x, 16 rows 1.1x. With AVX2 the widening
// (8 x 8 transposes of floats) made them 0.75-0.95x FloatPanel at 8-16 rows and no faster at 64,
// so AVX2 keeps FloatPanel.
// The vpermt2b index that turns column kk of a quad (its 128-bit lane kk) into float bits: lane c
// (channel c) takes byte 16 kk + c as its byte 2, and bytes 0, 1 and 3 of the second source.
inline __m512i place_bytes(int kk) {
  alignas(64) uint8_t b[64];
  for (int c = 0; c < 16; ++c) {
    b[4 * c + 0] = 64 + 0;
    b[4 * c + 1] = 64 + 1;
    b[4 * c + 2] = static_cast<uint8_t>(16 * kk + c);
    b[4 * c + 3] = 64 + 3;
  }
  return _mm512_load_si512(b);
}

inline void int4_panel_widen(const uint8_t* w, int64_t K, int64_t n0, int64_t k0, int64_t cols, const Operands& o,
                             int64_t group_cols, float* buf) {
  constexpr int64_t kLanes = fpanel::kLanes;
  const int64_t channel_bytes = K / 2, tile_bytes = kChannels * channel_bytes, groups = o.groups;
  static const fpanel::TileColumns columns;
  // the 4 tiles' (16 channels') float16 values of group grp from tile-major [N, groups], as floats
  const auto four_tiles = [&](const at::Half* base, int64_t n, int64_t grp) {
    int64_t h[4];
    for (int t = 0; t < 4; ++t) std::memcpy(&h[t], base + (n + kChannels * t) * groups + grp * kChannels, 8);
    return _mm512_cvtph_ps(_mm256_setr_epi64x(h[0], h[1], h[2], h[3]));
  };
  // Each code q goes straight into the mantissa of a float: bits 19-22 under the exponent of 1.0
  // make exactly 1 + q / 16, so w = s q + o = (16 s) f + (o - 16 s), one FMA. The codes are shifted
  // to bits 3-6 of their byte with bit 7 set (byte 2 of 0x3F800000 is 0x80), and one vpermt2b per
  // column puts the 16 channels' bytes in byte 2 of their lanes, between bytes 0, 0 and 0x3F of
  // `one`: no extract, zero extension or conversion per column. The constant o - 16 s is rounded
  // once: an error of at most 2^-24 |o - 16 s| per weight, float32's own rounding of w times a few.
  static const __m512i place[4] = {place_bytes(0), place_bytes(1), place_bytes(2), place_bytes(3)};
  const __m512i one = _mm512_set1_epi32(0x3F800000), mask = _mm512_set1_epi8(0x78), top = _mm512_set1_epi8(-128);
  // Each step also prefetches the same step kAheadBlocks widenings on (fpanel::ahead): its codes,
  // scales and offsets.
  const fpanel::Ahead on = fpanel::ahead(k0, K);
  const int64_t next_n = on.panels * fpanel::kLanes, next_grp = (k0 + on.cols) / group_cols - k0 / group_cols;
  const int64_t next_bytes = next_n * channel_bytes + on.cols / 2 * kChannels;
  for (int64_t s = 0; s < cols / kStepCols; ++s) {
    const int64_t col = k0 + s * kStepCols, grp = col / group_cols;
    for (int half = 0; half < 2; ++half) {
      const int64_t n = n0 + 16 * half;
      const Vec sv = four_tiles(o.scale, n, grp);
      const Vec ov = o.offset ? four_tiles(o.offset, n, grp) : vmul(sv, vset1(-8.f));
      const Vec s16 = vmul(sv, vset1(16.f)), c16 = _mm512_sub_ps(ov, s16);
      const uint8_t* p = w + n * channel_bytes + col / kStepCols * kChannels * kWidth;
      __m512i a[4];
      for (int t = 0; t < 4; ++t) {
        a[t] = _mm512_loadu_si512(p + t * tile_bytes);
        _mm_prefetch(reinterpret_cast<const char*>(p + t * tile_bytes + next_bytes), _MM_HINT_T0);
        const int64_t at = (n + next_n + kChannels * t) * groups + (grp + next_grp) * kChannels;
        _mm_prefetch(reinterpret_cast<const char*>(o.scale + at), _MM_HINT_T0);
        if (o.offset) _mm_prefetch(reinterpret_cast<const char*>(o.offset + at), _MM_HINT_T0);
      }
      for (int nibble = 0; nibble < 2; ++nibble) {
        __m512i b[4];  // (q << 3) | 0x80 in every byte: 16-bit shifts, then the mask drops the neighbours' bits
        for (int t = 0; t < 4; ++t)
          b[t] = _mm512_ternarylogic_epi32(nibble ? _mm512_srli_epi16(a[t], 1) : _mm512_slli_epi16(a[t], 3), mask,
                                           top, 0xEA);  // (A & B) | C
        float* out = buf + (s * kStepCols + nibble * kWidth) * kLanes + 16 * half;
        columns.quads(b[0], b[1], b[2], b[3], [&](int j, __m512i bytes) {
          for (int kk = 0; kk < 4; ++kk) {
            const Vec f = _mm512_castsi512_ps(_mm512_permutex2var_epi8(bytes, place[kk], one));
            vstore(out + (4 * j + kk) * kLanes, vfma(f, s16, c16));
          }
        });
      }
    }
  }
}
#endif

#if defined(FIVEFOLD_INT4_FLOAT_PANELS)
// Rows from which float activations take the panels. The row tiles read a tile's codes again (from
// L1) for every kRows rows and end each pass with R x C horizontal sums: at K = 576 they trail the
// panels from 12 rows (SmolLM2's matrices, 0.75-0.95x), at K = 4096 they lead up to 16 rows
// (6144 x 4096 in groups of 128: 8-16 rows 183-191 GFLOP/s against 140-177) and tie at 20.
inline int64_t float_panel_min_rows(int64_t K) { return K >= 2048 ? 20 : kFloatPanelMinRows; }
#elif defined(FIVEFOLD_INT4_PANELS)
inline int64_t float_panel_min_rows(int64_t) { return kFloatPanelMinRows; }
#endif

// The W4A16 product of float32 rows xf [M, K].
torch::Tensor run_float(const torch::Tensor& xf, const torch::Tensor& w, Operands o, int64_t group_cols) {
  TORCH_CHECK(!o.levels, "int4_linear: two-level (Q4_K) scales need int8 activations on a CPU with AVX2");
  const int64_t M = xf.size(0), K = xf.size(1), N = w.size(0), groups = o.groups;
#if defined(FIVEFOLD_W4_SPLIT)
  // The row that tile_row would take (one left over by the row tiles below the float panels'
  // threshold, the last) goes through the integer digits instead, where its blocks of 32 columns
  // fall inside groups (groups of 16, which AVX2 also takes, stay on the float path).
  const bool split = M % kRows == 1 && M < float_panel_min_rows(K) && K % kBlock == 0 && group_cols % kBlock == 0;
#else
  const bool split = false;
#endif
  const int64_t split_bytes = split ? K / kBlock * kDigitBlock : 0, split_groups = split ? groups : 0;
  Scratch scratch(Scratch::size<float>(M * groups) + Scratch::size<int8_t>(split_bytes) + Scratch::size<float>(split_groups));
  float* const xsum = scratch.take<float>(M * groups);
  {
    const float* xp = xf.data_ptr<float>();
    float* sp = xsum;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t grp = 0; grp < groups; ++grp) {
        float sum = 0.f;  // vectorized (-ffast-math); a division per column cost more than the matmul
        for (int64_t k = grp * group_cols, end = std::min(K, k + group_cols); k < end; ++k) sum += xp[m * K + k];
        sp[m * groups + grp] = sum;
      }
  }
  o.xsum = xsum;
#if defined(FIVEFOLD_W4_SPLIT)
  if (split) {
    int8_t* const digits = scratch.take<int8_t>(split_bytes);
    float* const xd = scratch.take<float>(split_groups);
    digit_row(xf.data_ptr<float>() + (M - 1) * K, K, group_cols, digits, xd);
    o.xp = digits;
    o.xd = xd;
  }
#endif
  auto y = torch::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  int64_t n0 = 0;  // channels the panels did; the rest (an odd tile, the narrow last one) tile by tile
#if defined(FIVEFOLD_INT4_FLOAT_PANELS)
  if (M >= float_panel_min_rows(K)) {
    const int64_t panels = N / fpanel::kLanes;
    fpanel::run(xp, M, K, panels, yp, N, nullptr, o.bias, [&](int64_t p, int64_t k0, int64_t cols, float* buf) {
      int4_panel_widen(wp, K, p * fpanel::kLanes, k0, cols, o, group_cols, buf);
    });
    n0 = panels * fpanel::kLanes;
  }
#endif
#if defined(FIVEFOLD_INT4_PANELS)
  if (n0 == 0 && M >= float_panel_min_rows(K)) n0 = run_panels<FloatPanel, true>(FloatPanelRows(xp, M, K), M, K, wp, N, yp, o, group_cols);
#endif
  for_each_tile(N - n0, K / 2, K, [&](auto c, int64_t byte0, int64_t n) {
    channels<decltype(c)::value>(xp, M, K, wp + n0 * (K / 2) + byte0, n0 + n, yp, N, o);
  });
  return y;
}

// The W4A8 product of quantized rows (xq int8 [M, K], d float32 [M, K / kBlock]); scratch: where
// their sums go (the caller's, with room for run_int8_scratch's bytes).
#if defined(FIVEFOLD_A8)
// Whether tile_a8 takes any channels: all of them below the panels' rows, else those past the last
// pair of tiles. Only then are the rows laid out block-major (interleave_rows).
inline bool a8_tiles_run(int64_t M, int64_t N, int64_t group_cols) {
#if defined(FIVEFOLD_A8_PANELS)
  return tiles_beside_panels(M, N, a8_panel_min_rows(group_cols));
#else
  (void)M, (void)N, (void)group_cols;
  return true;
#endif
}
#endif

// The scratch bytes interleave_rows takes (halves: the half blocks' code sums too).
inline int64_t interleave_bytes(int64_t M, int64_t K, bool halves) {
  return Scratch::size<int8_t>(M * K) + Scratch::size<float>(M * (K / kBlock)) + Scratch::size<int32_t>(M * (K / kBlock)) +
         Scratch::size<int32_t>(halves ? 2 * M * (K / kBlock) : 0);
}

int64_t run_int8_scratch(int64_t M, int64_t K, int64_t N, int64_t groups, int64_t group_cols) {
  int64_t bytes = Scratch::size<float>(M * groups) + Scratch::size<int32_t>(M * (K / kBlock));
#if defined(FIVEFOLD_A8)
  if (a8_tiles_run(M, N, group_cols)) bytes += interleave_bytes(M, K, false);
#else
  (void)N, (void)group_cols;
#endif
  return bytes;
}

#if defined(FIVEFOLD_A8)
// a's rows block-major (the R rows of a block adjacent, so that one pointer per stream walks them)
// into a.xi and a.di, from scratch; with code_sums (tile_q8) each block's code sums into a.qi (and
// the half blocks' into a.hi where a has them), else (tile_a8) the symmetric codes' starts into a.ci.
inline void interleave_rows(Int8Rows& a, int64_t M, Scratch& scratch, bool code_sums) {
  const int64_t blocks = a.blocks;
  int8_t* xi = scratch.take<int8_t>(M * a.K);
  float* di = scratch.take<float>(M * blocks);
  int32_t* sums = scratch.take<int32_t>(M * blocks);
  int32_t* hi = code_sums && a.half_qsum ? scratch.take<int32_t>(2 * M * blocks) : nullptr;
  for (int64_t blk = 0; blk < blocks; ++blk)
    for (int64_t m = 0; m < M; ++m) {
      const int64_t from = m * blocks + blk, to = blk * M + m;
      std::memcpy(xi + to * kBlock, a.xq + m * a.K + blk * kBlock, kBlock);
      di[to] = a.d[from];
      sums[to] = code_sums ? a.qsum[from] : -(8 / kLanes) * a.qsum[from];
      if (hi) {
        hi[2 * to] = a.half_qsum[2 * from];
        hi[2 * to + 1] = a.half_qsum[2 * from + 1];
      }
    }
  a.xi = xi;
  a.di = di;
  (code_sums ? a.qi : a.ci) = sums;
  a.hi = hi;
  a.rows = M;
}
#endif

torch::Tensor run_int8(const int8_t* xq, const float* d, int64_t M, int64_t K, const torch::Tensor& w, Operands o,
                       int64_t group_cols, Scratch& scratch) {
  const int64_t N = w.size(0);
  const auto options = torch::TensorOptions().dtype(torch::kFloat32);
#if defined(FIVEFOLD_A8)
  float* const xsum = scratch.take<float>(M * o.groups);
  int32_t* const qsum = scratch.take<int32_t>(M * (K / kBlock));
  int8_group_sums(xq, d, M, K, group_cols, qsum, xsum);
  auto y = torch::empty({M, N}, options);
  Int8Rows a{xq, d, qsum, xsum, K, K / kBlock, o.groups};
  if (a8_tiles_run(M, N, group_cols)) interleave_rows(a, M, scratch, /*code_sums=*/false);
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  int64_t n0 = 0;  // channels the panels did; the rest (an odd tile, the narrow last one) tile by tile
#if defined(FIVEFOLD_A8_PANELS)
  if (M >= a8_panel_min_rows(group_cols)) {
    const bool minimum = o.offset || o.levels;
    const Int8PanelRows rows(a, M, /*code_offset=*/minimum ? 0 : 8);
    n0 = minimum ? run_panels<Int8Panel, false>(rows, M, K, wp, N, yp, o, group_cols)
                  : run_panels<Int8Panel, true>(rows, M, K, wp, N, yp, o, group_cols);
  }
#endif
  for_each_tile(N - n0, K / 2, K, [&](auto c, int64_t byte0, int64_t n) {
    channels_a8<decltype(c)::value>(a, M, wp + n0 * (K / 2) + byte0, n0 + n, yp, N, o);
  });
  return y;
#else  // no integer dot product in this build: the same numbers through the float path
  (void)scratch;
  const torch::Tensor codes = torch::from_blob(const_cast<int8_t*>(xq), {M, K / kBlock, kBlock}, options.dtype(torch::kInt8));
  const torch::Tensor scales = torch::from_blob(const_cast<float*>(d), {M, K / kBlock, 1}, options);
  return run_float((codes.to(torch::kFloat32) * scales).view({M, K}), w, o, group_cols);
#endif
}

void check_int8_shapes(const char* op, int64_t K, int64_t group_cols) {
  TORCH_CHECK(K % kBlock == 0 && group_cols % kBlock == 0, op, ": int8 activations need K (", K,
              ") and the group size (", group_cols, ") to be multiples of ", kBlock);
}

}  // namespace

// x: [M, K] float32 or bfloat16; w: int4_pack's layout; scale, offset: int4_pack_groups's layout
// (float16 [N, groups], K / groups a multiple of 2W); offset None: symmetric (q - 8); or scale uint8
// [N, K / 256 x 20], Q4_K's two levels in pack_levels' layout (offset None, int8 activations only,
// N a multiple of 4); bias: [N] or None. int8_activations: quantize each row per block of 32 columns and multiply with integer dot
// products (W4A8, see above); else the float path (W4A16). Returns [M, N] in x's dtype.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale,
                          const c10::optional<torch::Tensor>& offset_opt, const c10::optional<torch::Tensor>& bias_opt,
                          bool int8_activations) {
  check_layout(w, "int4_linear");
  const int64_t N = w.size(0), K = w.size(1) * kStepCols;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "int4_linear: shapes do not match, x ", x.sizes(), " for K = ", K);
  const auto out_dtype = x.scalar_type();
  TORCH_CHECK(out_dtype == torch::kFloat32 || out_dtype == torch::kBFloat16,
              "int4_linear: activations must be float32 or bfloat16, got ", out_dtype);
  torch::Tensor offset, bias;
  int64_t group_cols = 0;
  Operands o = checked_operands("int4_linear", w, K, scale, offset_opt, bias_opt, offset, bias, group_cols);
  const torch::Tensor xf = x.to(torch::kFloat32).contiguous();
  const int64_t M = x.size(0);
  if (int8_activations) {
    check_int8_shapes("int4_linear", K, group_cols);
    Scratch scratch(Scratch::size<int8_t>(M * K) + Scratch::size<float>(M * (K / kBlock)) +
                    run_int8_scratch(M, K, N, o.groups, group_cols));
    int8_t* const xq = scratch.take<int8_t>(M * K);
    float* const d = scratch.take<float>(M * (K / kBlock));
    quantize_rows(xf.data_ptr<float>(), M, K, xq, d);
    const torch::Tensor y = run_int8(xq, d, M, K, w, o, group_cols, scratch);
    return out_dtype == torch::kFloat32 ? y : y.to(out_dtype);
  }
  return out_dtype == torch::kFloat32 ? run_float(xf, w, o, group_cols) : run_float(xf, w, o, group_cols).to(out_dtype);
}

// The weights as float32 [N, K], row-major (float activations at prefill sizes: a tile of channels
// dequantized here, then a float GEMM); w, scale, offset as int4_linear takes them.
torch::Tensor int4_dequantize(torch::Tensor w, torch::Tensor scale, const c10::optional<torch::Tensor>& offset_opt) {
  check_layout(w, "int4_dequantize");
  const int64_t N = w.size(0), K = w.size(1) * kStepCols;
  torch::Tensor offset, bias;
  int64_t group_cols = 0;
  const Operands o = checked_operands("int4_dequantize", w, K, scale, offset_opt, c10::nullopt, offset, bias, group_cols);
  TORCH_CHECK(!o.levels, "int4_dequantize: two-level (Q4_K) scales are not dequantized here");
  auto out = torch::empty({N, K}, torch::TensorOptions().dtype(torch::kFloat32));
  float* op = out.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  for_each_tile(N, K / 2, K, [&](auto cc, int64_t byte0, int64_t n) {
    constexpr int C = decltype(cc)::value;
    const uint8_t* p = wp + byte0;
    int64_t s = 0;
    for (int64_t grp = 0; grp < o.groups; ++grp) {
      float sc[C], of[C];
      group_params<C>(o, n * o.groups, grp, sc, of);
      Dequant d[C];
      for (int c = 0; c < C; ++c) d[c] = Dequant(sc[c], of[c]);
      for (const int64_t end = std::min(s + o.steps, o.total_steps); s < end; ++s, p += C * kWidth)
        for (int c = 0; c < C; ++c) {
          Vec lo, hi;
          dequant(p + c * kWidth, d[c], lo, hi);
          float* row = op + (n + c) * K + s * kStepCols;
          vstore(row, lo);
          vstore(row + kWidth, hi);
        }
    }
  });
  return out;
}

// int8 weights (fivefold::stream_pack's layout of int8 [N, K], K a multiple of 32) with a float32
// scale per output channel ([N]) or per group of columns ([N, groups], GGUF Q8_0: 32, Q6_K: 16), times x
// [M, K] float32 quantized per row and block of 32 here (W8A8 dynamic, the way llama.cpp runs
// Q8_0): y = sum_groups scale * sum_blocks d * sum q xq, + bias.
torch::Tensor int8_weight_linear_a8(torch::Tensor x, torch::Tensor w, torch::Tensor scale,
                                    const c10::optional<torch::Tensor>& bias_opt) {
  const bool six = w.scalar_type() == torch::kUInt8;  // q6_pack's 6-bit form
  TORCH_CHECK(w.is_contiguous() && ((w.dim() == 3 && w.size(2) == kWidth && w.scalar_type() == torch::kInt8) ||
                                    (six && w.dim() == 2 && w.size(1) % 3 == 0)),
              "int8_weight_linear_a8: the weight must come from this build's stream_pack (int8 [N, Kp/", kWidth, ", ",
              kWidth, "]) or q6_pack (uint8 [N, 3K/4]), got ", w.scalar_type(), " ", w.sizes());
  const int64_t N = w.size(0), K = six ? w.size(1) / 3 * 4 : w.size(1) * kWidth;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && K % kBlock == 0, "int8_weight_linear_a8: x must be [M, ", K,
              "] with K a multiple of ", kBlock, ", got ", x.sizes());
  // float16 scales: int4_pack_groups' tile-major order; float32: row-major
  TORCH_CHECK(!six || N % kChannels == 0, "int8_weight_linear_a8: 6-bit weights need whole tiles of ", kChannels,
              " channels, got N = ", N);
  const bool half = scale.scalar_type() == torch::kHalf;
  const torch::Tensor sc = half ? scale.contiguous() : scale.to(torch::kFloat32).contiguous();
  TORCH_CHECK(sc.size(0) == N && (sc.dim() == 1 || (sc.dim() == 2 && K % sc.size(1) == 0 &&
                                                   ((K / sc.size(1)) % kBlock == 0 || K / sc.size(1) == kBlock / 2))) &&
                  (!half || sc.dim() == 2),
              "int8_weight_linear_a8: scale must be float32 [", N, "] or [", N, ", groups] (float16 from int4_pack_groups)",
              " with groups of ", kBlock / 2, " columns or a multiple of ", kBlock, ", got ", scale.scalar_type(), " ",
              scale.sizes());
  const int64_t groups = sc.dim() == 1 ? 1 : sc.size(1), group_cols = K / groups;
  torch::Tensor bias;
  if (bias_opt.has_value() && bias_opt->defined() && bias_opt->numel() > 0) {
    bias = bias_opt->to(torch::kFloat32).contiguous();
    TORCH_CHECK(bias.numel() == N, "int8_weight_linear_a8: bias must have ", N, " elements");
  }
  const torch::Tensor xf = x.to(torch::kFloat32).contiguous();
  const int64_t M = x.size(0);
  const bool halves = group_cols == kBlock / 2;  // Q6_K: each half block's code sum too
#if defined(FIVEFOLD_Q8_PANELS)
  // the panels take the pairs of full tiles from q8_panel_min_rows; tile_q8 the rest
  const int64_t min_rows = q8_panel_min_rows(halves, six);
  const bool panels = M >= min_rows, tiles = tiles_beside_panels(M, N, min_rows);
#else
  const bool tiles = true;
#endif
  Scratch scratch(Scratch::size<int8_t>(M * K) + Scratch::size<float>(M * (K / kBlock)) + Scratch::size<float>(M) +
                  Scratch::size<int32_t>(M * (K / kBlock)) + Scratch::size<int32_t>(halves ? 2 * M * (K / kBlock) : 0) +
                  (tiles ? interleave_bytes(M, K, halves) : 0));
  int8_t* const xq = scratch.take<int8_t>(M * K);
  float* const d = scratch.take<float>(M * (K / kBlock));
  quantize_rows(xf.data_ptr<float>(), M, K, xq, d);
#if defined(FIVEFOLD_A8)
  float* const xsum = scratch.take<float>(M);
  int32_t* const qsum = scratch.take<int32_t>(M * (K / kBlock));
  int8_group_sums(xq, d, M, K, K, qsum, xsum);
  int32_t* half_qsum = nullptr;
  if (halves) {  // the VNNI path folds its +128 per half block
    half_qsum = scratch.take<int32_t>(2 * M * (K / kBlock));
    for (int64_t h = 0; h < 2 * M * (K / kBlock); ++h) {
      int32_t sum = 0;
      for (int64_t j = 0; j < kBlock / 2; ++j) sum += xq[h * (kBlock / 2) + j];
      half_qsum[h] = sum;
    }
  }
  Int8Rows a{xq, d, qsum, xsum, K, K / kBlock, 1, half_qsum};
  auto y = torch::empty({M, N}, xf.options());
  float* yp = y.data_ptr<float>();
  const int8_t* wp = static_cast<const int8_t*>(w.data_ptr());
  const Q8Scales sp{half ? nullptr : sc.data_ptr<float>(), half ? sc.data_ptr<at::Half>() : nullptr, groups};
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  int64_t n0 = 0;  // channels the panels did
#if defined(FIVEFOLD_Q8_PANELS)
  if (panels) {
    const Int8PanelRows rows(a, M, six ? q8_code_offset<true>() : q8_code_offset<false>(), halves);
    const Q8Operands o{sp, bp};
    const uint8_t* wb = reinterpret_cast<const uint8_t*>(wp);
    n0 = six ? (halves ? run_panels<Int8WeightPanel<true, true>, true>(rows, M, K, wb, N, yp, o, group_cols)
                       : run_panels<Int8WeightPanel<false, true>, true>(rows, M, K, wb, N, yp, o, group_cols))
             : (halves ? run_panels<Int8WeightPanel<true>, true>(rows, M, K, wb, N, yp, o, group_cols)
                       : run_panels<Int8WeightPanel<false>, true>(rows, M, K, wb, N, yp, o, group_cols));
  }
#endif
  if (tiles) {
    interleave_rows(a, M, scratch, /*code_sums=*/true);
    const int64_t channel_bytes = six ? 3 * K / 4 : K;
    for_each_tile(N - n0, channel_bytes, K, [&](auto c, int64_t byte0, int64_t n) {
      constexpr int C = decltype(c)::value;
      const int8_t* wt = wp + n0 * channel_bytes + byte0;
      if constexpr (C == kChannels) {
        if (six) channels_q8<C, true>(a, M, wt, n0 + n, yp, N, sp, group_cols, bp);
        else channels_q8<C, false>(a, M, wt, n0 + n, yp, N, sp, group_cols, bp);
      } else {  // 6-bit weights have no narrower tile (checked above)
        channels_q8<C, false>(a, M, wt, n0 + n, yp, N, sp, group_cols, bp);
      }
    });
  }
  return y;
#else
  TORCH_CHECK(false, "int8_weight_linear_a8: this build has no integer dot product (AVX2 or AVX-512BW)");
#endif
}

// int8 weights in [-32, 31] (GGUF Q6_K's codes) from stream_pack's layout (int8 [N, K/W, W], N a
// multiple of 4 and K of 32) -> uint8 [N, 3K/4]: each step's byte vector of S = 4W bytes in 3S/4
// bytes, u = w + 32 as six_load reads it (see there). Served by int8_weight_linear_a8.
torch::Tensor q6_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kWidth && w.scalar_type() == torch::kInt8 && w.is_contiguous(),
              "q6_pack: the weight must come from this build's stream_pack (int8 [N, Kp/", kWidth, ", ", kWidth, "]), got ",
              w.scalar_type(), " ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1) * kWidth;
  TORCH_CHECK(N % kChannels == 0 && K % 32 == 0, "q6_pack: N must be a multiple of ", kChannels,
              " and K of 32, got [", N, ", ", K, "]");
  TORCH_CHECK(w.numel() == 0 || (w.min().item<int>() >= -32 && w.max().item<int>() <= 31),
              "q6_pack: 6-bit weights must lie in [-32, 31]");
  constexpr int64_t S = kChannels * kWidth;
  auto out = empty_on_huge_pages({N, 3 * K / 4}, w.options().dtype(torch::kUInt8));
  const int8_t* src = w.data_ptr<int8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t vectors = N * K / S;
#pragma omp parallel for schedule(static) if (vectors > 4096)
  for (int64_t v = 0; v < vectors; ++v) {
    const int8_t* in = src + v * S;
    uint8_t* o = dst + v * (3 * S / 4);
    const auto u = [&](int64_t i) { return static_cast<uint8_t>(in[i] + 32); };
    for (int64_t i = 0; i < S / 2; ++i) o[i] = static_cast<uint8_t>((u(i) & 15) | ((u(i + S / 2) & 15) << 4));
    for (int64_t i = 0; i < S / 4; ++i) {
      uint8_t top = 0;
      for (int64_t q = 0; q < 4; ++q) top |= static_cast<uint8_t>((u(i + q * S / 4) >> 4) << (2 * q));
      o[S / 2 + i] = top;
    }
  }
  return out;
}

// The inverse: uint8 [N, 3K/4] -> int8 [N, K/W, W] in stream_pack's layout.
torch::Tensor q6_unpack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.size(1) % 24 == 0,
              "q6_unpack: expects uint8 [N, 3K/4] from q6_pack, got ", w.scalar_type(), " ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1) / 3 * 4;
  constexpr int64_t S = kChannels * kWidth;
  auto out = torch::empty({N, K / kWidth, kWidth}, w.options().dtype(torch::kInt8));
  const uint8_t* src = w.data_ptr<uint8_t>();
  int8_t* dst = out.data_ptr<int8_t>();
  for (int64_t v = 0; v < N * K / S; ++v) {
    const uint8_t* in = src + v * (3 * S / 4);
    for (int64_t i = 0; i < S; ++i) {
      const int64_t q = i / (S / 4);
      const uint8_t nibble = i < S / 2 ? in[i] & 15 : in[i - S / 2] >> 4, top = (in[S / 2 + i % (S / 4)] >> (2 * q)) & 3;
      dst[v * S + i] = static_cast<int8_t>((nibble | (top << 4)) - 32);
    }
  }
  return out;
}

// The W4A8 product of activations already quantized: xq int8 [M, K], d float32 [M, K / 32] (one
// scale per block of 32 columns); the rest as int4_linear. For tests of the integer sums (d = 1,
// scale = 1: the result is the int64 dot product exactly) and for callers that quantize once.
torch::Tensor int4_linear_int8(torch::Tensor xq, torch::Tensor d, torch::Tensor w, torch::Tensor scale,
                               const c10::optional<torch::Tensor>& offset_opt,
                               const c10::optional<torch::Tensor>& bias_opt) {
  check_layout(w, "int4_linear_int8");
  const int64_t K = w.size(1) * kStepCols;
  TORCH_CHECK(xq.dim() == 2 && xq.size(1) == K && xq.scalar_type() == torch::kInt8, "int4_linear_int8: xq must be int8 [M, ",
              K, "], got ", xq.scalar_type(), " ", xq.sizes());
  torch::Tensor offset, bias;
  int64_t group_cols = 0;
  const Operands o = checked_operands("int4_linear_int8", w, K, scale, offset_opt, bias_opt, offset, bias, group_cols);
  check_int8_shapes("int4_linear_int8", K, group_cols);
  TORCH_CHECK(d.dim() == 2 && d.size(0) == xq.size(0) && d.size(1) == K / kBlock && d.scalar_type() == torch::kFloat32,
              "int4_linear_int8: d must be float32 [M, ", K / kBlock, "], got ", d.scalar_type(), " ", d.sizes());
  const torch::Tensor codes = xq.contiguous(), scales = d.contiguous();
  Scratch scratch(run_int8_scratch(codes.size(0), K, w.size(0), o.groups, group_cols));
  return run_int8(codes.data_ptr<int8_t>(), scales.data_ptr<float>(), codes.size(0), K, w, o, group_cols, scratch);
}

TORCH_LIBRARY_FRAGMENT(fivefold, m) {
  m.def("int4_pack(Tensor q) -> Tensor");
  m.def("int4_unpack(Tensor w) -> Tensor");
  m.def("int4_pack_groups(Tensor s, bool to_packed) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor w, Tensor scale, Tensor? offset, Tensor? bias, bool int8_activations=False) -> Tensor");
  m.def("int4_linear_int8(Tensor xq, Tensor d, Tensor w, Tensor scale, Tensor? offset, Tensor? bias) -> Tensor");
  m.def("int4_dequantize(Tensor w, Tensor scale, Tensor? offset) -> Tensor");
  m.def("int8_weight_linear_a8(Tensor x, Tensor w, Tensor scale, Tensor? bias) -> Tensor");
  m.def("q6_pack(Tensor w) -> Tensor");
  m.def("q6_unpack(Tensor w) -> Tensor");
}
TORCH_LIBRARY_IMPL(fivefold, CPU, m) {
  m.impl("int4_pack", &int4_pack);
  m.impl("int4_unpack", &int4_unpack);
  m.impl("int4_pack_groups", &int4_pack_groups);
  m.impl("int4_linear", &int4_linear);
  m.impl("int4_linear_int8", &int4_linear_int8);
  m.impl("int4_dequantize", &int4_dequantize);
  m.impl("int8_weight_linear_a8", &int8_weight_linear_a8);
  m.impl("q6_pack", &q6_pack);
  m.impl("q6_unpack", &q6_unpack);
}
