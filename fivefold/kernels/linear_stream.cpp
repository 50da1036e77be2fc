// Weight-streaming linear for decode: y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] + bias[n]
// for a few activation rows (M = 1..16) and row-major weights of float32, bfloat16 or int8.
//
// At decode, every weight is read once per step and multiplied by a handful of rows, so the
// time is the time to stream the weights from DRAM. The kernel is built for that:
// - each thread takes a contiguous range of output channels (a static split: both cores stream
//   their own half of the matrix, sequentially, which the hardware prefetcher follows);
// - a tile of C channels x R rows keeps C * R vector accumulators in registers; each weight
//   vector loaded (and widened from bf16 or int8 to float in registers) feeds R FMAs, and the
//   C weight rows of a tile stay in L1 while later row groups of the same tile reuse them, so
//   every weight byte comes from memory once per call whatever M is;
// - bf16 is widened by a 16-bit shift and int8 by a sign extension: plain AVX2/AVX-512F, no
//   bf16 or VNNI instructions needed, so one source serves Zen 3 and Zen 4.
// The ISA is the one the extension is compiled for (-march of fivefold.platform: native, or
// x86-64-v3 when AVX2 is forced): AVX-512 (16 floats per vector), AVX2 (8), or plain C++.
#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using bf16 = at::BFloat16;

#if defined(__AVX512F__)
constexpr int64_t kWidth = 16;
constexpr int kChannels = 4, kRows = 4;  // 16 accumulators + 4 weight vectors + 1 activation of 32 registers
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline Vec vload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__)
constexpr int64_t kWidth = 8;
constexpr int kChannels = 4, kRows = 2;  // 8 accumulators + 4 weight vectors + 1 activation of 16 registers
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline Vec vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
constexpr int64_t kWidth = 1;
constexpr int kChannels = 4, kRows = 2;
using Vec = float;
inline Vec vzero() { return 0.f; }
inline Vec vload(const float* p) { return *p; }
inline Vec vload(const bf16* p) { return static_cast<float>(*p); }
inline Vec vload(const int8_t* p) { return static_cast<float>(*p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return a * b + c; }
inline float vsum(Vec a) { return a; }
#endif

inline Vec xload(const float* p) {
#if defined(__AVX512F__)
  return _mm512_loadu_ps(p);
#elif defined(__AVX2__)
  return _mm256_loadu_ps(p);
#else
  return *p;
#endif
}

// Software prefetch of the weights kAhead tiles ahead (the thread's channels are one contiguous
// range, so that is where it reads next). The hardware prefetcher alone kept int8 and bf16
// weights, which take less compute per byte than float32, at 40-60% of the bandwidth.
constexpr int64_t kAhead = 2;

struct Epilogue {
  const float* scale;  // [N] or null
  const float* bias;   // [N] or null
  float apply(float s, int64_t n) const { return (scale ? s * scale[n] : s) + (bias ? bias[n] : 0.f); }
};

// R activation rows x C output channels starting at channel n.
template <typename T, int R, int C>
inline void tile(const float* x, int64_t K, const T* w, int64_t n, float* y, int64_t N, const Epilogue& e) {
  Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  const T* wn = w + n * K;
  int64_t k = 0;
  for (; k + kWidth <= K; k += kWidth) {
    Vec wv[C];
    for (int c = 0; c < C; ++c) {
#if defined(__AVX2__)
      _mm_prefetch(reinterpret_cast<const char*>(wn + (c + kAhead * C) * K + k), _MM_HINT_T0);
#endif
      wv[c] = vload(wn + c * K + k);
    }
    for (int r = 0; r < R; ++r) {
      const Vec xv = xload(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = vsum(acc[r][c]);
      for (int64_t kk = k; kk < K; ++kk) s += x[r * K + kk] * static_cast<float>(wn[c * K + kk]);
      y[r * N + n + c] = e.apply(s, n + c);
    }
}

// All M rows against C channels: groups of kRows rows, then the remainder.
template <typename T, int C>
inline void channels(const float* x, int64_t M, int64_t K, const T* w, int64_t n, float* y, int64_t N,
                     const Epilogue& e) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) tile<T, kRows, C>(x + m * K, K, w, n, y + m * N, N, e);
  for (; m < M; ++m) tile<T, 1, C>(x + m * K, K, w, n, y + m * N, N, e);
}

template <typename T>
void stream(const float* x, int64_t M, int64_t K, const T* w, int64_t N, float* y, const Epilogue& e) {
  const int64_t num_tiles = N / kChannels;
  // One parallel region per call; threads split the channel tiles into contiguous ranges.
#pragma omp parallel for schedule(static) if (N * K > (1 << 15))
  for (int64_t t = 0; t < num_tiles; ++t) channels<T, kChannels>(x, M, K, w, t * kChannels, y, N, e);
  for (int64_t n = num_tiles * kChannels; n < N; ++n) channels<T, 1>(x, M, K, w, n, y, N, e);
}

}  // namespace

// x: [M, K] float32 or bfloat16; w: [N, K] float32, bfloat16 or int8 (row-major);
// scale: [N] float32 (int8 weights: the per-channel scale) or None; bias: [N] or None.
// Returns [M, N] in x's dtype.
torch::Tensor stream_linear(torch::Tensor x, torch::Tensor w, const c10::optional<torch::Tensor>& scale_opt,
                            const c10::optional<torch::Tensor>& bias_opt) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "stream_linear: shapes do not match, x ",
              x.sizes(), " w ", w.sizes());
  const auto wt = w.scalar_type();
  TORCH_CHECK(wt == torch::kFloat32 || wt == torch::kBFloat16 || wt == torch::kInt8,
              "stream_linear: weights must be float32, bfloat16 or int8, got ", wt);
  const auto out_dtype = x.scalar_type();
  TORCH_CHECK(out_dtype == torch::kFloat32 || out_dtype == torch::kBFloat16,
              "stream_linear: activations must be float32 or bfloat16, got ", out_dtype);
  const torch::Tensor xf = x.to(torch::kFloat32).contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  torch::Tensor scale, bias;
  if (scale_opt.has_value() && scale_opt->defined()) {
    scale = scale_opt->to(torch::kFloat32).contiguous();
    TORCH_CHECK(scale.numel() == N, "stream_linear: scale must have ", N, " elements");
  }
  if (bias_opt.has_value() && bias_opt->defined() && bias_opt->numel() > 0) {
    bias = bias_opt->to(torch::kFloat32).contiguous();
    TORCH_CHECK(bias.numel() == N, "stream_linear: bias must have ", N, " elements");
  }
  const Epilogue e{scale.defined() ? scale.data_ptr<float>() : nullptr, bias.defined() ? bias.data_ptr<float>() : nullptr};
  auto y = torch::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (wt == torch::kFloat32) stream(xp, M, K, w.data_ptr<float>(), N, yp, e);
  else if (wt == torch::kBFloat16) stream(xp, M, K, w.data_ptr<bf16>(), N, yp, e);
  else stream(xp, M, K, w.data_ptr<int8_t>(), N, yp, e);
  return out_dtype == torch::kFloat32 ? y : y.to(out_dtype);
}

// W8A16 under its historical name: float32 x, int8 w, per-channel scale.
torch::Tensor int8_weight_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale,
                                 const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kInt8 &&
                  scale.scalar_type() == torch::kFloat32,
              "int8_weight_linear: expects float32 x, int8 w, float32 scale");
  return stream_linear(x, w, scale, bias);
}

TORCH_LIBRARY_FRAGMENT(fivefold, m) {
  m.def("stream_linear(Tensor x, Tensor w, Tensor? scale, Tensor? bias) -> Tensor");
  m.def("int8_weight_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(fivefold, CPU, m) {
  m.impl("stream_linear", &stream_linear);
  m.impl("int8_weight_linear", &int8_weight_linear);
}
