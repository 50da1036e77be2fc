// Weight-streaming linear for decode: y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] + bias[n]
// for a few activation rows (M = 1..16) and weights of float32, bfloat16 or int8 (int8 from 16
// rows: packed panels, below). Int8 weights
// take either one scale per output channel or one per group of G consecutive columns
// (y[m, n] = sum_g scale[n, g] * sum_{k in g} x[m, k] * w[n, k]: GGUF's Q8_0 is G = 32).
//
// At decode, every weight is read once per step and multiplied by a handful of rows, so the
// time is the time to stream the weights from DRAM. The kernel is built for that:
// - the weights are stored in the kernel's own layout (stream_pack): tiles of C = 4 output
//   channels, and inside a tile, for each step of W columns (one vector: 16 floats with AVX-512,
//   8 with AVX2), the C channels' W weights side by side. A tile is then one contiguous run read
//   front to back, and so is each thread's range of tiles: one sequential stream per core. Read
//   row-major, a tile is C interleaved streams one row long (576 bytes for an int8 row of
//   SmolLM2), which the prefetchers follow badly: int8 weights streamed at ~50% of the copy
//   bandwidth row-major and ~85-90% in this layout (benchmarks/linear_stream.py);
// - each thread takes a contiguous range of tiles (a static split);
// - a tile of C channels x R rows keeps C * R vector accumulators in registers; each weight
//   vector loaded (and widened from bf16 or int8 to float in registers) feeds R FMAs, and a
//   tile's weights stay in L1 while later row groups reuse them, so every weight byte comes
//   from memory once per call whatever M is;
// - bf16 is widened by a 16-bit shift and int8 by a sign extension: plain AVX2/AVX-512F, no
//   bf16 or VNNI instructions needed, so one source serves Zen 3 and Zen 4.
// The ISA is the one the extension is compiled for (-march of fivefold.platform: native, or
// x86-64-v3 when AVX2 is forced): AVX-512 (16 floats per vector), AVX2 (8), or plain C++. The
// layout depends on W, so a packed weight belongs to the build that packed it (the build
// directory is per -march, and stream_linear checks W).
#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "panels.h"
#include "simd.h"
#include "tiles.h"

namespace {

#if defined(__AVX512F__)
constexpr int kChannels = 4, kRows = 4;  // 16 accumulators + 4 weight vectors + 1 activation of 32 registers
#elif defined(__AVX2__)
constexpr int kChannels = 4, kRows = 2;  // 8 accumulators + 4 weight vectors + 1 activation of 16 registers
#else
constexpr int kChannels = 4, kRows = 2;
#endif

// Software prefetch kAheadBytes ahead in the thread's stream (one sequential run, so that is
// where it reads next). 1-16 KB measured alike; without it, int8 and bf16 weights (less compute
// per byte than float32) ran a few % slower.
constexpr int64_t kAheadBytes = 4096;

// Except for one float32 row: there the loop does one FMA per 32 bytes, the hardware prefetcher
// keeps up alone, and the prefetches only take load slots. On Zen 3 (AVX2), 121 SmolLM2 matrices
// from DRAM, alternating runs: 12.0 GB/s median with them, 13.7 without (int8: 11.7 with, 9.4
// without; float32 with 4 rows: 12.0 with, 11.0 without).
template <typename T, int R>
constexpr bool kPrefetches = !(std::is_same_v<T, float> && R == 1);

// Group scales: one per channel and group of `steps` column steps (G / W vectors), float32
// [N, groups] row-major, or float16 in int4_pack_groups' tile-major order (a GGUF's Q8_0 blocks, as
// stored: a tile's scales are one contiguous run), or neither (no group scales).
struct Groups {
  const float* scale;     // [N, groups] row-major, or null
  const at::Half* half;   // tile-major [N, groups], or null
  int64_t groups, steps;
  bool any() const { return scale != nullptr || half != nullptr; }
  // channel c of the tile of C channels at channel n, group grp
  template <int C>
  float at(int64_t n, int c, int64_t grp) const {
    return half ? static_cast<float>(half[n * groups + grp * C + c]) : scale[(n + c) * groups + grp];
  }
};

struct Epilogue {
  const float* scale;  // [N] or null
  const float* bias;   // [N] or null
  float apply(float s, int64_t n) const { return (scale ? s * scale[n] : s) + (bias ? bias[n] : 0.f); }
};

// R activation rows x C output channels starting at channel n, whose tile starts at wt and holds,
// for each of the Kp / kWidth column steps, C vectors of kWidth weights.
// Group scales. Several rows: each widened weight vector is multiplied by its scale once, shared
// by the R rows (a partial sum per group would need another R x C accumulators). One row: the
// group's partial sums are scaled into the accumulators as the group ends (one FMA per channel
// and group instead of one multiply per weight vector).
template <typename T, int C>
inline void tile_grouped_row(const float* x, const T* wt, int64_t n, float* y, const Groups& g, const Epilogue& e) {
  Vec acc[C];
  for (int c = 0; c < C; ++c) acc[c] = vzero();
  constexpr int64_t kStep = C * kWidth;
  const T* p = wt;
  for (int64_t grp = 0, s = 0; grp < g.groups; ++grp) {
    Vec part[C];
    for (int c = 0; c < C; ++c) part[c] = vzero();
    for (int64_t j = 0; j < g.steps; ++j, ++s, p += kStep) {
#if defined(__AVX2__)
      for (int64_t b = 0; b < kStep * static_cast<int64_t>(sizeof(T)); b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p) + kAheadBytes + b, _MM_HINT_T0);
#endif
      const Vec xv = vload(x + s * kWidth);
      for (int c = 0; c < C; ++c) part[c] = vfma(xv, vload(p + c * kWidth), part[c]);
    }
    for (int c = 0; c < C; ++c) acc[c] = vfma(part[c], vset1(g.at<C>(n, c, grp)), acc[c]);
  }
  for (int c = 0; c < C; ++c) y[n + c] = e.apply(vsum(acc[c]), n + c);
}

template <typename T, int R, int C>
inline void tile_grouped(const float* x, int64_t K, const T* wt, int64_t n, float* y, int64_t N, const Groups& g,
                         const Epilogue& e) {
  if constexpr (R == 1) return tile_grouped_row<T, C>(x, wt, n, y, g, e);
  Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  constexpr int64_t kStep = C * kWidth;
  const T* p = wt;
  for (int64_t grp = 0, s = 0; grp < g.groups; ++grp) {
    Vec sv[C];
    for (int c = 0; c < C; ++c) sv[c] = vset1(g.at<C>(n, c, grp));
    for (int64_t j = 0; j < g.steps; ++j, ++s, p += kStep) {
#if defined(__AVX2__)
      for (int64_t b = 0; b < kStep * static_cast<int64_t>(sizeof(T)); b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p) + kAheadBytes + b, _MM_HINT_T0);
#endif
      Vec wv[C];
      for (int c = 0; c < C; ++c) wv[c] = vmul(vload(p + c * kWidth), sv[c]);
      for (int r = 0; r < R; ++r) {
        const Vec xv = vload(x + r * K + s * kWidth);
        for (int c = 0; c < C; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * N + n + c] = e.apply(vsum(acc[r][c]), n + c);
}

template <typename T, int R, int C>
inline void tile(const float* x, int64_t K, const T* wt, int64_t n, float* y, int64_t N, const Groups& g,
                 const Epilogue& e) {
  if (g.any()) return tile_grouped<T, R, C>(x, K, wt, n, y, N, g, e);
  Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  constexpr int64_t kStep = C * kWidth;  // weights per column step
  const int64_t num_full = K / kWidth;
  const T* p = wt;
  for (int64_t s = 0; s < num_full; ++s, p += kStep) {
#if defined(__AVX2__)
    if constexpr (kPrefetches<T, R>)
      for (int64_t b = 0; b < kStep * static_cast<int64_t>(sizeof(T)); b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p) + kAheadBytes + b, _MM_HINT_T0);
#endif
    Vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = vload(p + c * kWidth);
    for (int r = 0; r < R; ++r) {
      const Vec xv = vload(x + r * K + s * kWidth);
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
    }
  }
  if (const int64_t rest = K - num_full * kWidth; rest > 0) {
    Vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = vload(p + c * kWidth);  // zero-padded past K
    for (int r = 0; r < R; ++r) {
      const Vec xv = xload_partial(x + r * K + num_full * kWidth, rest);
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * N + n + c] = e.apply(vsum(acc[r][c]), n + c);
}

// All M rows against C channels: groups of kRows rows, then the remainder.
template <typename T, int C>
inline void channels(const float* x, int64_t M, int64_t K, const T* wt, int64_t n, float* y, int64_t N,
                     const Groups& g, const Epilogue& e) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) tile<T, kRows, C>(x + m * K, K, wt, n, y + m * N, N, g, e);
  for (; m < M; ++m) tile<T, 1, C>(x + m * K, K, wt, n, y + m * N, N, g, e);
}

// Many rows of int8 weights. The loop above keeps the columns in the vector lanes: every weight
// vector is widened again for each group of kRows rows (two uops on the FMA ports) and every
// row x channel ends in a horizontal sum; at 64 rows that ran at ~0.7x float32's GEMM. From
// fpanel::kMinRows rows the weight goes through panels.h's float panels instead: a panel of
// 2 vectors of channels (8 tiles with AVX-512, 4 with AVX2) transposed and widened to float once
// per block of columns, then multiplied by every row.
#if defined(FIVEFOLD_FLOAT_PANELS)
constexpr int64_t kPanelTiles = fpanel::kLanes / kChannels;

// Columns [s0 W, (s0 + steps) W) of the panel of tiles [t0, t0 + kPanelTiles) (a tile's column step
// is kChannels channels x W columns), transposed and widened (times their group scales) into
// buf [steps W][fpanel::kLanes].
inline void panel_widen(const int8_t* w, int64_t Kp, int64_t t0, int64_t s0, int64_t steps, const Groups& g,
                        float* buf) {
  constexpr int64_t kLanes = fpanel::kLanes;
  const int64_t stride = kChannels * Kp;  // one tile to the next
#if defined(__AVX512F__)
  // Bytes on from a step to the same step kAheadBlocks widenings on, which each step prefetches
  // (fpanel::ahead). The AVX2 build does not: there the same prefetches ran 16 rows of 6144 x 4096
  // 0.85x and SmolLM2's 3072 x 576 no faster (forced AVX2 on Zen 4; its widening is the slower part).
  const fpanel::Ahead on = fpanel::ahead(s0 * kWidth, Kp);
  const int64_t next = on.panels * kPanelTiles * stride + on.cols * kChannels;
  static const fpanel::TileColumns columns;
  for (int64_t s = 0; s < steps; ++s)
    for (int h = 0; h < 2; ++h) {
      const int64_t tile = t0 + h * 4;
      const int8_t* p = w + tile * stride + (s0 + s) * kChannels * kWidth;
      for (int t = 0; t < 4; ++t) _mm_prefetch(reinterpret_cast<const char*>(p + t * stride + next), _MM_HINT_T0);
      Vec sv = vset1(1.f);
      if (g.any()) {
        alignas(64) float sc[16];
        for (int q = 0; q < 16; ++q) sc[q] = g.at<kChannels>((tile + q / 4) * kChannels, q % 4, (s0 + s) / g.steps);
        sv = vload(sc);
      }
      columns(_mm512_loadu_si512(p), _mm512_loadu_si512(p + stride), _mm512_loadu_si512(p + 2 * stride),
              _mm512_loadu_si512(p + 3 * stride), [&](int j, __m128i bytes) {
                Vec v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
                if (g.any()) v = vmul(v, sv);
                vstore(buf + (s * kWidth + j) * kLanes + h * 16, v);
              });
    }
#else
  // AVX2: each channel's 8 columns widened to floats, then two 8 x 8 transposes per step.
  for (int64_t s = 0; s < steps; ++s)
    for (int h = 0; h < 2; ++h) {
      __m256 v[8];
      for (int j = 0; j < 8; ++j) {
        const int64_t tile = t0 + h * 2 + j / 4;
        const int8_t* p = w + tile * stride + ((s0 + s) * kChannels + j % 4) * kWidth;
        v[j] = vload(p);
        if (g.any()) v[j] = vmul(v[j], vset1(g.at<kChannels>(tile * kChannels, j % 4, (s0 + s) / g.steps)));
      }
      fpanel::store_transposed8(v, buf + s * kWidth * kLanes + h * 8, kLanes);
    }
#endif
}

// The whole panels of an int8 weight against all M rows; returns the number of tiles they cover.
int64_t panel_stream(const float* x, int64_t M, int64_t K, int64_t Kp, const int8_t* w, int64_t N, float* y,
                     const Groups& g, const Epilogue& e) {
  const int64_t panels = N / fpanel::kLanes;
  fpanel::run(x, M, K, panels, y, N, e.scale, e.bias, [&](int64_t p, int64_t k0, int64_t cols, float* buf) {
    panel_widen(w, Kp, p * kPanelTiles, k0 / kWidth, (cols + kWidth - 1) / kWidth, g, buf);
  });
  return panels * kPanelTiles;
}
#endif

template <typename T>
void stream(const float* x, int64_t M, int64_t K, int64_t Kp, const T* w, int64_t N, float* y, const Groups& g,
            const Epilogue& e) {
  const int64_t num_tiles = N / kChannels;  // then one narrower tile of the last N % kChannels channels
  int64_t t0 = 0;
#if defined(FIVEFOLD_FLOAT_PANELS)
  if constexpr (std::is_same_v<T, int8_t>)
    if (M >= fpanel::kMinRows) t0 = panel_stream(x, M, K, Kp, w, N, y, g, e);
#endif
  // One parallel region per call; threads split the tiles into contiguous ranges.
#pragma omp parallel for schedule(static) if ((num_tiles - t0) * kChannels * K > (1 << 15))
  for (int64_t t = t0; t < num_tiles; ++t)
    channels<T, kChannels>(x, M, K, w + t * kChannels * Kp, t * kChannels, y, N, g, e);
  const int64_t n = num_tiles * kChannels;
  const T* wt = w + n * Kp;
  switch (N - n) {  // the narrower last tile
    case 3: channels<T, 3>(x, M, K, wt, n, y, N, g, e); break;
    case 2: channels<T, 2>(x, M, K, wt, n, y, N, g, e); break;
    case 1: channels<T, 1>(x, M, K, wt, n, y, N, g, e); break;
    default: break;
  }
}

}  // namespace

// w: [N, K] row-major -> [N, Kp / W, W] in the kernel's layout (Kp: K rounded up to the vector
// width W, zero-padded). The shape keeps N and Kp; the memory is tile-major (see the top).
torch::Tensor stream_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "stream_pack: expects a [N, K] weight, got ", w.sizes());
  const int64_t steps = (w.size(1) + kWidth - 1) / kWidth;
  const torch::Tensor padded = at::constant_pad_nd(w, {0, steps * kWidth - w.size(1)}).contiguous();
  auto out = empty_on_huge_pages({w.size(0), steps, kWidth}, w.options());
  relayout(padded, out, kChannels, /*to_packed=*/true);
  return out;
}

// The inverse: [N, Kp / W, W] in the kernel's layout -> [N, Kp] row-major (still padded).
torch::Tensor stream_unpack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kWidth && w.is_contiguous(),
              "stream_unpack: expects a weight from this build's stream_pack ([N, Kp/", kWidth, ", ", kWidth, "])");
  auto out = torch::empty({w.size(0), w.size(1) * kWidth}, w.options());
  relayout(out, w, kChannels, /*to_packed=*/false);
  return out;
}

// x: [M, K] float32 or bfloat16; w: float32, bfloat16 or int8 from stream_pack ([N, Kp/W, W]);
// scale: [N] float32 (int8 weights: the per-channel scale), [N, groups] (int8 weights: one scale
// per group of K / groups columns, a multiple of W, with K a multiple of W; float32 row-major, or
// float16 in int4_pack_groups' tile-major order) or None; bias: [N] or
// None. Returns [M, N] in x's dtype.
torch::Tensor stream_linear(torch::Tensor x, torch::Tensor w, const c10::optional<torch::Tensor>& scale_opt,
                            const c10::optional<torch::Tensor>& bias_opt) {
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kWidth && w.is_contiguous(),
              "stream_linear: the weight must come from this build's stream_pack ([N, Kp/", kWidth, ", ", kWidth,
              "]), got ", w.sizes());
  TORCH_CHECK(x.dim() == 2 && x.size(1) <= w.size(1) * kWidth && x.size(1) > (w.size(1) - 1) * kWidth,
              "stream_linear: shapes do not match, x ", x.sizes(), " packed w ", w.sizes());
  const auto wt = w.scalar_type();
  TORCH_CHECK(wt == torch::kFloat32 || wt == torch::kBFloat16 || wt == torch::kInt8,
              "stream_linear: weights must be float32, bfloat16 or int8, got ", wt);
  const auto out_dtype = x.scalar_type();
  TORCH_CHECK(out_dtype == torch::kFloat32 || out_dtype == torch::kBFloat16,
              "stream_linear: activations must be float32 or bfloat16, got ", out_dtype);
  const torch::Tensor xf = x.to(torch::kFloat32).contiguous();
  const int64_t M = x.size(0), K = x.size(1), Kp = w.size(1) * kWidth, N = w.size(0);
  torch::Tensor scale, group_scale, bias;
  Groups g{nullptr, nullptr, 0, 0};
  if (scale_opt.has_value() && scale_opt->defined() && scale_opt->dim() == 2) {
    const bool half = scale_opt->scalar_type() == torch::kHalf;  // int4_pack_groups' tile-major float16
    group_scale = half ? scale_opt->contiguous() : scale_opt->to(torch::kFloat32).contiguous();
    const int64_t groups = group_scale.size(1);
    TORCH_CHECK(wt == torch::kInt8 && group_scale.size(0) == N && groups > 0 && K == Kp && K % groups == 0 &&
                    (K / groups) % kWidth == 0,
                "stream_linear: group scales need int8 weights, a [", N, ", groups] scale, and K (", K,
                ") split into groups of a multiple of ", kWidth, " columns; got scale ", scale_opt->sizes());
    g = Groups{half ? nullptr : group_scale.data_ptr<float>(), half ? group_scale.data_ptr<at::Half>() : nullptr,
               groups, K / groups / kWidth};
  } else if (scale_opt.has_value() && scale_opt->defined()) {
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
  if (wt == torch::kFloat32) stream(xp, M, K, Kp, w.data_ptr<float>(), N, yp, g, e);
  else if (wt == torch::kBFloat16) stream(xp, M, K, Kp, w.data_ptr<bf16>(), N, yp, g, e);
  else stream(xp, M, K, Kp, w.data_ptr<int8_t>(), N, yp, g, e);
  return out_dtype == torch::kFloat32 ? y : y.to(out_dtype);
}

// W8A16 under its historical name (the profiler shows it apart): float32 x, int8 w from
// stream_pack, per-channel [N] or group [N, groups] scales (float32 row-major, or float16 from
// int4_pack_groups).
torch::Tensor int8_weight_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale,
                                 const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kInt8 &&
                  (scale.scalar_type() == torch::kFloat32 || (scale.scalar_type() == torch::kHalf && scale.dim() == 2)),
              "int8_weight_linear: expects float32 x, int8 w, float32 scale (or float16 group scales from int4_pack_groups)");
  return stream_linear(x, w, scale, bias);
}

TORCH_LIBRARY_FRAGMENT(fivefold, m) {
  m.def("stream_pack(Tensor w) -> Tensor");
  m.def("stream_unpack(Tensor w) -> Tensor");
  m.def("stream_linear(Tensor x, Tensor w, Tensor? scale, Tensor? bias) -> Tensor");
  m.def("int8_weight_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(fivefold, CPU, m) {
  m.impl("stream_pack", &stream_pack);
  m.impl("stream_unpack", &stream_unpack);
  m.impl("stream_linear", &stream_linear);
  m.impl("int8_weight_linear", &int8_weight_linear);
}
