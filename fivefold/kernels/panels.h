// Float panels: the many-row (16+) product of quantized weights and float32 activations, shared by
// linear_stream.cpp (int8 weights, W8A16) and int4_linear.cpp (4-bit weights, W4A16). Everything
// here is in an anonymous namespace, private to the including file (each its own extension).
//
// As a GEMM does it, output channels are in the vector lanes: a panel of kLanes = 2 vectors of
// channels (32 with AVX-512, 16 with AVX2) x kCols columns is dequantized to float once, into
// buf[k][kLanes] (16 KB or 8 KB: L1), by the caller's `widen`, and every row multiplies it with one
// broadcast per column:
//   acc[r][0..1] += x[r][k] * buf[k][...]     (kRows x 2 accumulators, no horizontal sums)
// Between blocks of kCols columns a panel's partial sums wait in a per-thread buffer whose rows are
// kLanes floats apart. In y itself (rows N floats apart) they ran 10-13% slower wherever N x 4 bytes
// is a multiple of 4 KB (SmolLM2's gate_up N = 3072 and its 49,152-row head: every row's lines in
// one L1 set; Zen 4, 64 rows: 180 GFLOP/s against 204 at N = 3104).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {
namespace fpanel {

#if defined(__AVX512F__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define FIVEFOLD_FLOAT_PANELS 1
constexpr int kRows = 12;  // 12 x 2 accumulators of 32 registers
#elif defined(__AVX2__) && !defined(__AVX512F__)
#define FIVEFOLD_FLOAT_PANELS 1
constexpr int kRows = 6;   // 6 x 2 accumulators + 2 weight vectors + 1 broadcast of 16 registers
#endif

#if defined(FIVEFOLD_FLOAT_PANELS)
constexpr int64_t kLanes = 2 * kWidth;
constexpr int64_t kCols = 128;
constexpr int64_t kMinRows = 16;  // int8 weights at 8 rows: the row tiles 1.3x faster; 16: the panels 1.1x

#if defined(__AVX512F__)
// The transpose of 4 tiles' column steps. A step of a tile (64 bytes) holds its 4 channels' bytes of
// 16 columns, byte 16c + j for channel c, column j (stream_pack's int8 layout; a 4-bit step's low or
// high nibbles). For each column j, the 16 channels' bytes as one 128-bit vector, tile t's channel c
// in byte 4t + c: two vpermt2b and a blend gather 4 columns (idx_j: output byte q = kk * 16 + t * 4 + c
// takes byte c * 16 + 4j + kk of tile t, from the first source for even t, the second for odd t).
struct TileColumns {
  __m512i idx[4];
  __mmask64 odd_pair = 0;  // bytes of tiles 2 and 3
  TileColumns() {
    for (int j = 0; j < 4; ++j) {
      alignas(64) uint8_t b[64];
      for (int q = 0; q < 64; ++q) b[q] = static_cast<uint8_t>(((q / 4) % 2) * 64 + (q % 4) * 16 + 4 * j + q / 16);
      idx[j] = _mm512_load_si512(b);
    }
    for (int q = 0; q < 64; ++q)
      if ((q / 4) % 4 >= 2) odd_pair |= __mmask64{1} << q;
  }
  // quad(j, bytes) for j = 0..3: 128-bit lane kk of bytes holds column 4j + kk (byte 4t + c as above).
  template <class F>
  void quads(__m512i a0, __m512i a1, __m512i a2, __m512i a3, F&& quad) const {
    for (int j = 0; j < 4; ++j)
      quad(j, _mm512_mask_blend_epi8(odd_pair, _mm512_permutex2var_epi8(a0, idx[j], a1),
                                     _mm512_permutex2var_epi8(a2, idx[j], a3)));
  }
  // column(j, bytes) for j = 0..15.
  template <class F>
  void operator()(__m512i a0, __m512i a1, __m512i a2, __m512i a3, F&& column) const {
    quads(a0, a1, a2, a3, [&](int j, __m512i o) {
      column(4 * j + 0, _mm512_extracti32x4_epi32(o, 0));
      column(4 * j + 1, _mm512_extracti32x4_epi32(o, 1));
      column(4 * j + 2, _mm512_extracti32x4_epi32(o, 2));
      column(4 * j + 3, _mm512_extracti32x4_epi32(o, 3));
    });
  }
};
#else
// 8 channels' weights of 8 columns (v[c] = channel c) stored column by column: out[i * ld + c].
inline void store_transposed8(const __m256 v[8], float* out, int64_t ld) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {  // column i and i + 4 of the 8 channels
    vstore(out + i * ld, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
    vstore(out + (i + 4) * ld, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
  }
}
#endif

// R rows x the panel's `cols` columns of buf: xp holds the rows' activations column by column
// (xp[k R + r], see pack_rows), so one pointer serves every row. The partial sums start at zero
// (first) or from acc (rows kLanes apart); the last block writes y's channels [n, n + kLanes)
// (row stride N) as sum x scale + bias, the others write acc.
template <int R>
inline void rows(const float* xp, const float* buf, int64_t cols, float* acc, float* y, int64_t N, int64_t n,
                 bool first, bool last, const float* scale, const float* bias) {
  Vec s[R][2];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) s[r][v] = first ? vzero() : vload(acc + r * kLanes + v * kWidth);
  for (int64_t k = 0; k < cols; ++k, xp += R) {
    const Vec w0 = vload(buf + k * kLanes), w1 = vload(buf + k * kLanes + kWidth);
    for (int r = 0; r < R; ++r) {
      const Vec xv = vset1(xp[r]);
      s[r][0] = vfma(xv, w0, s[r][0]);
      s[r][1] = vfma(xv, w1, s[r][1]);
    }
  }
  if (!last) {
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 2; ++v) vstore(acc + r * kLanes + v * kWidth, s[r][v]);
    return;
  }
  for (int v = 0; v < 2; ++v) {
    const Vec sc = scale ? vload(scale + n + v * kWidth) : vset1(1.f);
    const Vec bi = bias ? vload(bias + n + v * kWidth) : vzero();
    for (int r = 0; r < R; ++r) vstore(y + r * N + n + v * kWidth, vfma(s[r][v], sc, bi));
  }
}

// rows<R> for R = r (1..kRows), chosen at run time.
template <int R = kRows>
inline void rows_of(int64_t r, const float* xp, const float* buf, int64_t cols, float* acc, float* y, int64_t N,
                    int64_t n, bool first, bool last, const float* scale, const float* bias) {
  if constexpr (R > 1)
    if (r < R) return rows_of<R - 1>(r, xp, buf, cols, acc, y, N, n, first, last, scale, bias);
  rows<R>(xp, buf, cols, acc, y, N, n, first, last, scale, bias);
}

// Rows per block of x that every panel passes over before the next block, so that the block's
// activations stay in L2 (Zen 3 has 512 KB per core, Zen 4 1 MB): about kBlockBytes of them, at
// least kMinBlockRows (a decode batch stays one block: a block of a few rows would widen every
// panel again for them), and blocks of equal size.
constexpr int64_t kBlockBytes = 512 << 10, kMinBlockRows = 64;

inline int64_t block_rows(int64_t M, int64_t K) {
  const int64_t most = std::max(kMinBlockRows, kBlockBytes / (4 * K));
  const int64_t blocks = (M + most - 1) / most;
  return std::min(M, ((M + blocks - 1) / blocks + kRows - 1) / kRows * kRows);
}

// A block's rows go in `groups` groups of equal size, at most kRows each (16 rows: 8 + 8; as 12 + 4
// they ran 0.96x, 28 rows as 12 + 12 + 4 0.94x: W8A16, 6144 x 4096, Zen 4); group i starts at row
// first_row(count, groups, i) of the block.
inline int64_t first_row(int64_t count, int64_t groups, int64_t i) {
  return i * (count / groups) + std::min(i, count % groups);
}

// Rows [m0, m0 + count) of x [M, K] into xp, group by group, each group column by column: group i's
// rows r0..r0 + R - 1 at xp + r0 K as [K][R]. Read in place, a group's rows are K floats apart; at
// K = 4096 or 14336 (a multiple of 4 KB) one column block's lines of all of them fall in the same L1
// sets, more rows than it has ways, and the broadcasts came from L2. Column by column, one pointer
// also serves all R rows: in place, the R row pointers did not fit the general registers once inlined
// (spilled to vector registers, a vmovq per broadcast). W8A16 on Llama-3-8B's matrices (Zen 4):
// 16 rows 150-153 -> 171-177 GFLOP/s, 64 rows 181 -> 203-209; with AVX2 forced 137-139 -> 151-156
// and 178 -> 188-195 (SmolLM2's K = 1536, no aliasing there: 0.97-0.98x). Threads split the columns.
inline void pack_rows(const float* x, int64_t K, int64_t m0, int64_t count, int64_t groups, float* xp) {
#pragma omp for schedule(static)
  for (int64_t k0 = 0; k0 < K; k0 += kCols)
    for (int64_t i = 0; i < groups; ++i) {
      const int64_t r0 = first_row(count, groups, i), R = first_row(count, groups, i + 1) - r0;
      const int64_t k1 = std::min(K, k0 + kCols);
      const float* src = x + (m0 + r0) * K;
      float* dst = xp + r0 * K + k0 * R;
      for (int64_t k = k0; k < k1; ++k)
        for (int64_t r = 0; r < R; ++r) *dst++ = src[r * K + k];
    }
}

// Where a thread's widening kAheadBlocks blocks after (its panel, columns from k0) reads: that many
// panels and columns on (a thread's panels are contiguous, schedule(static), each widened block by
// block). The widenings prefetch it. A panel's tiles are short streams at small K (a channel is K
// or K / 2 bytes) that the hardware prefetchers hardly ramp up on, and a decode step finds each
// layer's weights in DRAM: 16 rows of SmolLM2's 3072 x 576 with 48 weights in turn (none cached,
// Zen 4) took W4A16 441-453 us, 349-351 with 3-5 blocks ahead (364 with 1); W8A16 389-411 -> 366.
// At K = 4096 the hardware prefetchers keep up alone (24 rows of 6144 x 4096: the same with or
// without). The AVX-512 widenings prefetch; the AVX2 one does not (linear_stream.cpp says why).
constexpr int64_t kAheadBlocks = 4;
struct Ahead {
  int64_t panels, cols;
};
inline Ahead ahead(int64_t k0, int64_t K) {
  const int64_t blocks = (K + kCols - 1) / kCols, b = k0 / kCols + kAheadBlocks;
  return {b / blocks, b % blocks * kCols - k0};
}

// x [M, K] times the first `panels` panels of a weight (channels [0, panels x kLanes)) into y [M, N]
// (plus scale and bias per channel, either null). widen(p, k0, cols, buf) writes panel p's float
// weights of columns [k0, k0 + cols) into buf[cols][kLanes]. Per block of rows, the threads pack the
// rows (pack_rows), then split the panels.
template <class Widen>
void run(const float* x, int64_t M, int64_t K, int64_t panels, float* y, int64_t N, const float* scale,
         const float* bias, const Widen& widen) {
  const int64_t rows_per_block = block_rows(M, K);
  thread_local std::vector<float> packed;  // the caller's: one block of rows, kept for the next call
  if (static_cast<int64_t>(packed.size()) < rows_per_block * K) packed.resize(rows_per_block * K);
  float* const xp = packed.data();
#pragma omp parallel
  {
    alignas(64) float buf[kCols * kLanes];
    thread_local std::vector<float> kept;  // the partial sums; kept (rows x 128 bytes) for the next call
    if (K > kCols && static_cast<int64_t>(kept.size()) < rows_per_block * kLanes) kept.resize(rows_per_block * kLanes);
    float* const acc = kept.data();
    for (int64_t m0 = 0; m0 < M; m0 += rows_per_block) {
      const int64_t count = std::min(M, m0 + rows_per_block) - m0, groups = (count + kRows - 1) / kRows;
      pack_rows(x, K, m0, count, groups, xp);  // ends in a barrier (omp for)
#pragma omp for schedule(static)
      for (int64_t p = 0; p < panels; ++p) {
        const int64_t n = p * kLanes;
        for (int64_t k0 = 0; k0 < K; k0 += kCols) {
          const int64_t cols = std::min(kCols, K - k0);
          widen(p, k0, cols, buf);
          const bool first = k0 == 0, last = k0 + kCols >= K;
          for (int64_t i = 0; i < groups; ++i) {
            const int64_t r0 = first_row(count, groups, i), R = first_row(count, groups, i + 1) - r0;
            rows_of(R, xp + r0 * K + k0 * R, buf, cols, acc + r0 * kLanes, y + (m0 + r0) * N, N, n, first, last,
                    scale, bias);
          }
        }
      }
    }
  }
}
#endif

}  // namespace fpanel
}  // namespace
