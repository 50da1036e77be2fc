// Two int8 linears:
// - int8_weight_linear, weight-only (W8A16) for few rows: y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] + bias[n];
// - int8_int8_matmul (W8A8): acc[m, n] = sum_k xq[m, k] * w[n, k], exact in int32 on every x86 and ARM CPU.
//
// Decode multiplies 1-16 activation rows by every weight: the time is the time to stream
// the weights, so int8 weights (1 byte instead of 4) are the whole gain. Each thread
// takes a range of output channels; for each channel the int8 row is converted to float
// in registers and multiplied against up to 4 activation rows at once, so every weight
// byte is read from memory once per call. aten::_weight_int8pack_mm, the obvious
// alternative, is 2.5x slower than the float32 packed GEMM here for float32 activations
// (benchmarks/int8_kernels.py).
#include <torch/extension.h>
#include <omp.h>
#include <algorithm>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 4;  // activation rows per pass over a weight row

template <int R>
inline void rows_times_channel(const float* x, int64_t K, const int8_t* w, float scale, float bias, float* y,
                               int64_t N) {
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  // The compiler vectorises this loop (int8 -> int32 -> float, then FMA per row).
#pragma omp simd reduction(+ : acc[:R])
  for (int64_t k = 0; k < K; ++k) {
    const float wk = static_cast<float>(w[k]);
    for (int r = 0; r < R; ++r) acc[r] += x[r * K + k] * wk;
  }
  for (int r = 0; r < R; ++r) y[r * N] = acc[r] * scale + bias;
}

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

// x: [M, K] float32; w: [N, K] int8; scale: [N] float32; bias: [N] or None. Returns [M, N] float32.
torch::Tensor int8_weight_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale,
                                 const c10::optional<torch::Tensor>& bias_opt) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "int8_weight_linear: shapes do not match");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kInt8 &&
                  scale.scalar_type() == torch::kFloat32,
              "int8_weight_linear: expects float32 x, int8 w, float32 scale");
  x = x.contiguous();
  w = w.contiguous();
  scale = scale.contiguous();
  const bool has_bias = bias_opt.has_value() && bias_opt->numel() > 0;
  torch::Tensor bias = has_bias ? bias_opt->to(torch::kFloat32).contiguous() : torch::Tensor();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int8_t* wn = wp + n * K;
    const float b = bp ? bp[n] : 0.f;
    int64_t m = 0;
    for (; m + kRows <= M; m += kRows) rows_times_channel<kRows>(xp + m * K, K, wn, sp[n], b, yp + m * N + n, N);
    for (; m < M; ++m) rows_times_channel<1>(xp + m * K, K, wn, sp[n], b, yp + m * N + n, N);
  }
  return y;
}

TORCH_LIBRARY_FRAGMENT(fivefold, m) {
  m.def("int8_weight_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias) -> Tensor");
  m.def("int8_int8_matmul(Tensor xq, Tensor w) -> Tensor");
}
TORCH_LIBRARY_IMPL(fivefold, CPU, m) {
  m.impl("int8_weight_linear", &int8_weight_linear);
  m.impl("int8_int8_matmul", &int8_int8_matmul);
}
