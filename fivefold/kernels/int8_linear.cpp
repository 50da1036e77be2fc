// The exact int8 x int8 -> int32 matmul of W8A8: acc[m, n] = sum_k xq[m, k] * w[n, k], exact in
// int32 on every x86 and ARM CPU. (The weight-only W8A16 linear, int8_weight_linear, is the int8
// case of linear_stream.cpp.)
#include <torch/extension.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// The float epilogue of W8A8, applied to a block of the int32 sums while it is still in cache:
// y[m, n] = float(acc[m, n] - zp * w_sum[n]) * (x_scale[m] * w_scale[n]) + bias[n], the int32 sums
// read from and the floats written to the same memory (one output tensor, no second M x N pass).
struct Epilogue {
  const float* x_scale;  // [M], or one value when x_scale_stride == 0
  int64_t x_scale_stride;
  int64_t zp;
  const int32_t* w_sum;  // [N] or null (zp == 0)
  const float* w_scale;  // [N] or null (int32 sums wanted)
  const float* bias;     // [N] or null
  void apply(float* y, int64_t rows, int64_t ldy, int64_t m0, int64_t n0, int64_t cols) const {
    if (w_scale == nullptr) return;
    for (int64_t r = 0; r < rows; ++r) {
      const float xs = x_scale[(m0 + r) * x_scale_stride];
      float* row = y + r * ldy;
      int64_t c = 0;
#if defined(__AVX2__)
      const __m256 vxs = _mm256_set1_ps(xs);
      const __m256i vzp = _mm256_set1_epi32(static_cast<int32_t>(zp));
      for (; c + 8 <= cols; c += 8) {
        __m256i acc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c));
        if (zp)
          acc = _mm256_sub_epi32(acc, _mm256_mullo_epi32(vzp, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w_sum + n0 + c))));
        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(vxs, _mm256_loadu_ps(w_scale + n0 + c)));
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n0 + c));
        _mm256_storeu_ps(row + c, v);
      }
#endif
      for (; c < cols; ++c) {
        int32_t acc;
        std::memcpy(&acc, row + c, sizeof acc);
        if (zp) acc -= static_cast<int32_t>(zp) * w_sum[n0 + c];
        const float v = static_cast<float>(acc) * (xs * w_scale[n0 + c]) + (bias ? bias[n0 + c] : 0.f);
        std::memcpy(row + c, &v, sizeof v);
      }
    }
  }
};

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

#if defined(__AVX2__)
// The packed-panel form, for many rows (prefill, large batches). The row kernel above reduces
// along K inside each vector and widens every 16 weights once per 4 rows; here the vector lanes
// are output channels instead, and a panel of kPanelChannels channels x kBlockK columns is widened
// to int16 once, into a buffer that stays in L1, then multiplied by every row of the call:
//   buf[kp][c] = (w[n0 + c][2 kp], w[n0 + c][2 kp + 1])   (one int32 unit: a pair of int16)
//   acc[m][c] += vpmaddwd(broadcast(x[m][2 kp], x[m][2 kp + 1]), buf[kp][c..c+8])
// so each step is one broadcast load per row, one weight load per 8 channels, and one vpmaddwd
// plus one vpaddd per 16 products: no horizontal sums, no per-row widening. Still exact: a pair
// of int8 products is at most 2 * 128 * 128 = 2^15 before it is widened to int32.
constexpr int kLanes = 8;                       // int32 lanes of a ymm: output channels per vector
constexpr int kPanelVectors = 2;                // C: 4 x 2 accumulators + 2 weights + 1 row + 1 product of 16
                                                // ymm (4 x 3 spilled: 20% slower)
constexpr int64_t kPanelChannels = kLanes * kPanelVectors;
constexpr int64_t kPanelRows = 4;               // R
// Columns per widened block: 2048 / 2 x 16 x 4 B = 64 KB (L2). One block holds the whole K of the
// usual projections, so a tile's sums stay in registers from the first column to the last (blocks
// of 256, read back from `out` between them, ran 1.2-1.5x slower on Zen 3).
constexpr int64_t kBlockK = 2048;
constexpr int64_t kPanelMinRows = 16;           // below this the row kernel (8 rows: 10-15% faster there)

// The 8 x 8 transpose of int32 units: r[i] = (v[0].unit i, ..., v[7].unit i).
inline void transpose8(__m256i v[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    v[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

// Channels [n0, n0 + 24) x columns [k0, k0 + kb) of the row-major weight, widened into buf
// (kb / 2 x 24 int32 units); channels past N and columns past K are zeros. kb is a multiple of 16.
inline void widen_panel(const int8_t* w, int64_t N, int64_t K, int64_t n0, int64_t k0, int64_t kb, int32_t* buf) {
  for (int64_t kk = 0; kk < kb; kk += 16) {
    // The next panel's rows into L2 while this one is multiplied (~10 us ahead): 16 rows read at a
    // stride of K are more streams than the hardware prefetcher follows (10% of the time stalled
    // here on Zen 3 without it).
    if (kk % 64 == 0)
      for (int64_t j = 0; j < kPanelChannels && n0 + kPanelChannels + j < N; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + kPanelChannels + j) * K + k0 + kk), _MM_HINT_T1);
    for (int p = 0; p < kPanelVectors; ++p) {
      __m256i v[8];
      for (int j = 0; j < 8; ++j) {
        const int64_t n = n0 + p * kLanes + j, k = k0 + kk;
        if (n < N && k + 16 <= K) {
          v[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + n * K + k)));
        } else {
          alignas(16) int8_t tail[16] = {};
          if (n < N)
            for (int64_t i = 0; i < 16 && k + i < K; ++i) tail[i] = w[n * K + k + i];
          v[j] = _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(tail)));
        }
      }
      transpose8(v);
      for (int i = 0; i < 8; ++i)
        _mm256_store_si256(reinterpret_cast<__m256i*>(buf + (kk / 2 + i) * kPanelChannels + p * kLanes), v[i]);
    }
  }
}

// (x[2 kp], x[2 kp + 1]) in every int32 lane (one vpbroadcastd from memory; memcpy, not a cast, to read
// the int16 pair as one int32).
inline __m256i broadcast_pair(const int16_t* x, int64_t kp) {
  int32_t pair;
  std::memcpy(&pair, x + 2 * kp, sizeof pair);
  return _mm256_set1_epi32(pair);
}

// R rows of x16 (int16, row stride ldx, from column k0) x the widened panel, added to out's
// channels [n0, n0 + valid) (first block: stored, not added).
template <int R>
inline void panel_tile(const int16_t* x16, int64_t ldx, const int32_t* buf, int64_t kpairs, int32_t* out, int64_t N,
                       int64_t valid, bool first) {
  __m256i acc[R][kPanelVectors];
  alignas(32) int32_t part[kPanelChannels] = {};
  for (int r = 0; r < R; ++r) {
    const int32_t* o = out + r * N;
    if (!first && valid < kPanelChannels) std::copy(o, o + valid, part);
    for (int c = 0; c < kPanelVectors; ++c)
      acc[r][c] = first ? _mm256_setzero_si256()
                        : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(valid < kPanelChannels ? part + c * kLanes
                                                                                                   : o + c * kLanes));
  }
  const int16_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x16 + r * ldx;
  const __m256i* wp = reinterpret_cast<const __m256i*>(buf);
  static_assert(kPanelVectors == 2, "the loops below are written for 2 vectors of channels");
  if constexpr (R == 4) {
    // Named accumulators: with acc[R][2] in the loop GCC 12 computes each sum into a new register
    // and copies it back (8 vmovdqa per step: the loop then issues 31 instructions for 8 vpmaddwd
    // instead of 23; 5-7% slower on Zen 3).
    __m256i a00 = acc[0][0], a01 = acc[0][1], a10 = acc[1][0], a11 = acc[1][1];
    __m256i a20 = acc[2][0], a21 = acc[2][1], a30 = acc[3][0], a31 = acc[3][1];
    for (int64_t kp = 0; kp < kpairs; ++kp, wp += kPanelVectors) {
      __m256i w0 = _mm256_load_si256(wp), w1 = _mm256_load_si256(wp + 1);
      // Held in registers: folded into each vpmaddwd, the 2 weight loads become 8 and the step
      // waits on the load ports (12 loads where 2 x 256-bit issue per cycle).
      asm("" : "+x"(w0), "+x"(w1));
      __m256i xv = broadcast_pair(xr[0], kp);
      a00 = _mm256_add_epi32(a00, _mm256_madd_epi16(xv, w0));
      a01 = _mm256_add_epi32(a01, _mm256_madd_epi16(xv, w1));
      xv = broadcast_pair(xr[1], kp);
      a10 = _mm256_add_epi32(a10, _mm256_madd_epi16(xv, w0));
      a11 = _mm256_add_epi32(a11, _mm256_madd_epi16(xv, w1));
      xv = broadcast_pair(xr[2], kp);
      a20 = _mm256_add_epi32(a20, _mm256_madd_epi16(xv, w0));
      a21 = _mm256_add_epi32(a21, _mm256_madd_epi16(xv, w1));
      xv = broadcast_pair(xr[3], kp);
      a30 = _mm256_add_epi32(a30, _mm256_madd_epi16(xv, w0));
      a31 = _mm256_add_epi32(a31, _mm256_madd_epi16(xv, w1));
    }
    acc[0][0] = a00; acc[0][1] = a01; acc[1][0] = a10; acc[1][1] = a11;
    acc[2][0] = a20; acc[2][1] = a21; acc[3][0] = a30; acc[3][1] = a31;
  } else {  // the last 1-3 rows of a call
    for (int64_t kp = 0; kp < kpairs; ++kp, wp += kPanelVectors) {
      const __m256i w0 = _mm256_load_si256(wp), w1 = _mm256_load_si256(wp + 1);
      for (int r = 0; r < R; ++r) {
        const __m256i xv = broadcast_pair(xr[r], kp);
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(xv, w0));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(xv, w1));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    int32_t* o = out + r * N;
    if (valid == kPanelChannels) {
      for (int c = 0; c < kPanelVectors; ++c) _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c * kLanes), acc[r][c]);
    } else {
      for (int c = 0; c < kPanelVectors; ++c) _mm256_store_si256(reinterpret_cast<__m256i*>(part + c * kLanes), acc[r][c]);
      std::copy(part, part + valid, o);
    }
  }
}

void panel_matmul(const int8_t* x, int64_t M, const int8_t* w, int64_t K, int32_t* out, int64_t N,
                  const Epilogue& e) {
  const int64_t Kp = (K + 15) / 16 * 16;
  std::vector<int16_t> x16(M * Kp, 0);  // the rows widened once, zeros past K
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) x16[m * Kp + k] = x[m * K + k];
  const int64_t panels = (N + kPanelChannels - 1) / kPanelChannels;
#pragma omp parallel
  {
    std::vector<int32_t> block(kBlockK / 2 * kPanelChannels + kLanes);  // + room to align to 32 bytes
    int32_t* buf = block.data() + (-reinterpret_cast<uintptr_t>(block.data()) / sizeof(int32_t) & (kLanes - 1));
#pragma omp for schedule(static)
    for (int64_t g = 0; g < panels; ++g) {
      const int64_t n0 = g * kPanelChannels, valid = std::min(kPanelChannels, N - n0);
      for (int64_t k0 = 0; k0 < Kp; k0 += kBlockK) {
        const int64_t kb = std::min(kBlockK, Kp - k0);
        widen_panel(w, N, K, n0, k0, kb, buf);
        int64_t m = 0;
        for (; m + kPanelRows <= M; m += kPanelRows)
          panel_tile<kPanelRows>(x16.data() + m * Kp + k0, Kp, buf, kb / 2, out + m * N + n0, N, valid, k0 == 0);
        const int64_t rest = M - m;
        const int16_t* xr = x16.data() + m * Kp + k0;
        if (rest == 3) panel_tile<3>(xr, Kp, buf, kb / 2, out + m * N + n0, N, valid, k0 == 0);
        if (rest == 2) panel_tile<2>(xr, Kp, buf, kb / 2, out + m * N + n0, N, valid, k0 == 0);
        if (rest == 1) panel_tile<1>(xr, Kp, buf, kb / 2, out + m * N + n0, N, valid, k0 == 0);
      }
      e.apply(reinterpret_cast<float*>(out) + n0, M, N, 0, n0, valid);
    }
  }
}
#endif

}  // namespace

namespace {

// acc [M, N] (int32 sums, or the floats of the epilogue in the same memory).
void matmul_into(const torch::Tensor& xq, const torch::Tensor& w, void* out, const Epilogue& e) {
  const int64_t M = xq.size(0), K = xq.size(1), N = w.size(0);
  const int8_t* xp = xq.data_ptr<int8_t>();
  const int8_t* wp = w.data_ptr<int8_t>();
  int32_t* ap = static_cast<int32_t*>(out);
#if defined(__AVX2__)
  if (M >= kPanelMinRows) return panel_matmul(xp, M, wp, K, ap, N, e);
#endif
  constexpr int64_t kChannels = 3;  // 4 x 3 accumulators + 4 activation vectors + 1 weight vector: 16 registers
  const int64_t num_tiles = (N + kChannels - 1) / kChannels;
#pragma omp parallel for schedule(static) if (M * N * K > (1 << 16))
  for (int64_t t = 0; t < num_tiles; ++t) {
    const int64_t n = t * kChannels, cols = std::min(kChannels, N - n);
    const int8_t* wn = wp + n * K;
    switch (cols) {
      case 3: int8_rows<3>(xp, M, wn, K, ap + n, N); break;
      case 2: int8_rows<2>(xp, M, wn, K, ap + n, N); break;
      default: int8_rows<1>(xp, M, wn, K, ap + n, N); break;
    }
    e.apply(reinterpret_cast<float*>(ap) + n, M, N, 0, n, cols);
  }
}

void check_operands(const torch::Tensor& xq, const torch::Tensor& w, const char* op) {
  TORCH_CHECK(xq.dim() == 2 && w.dim() == 2 && xq.size(1) == w.size(1), op, ": shapes do not match");
  TORCH_CHECK(xq.scalar_type() == torch::kInt8 && w.scalar_type() == torch::kInt8, op,
              ": expects int8 activations and weights");
  TORCH_CHECK(xq.size(1) < (int64_t{1} << 17), op, ": K must be below 131072 for exact int32 sums");
}

}  // namespace

// xq: [M, K] int8; w: [N, K] int8. Returns [M, N] int32, the exact sums (|sum| <= K * 2^14 < 2^31 for
// K < 131072). Few rows: threads take tiles of 3 output channels; each weight row is read from memory
// once and reused from L1 for every activation row. Many rows (AVX2): the packed-panel form.
torch::Tensor int8_int8_matmul(torch::Tensor xq, torch::Tensor w) {
  check_operands(xq, w, "int8_int8_matmul");
  xq = xq.contiguous();
  w = w.contiguous();
  auto acc = torch::empty({xq.size(0), w.size(0)}, xq.options().dtype(torch::kInt32));
  matmul_into(xq, w, acc.data_ptr<int32_t>(), Epilogue{nullptr, 0, 0, nullptr, nullptr, nullptr});
  return acc;
}

// W8A8 in one call: float32 [M, N] = (x_scale * (xq - zp)) @ (w_scale * w)^T + bias, the integer
// part exact (the zero point folded in as zp * w_sum[n]). x_scale: float32 [M] (per token) or [1];
// w_sum: int32 [N] (needed when zp != 0); w_scale, bias: float32 [N].
torch::Tensor int8_int8_linear(torch::Tensor xq, torch::Tensor x_scale, int64_t zp, torch::Tensor w,
                               std::optional<torch::Tensor> w_sum, torch::Tensor w_scale,
                               std::optional<torch::Tensor> bias) {
  check_operands(xq, w, "int8_int8_linear");
  const int64_t M = xq.size(0), N = w.size(0);
  xq = xq.contiguous();
  w = w.contiguous();
  x_scale = x_scale.to(torch::kFloat32).contiguous().reshape({-1});
  TORCH_CHECK(x_scale.numel() == M || x_scale.numel() == 1, "int8_int8_linear: x_scale must have M or 1 values");
  w_scale = w_scale.to(torch::kFloat32).contiguous();
  TORCH_CHECK(w_scale.numel() == N, "int8_int8_linear: w_scale must have N values");
  torch::Tensor ws, b;
  if (zp) {
    TORCH_CHECK(w_sum.has_value() && w_sum->numel() == N, "int8_int8_linear: a zero point needs w_sum [N]");
    ws = w_sum->to(torch::kInt32).contiguous();
  }
  if (bias.has_value()) {
    b = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(b.numel() == N, "int8_int8_linear: bias must have N values");
  }
  auto y = torch::empty({M, N}, xq.options().dtype(torch::kFloat32));
  const Epilogue e{x_scale.data_ptr<float>(), x_scale.numel() == 1 ? 0 : 1, zp, zp ? ws.data_ptr<int32_t>() : nullptr,
                   w_scale.data_ptr<float>(), bias.has_value() ? b.data_ptr<float>() : nullptr};
  matmul_into(xq, w, y.data_ptr<float>(), e);
  return y;
}

namespace {

// Dynamic symmetric int8 per row, as per_token_quantize computes it in Python (the same float32
// division and round-half-to-even, so the codes are the same bit for bit: fast-math, which would turn
// the division into a multiplication by the reciprocal, is off here): scale[m] = max(amax, 1e-8) / 127,
// xq[m, k] = round(x[m, k] / scale[m]).
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
void quantize_per_row(const float* x, int64_t M, int64_t K, int8_t* xq, float* scale) {
  // No std:: calls in here: functions compiled with other optimize options are not inlined into
  // this one (std::max per element took 30% of a 64 x 1536 W8A8 call).
#pragma omp parallel for schedule(static) if (M * K > (1 << 15))
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    int8_t* q = xq + m * K;
    int64_t k = 0;
    float amax = 0.f;
#if defined(__AVX2__)
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vmax = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(row + k), abs_mask));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    for (float v : lanes) amax = v > amax ? v : amax;
#endif
    for (; k < K; ++k) amax = __builtin_fabsf(row[k]) > amax ? __builtin_fabsf(row[k]) : amax;
    const float s = (amax > 1e-8f ? amax : 1e-8f) / 127.f;
    scale[m] = s;
    k = 0;
#if defined(__AVX2__)
    const __m256 vs = _mm256_set1_ps(s);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (; k + 8 <= K; k += 8) {  // cvtps rounds to nearest even (MXCSR's default), as torch.round
      const __m256i c = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(row + k), vs));
      const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(_mm256_packs_epi32(c, c), c), order);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm256_castsi256_si128(b));
    }
#endif
    for (; k < K; ++k) q[k] = static_cast<int8_t>(__builtin_nearbyintf(row[k] / s));
  }
}
#pragma GCC pop_options

}  // namespace

// W8A8 with dynamic per-token activations in one call: x float32 [M, K] is quantized per row here
// (see quantize_per_row) and multiplied as int8_int8_linear does with zp = 0. Saves the five
// elementwise passes and their tensors of the Python form (~50-90 us at 64 x 576..1536 on Zen 3).
torch::Tensor int8_dynamic_linear(torch::Tensor x, torch::Tensor w, torch::Tensor w_scale,
                                  std::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "int8_dynamic_linear: x must be float32 [M, K]");
  x = x.contiguous();
  auto xq = torch::empty(x.sizes(), x.options().dtype(torch::kInt8));
  auto xs = torch::empty({x.size(0)}, x.options());
  quantize_per_row(x.data_ptr<float>(), x.size(0), x.size(1), xq.data_ptr<int8_t>(), xs.data_ptr<float>());
  return int8_int8_linear(xq, xs, 0, w, std::nullopt, w_scale, bias);
}

TORCH_LIBRARY_FRAGMENT(fivefold, m) {
  m.def("int8_dynamic_linear(Tensor x, Tensor w, Tensor w_scale, Tensor? bias) -> Tensor");
  m.def("int8_int8_matmul(Tensor xq, Tensor w) -> Tensor");
  m.def("int8_int8_linear(Tensor xq, Tensor x_scale, int zp, Tensor w, Tensor? w_sum, Tensor w_scale, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(fivefold, CPU, m) {
  m.impl("int8_int8_matmul", &int8_int8_matmul);
  m.impl("int8_int8_linear", &int8_int8_linear);
  m.impl("int8_dynamic_linear", &int8_dynamic_linear);
}
