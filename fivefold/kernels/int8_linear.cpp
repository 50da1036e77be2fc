// The exact int8 x int8 -> int32 matmul of W8A8: acc[m, n] = sum_k xq[m, k] * w[n, k], exact in
// int32 on every x86 and ARM CPU. (The weight-only W8A16 linear, int8_weight_linear, is the int8
// case of linear_stream.cpp.)
#include <torch/extension.h>
#include <omp.h>
#include <algorithm>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Exact int8 x int8 -> int32 for a tile of R activation rows x C weight rows (output channels).
// Each int8 product fits in int16 and pairs of them are added straight into int32 (vpmaddwd: at most
// 2 * 128 * 127 < 2^31), so no step can saturate, unlike the u8 x s8 kernels of oneDNN and fbgemm on
// CPUs without VNNI (vpmaddubsw adds pairs in int16). The tile keeps R * C accumulators in registers:
// every load of 16 activations or 16 weights feeds C or R multiply-adds.
template <int R, int C>
inline void int8_tile(const int8_t* x, const int8_t* w, int64_t K, int32_t* out, int64_t N) {
  int64_t k = 0;
  int32_t acc[R][C] = {};
#if defined(__AVX2__)
  __m256i vacc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) vacc[r][c] = _mm256_setzero_si256();
  for (; k + 16 <= K; k += 16) {
    __m256i xv[R];
    for (int r = 0; r < R; ++r)
      xv[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + r * K + k)));
    for (int c = 0; c < C; ++c) {
      const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * K + k)));
      for (int r = 0; r < R; ++r) vacc[r][c] = _mm256_add_epi32(vacc[r][c], _mm256_madd_epi16(xv[r], wv));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(vacc[r][c]), _mm256_extracti128_si256(vacc[r][c], 1));
      s = _mm_hadd_epi32(s, s);
      s = _mm_hadd_epi32(s, s);
      acc[r][c] = _mm_cvtsi128_si32(s);
    }
#endif
  for (; k < K; ++k)  // the tail, and the whole sum where AVX2 is absent (the compiler vectorises it)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        acc[r][c] += static_cast<int32_t>(x[r * K + k]) * static_cast<int32_t>(w[c * K + k]);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * N + c] = acc[r][c];
}

template <int C>
inline void int8_rows(const int8_t* x, int64_t M, const int8_t* w, int64_t K, int32_t* out, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) int8_tile<4, C>(x + m * K, w, K, out + m * N, N);
  switch (M - m) {
    case 3: int8_tile<3, C>(x + m * K, w, K, out + m * N, N); break;
    case 2: int8_tile<2, C>(x + m * K, w, K, out + m * N, N); break;
    case 1: int8_tile<1, C>(x + m * K, w, K, out + m * N, N); break;
    default: break;
  }
}

}  // namespace

// xq: [M, K] int8; w: [N, K] int8. Returns [M, N] int32, the exact sums (|sum| < K * 2^14 < 2^31 for
// K < 131072). Threads take tiles of 3 output channels; each weight row is read from memory once and
// reused from L1 for every activation row.
torch::Tensor int8_int8_matmul(torch::Tensor xq, torch::Tensor w) {
  TORCH_CHECK(xq.dim() == 2 && w.dim() == 2 && xq.size(1) == w.size(1), "int8_int8_matmul: shapes do not match");
  TORCH_CHECK(xq.scalar_type() == torch::kInt8 && w.scalar_type() == torch::kInt8,
              "int8_int8_matmul: expects int8 activations and weights");
  TORCH_CHECK(xq.size(1) < (int64_t{1} << 17), "int8_int8_matmul: K must be below 131072 for exact int32 sums");
  xq = xq.contiguous();
  w = w.contiguous();
  const int64_t M = xq.size(0), K = xq.size(1), N = w.size(0);
  auto acc = torch::empty({M, N}, xq.options().dtype(torch::kInt32));
  const int8_t* xp = xq.data_ptr<int8_t>();
  const int8_t* wp = w.data_ptr<int8_t>();
  int32_t* ap = acc.data_ptr<int32_t>();
  constexpr int64_t kChannels = 3;  // 4 x 3 accumulators + 4 activation vectors + 1 weight vector: 16 registers
  const int64_t num_tiles = (N + kChannels - 1) / kChannels;
#pragma omp parallel for schedule(static) if (M * N * K > (1 << 16))
  for (int64_t t = 0; t < num_tiles; ++t) {
    const int64_t n = t * kChannels;
    const int8_t* wn = wp + n * K;
    switch (std::min(kChannels, N - n)) {
      case 3: int8_rows<3>(xp, M, wn, K, ap + n, N); break;
      case 2: int8_rows<2>(xp, M, wn, K, ap + n, N); break;
      default: int8_rows<1>(xp, M, wn, K, ap + n, N); break;
    }
  }
  return acc;
}

TORCH_LIBRARY_FRAGMENT(fivefold, m) {
  m.def("int8_int8_matmul(Tensor xq, Tensor w) -> Tensor");
}
TORCH_LIBRARY_IMPL(fivefold, CPU, m) {
  m.impl("int8_int8_matmul", &int8_int8_matmul);
}
