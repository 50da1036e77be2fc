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
// Several rows: each byte vector becomes two vectors of dequantized float weights, which every row
// then multiplies: with AVX-512, the 16 values scale * q + offset of a channel's group sit in one
// register and a permute looks the codes up in it (a zero extension, a shift and two permutes per
// 32 weights); with AVX2, codes are converted and scaled with one FMA each. One row: the codes are
// converted to floats (a zero extension, an AND, a shift, two conversions), the row's partial sums
// per group are scaled into the accumulators once per group, and the offsets enter as
// offset * sum_g(x), with the row's group sums of x computed once per call: fewer operations per
// weight where a group's table would serve one row only. Measured in cache, one thread, 512 x 2048
// (Zen 4): 4 rows 18 -> 24 GMAC/s (groups of 32) and 27 -> 32 (128) with the tables; one row 16 and
// 21 GMAC/s with the folded sums against 14 and 21 with the tables.
#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

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

struct Operands {
  const at::Half* scale;   // tile-major [N, groups]
  const at::Half* offset;  // tile-major [N, groups], or null: symmetric, offset = -8 * scale
  const float* xsum;       // [M, groups]: each row's sum of x over each group (the one-row path)
  const float* bias;       // [N] or null
  int64_t groups, steps;   // groups per row; column steps per (full) group
  int64_t total_steps;     // column steps per row (the last group may have fewer than `steps`)
};

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

// R rows x C channels starting at channel n; wt: the tile's weights, st: the tile's scales and
// offsets (index g * C + c).
template <int R, int C>
inline void tile(const float* x, int64_t K, const uint8_t* wt, int64_t st, int64_t n, float* y, int64_t N,
                 const Operands& o) {
  Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  const uint8_t* p = wt;
  int64_t s = 0;  // column step
  for (int64_t grp = 0; grp < o.groups; ++grp) {
    float sc[C], of[C];
    group_params<C>(o, st, grp, sc, of);
    Dequant d[C];
    for (int c = 0; c < C; ++c) d[c] = Dequant(sc[c], of[c]);
    const int64_t end = std::min(s + o.steps, o.total_steps);
    for (; s < end; ++s, p += C * kWidth) {
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
  for (; m < M; ++m) tile_row<C>(x + m * K, wt, st, n, m, y + m * N, o);
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
// layout (see the top: two columns per byte, tile-major).
torch::Tensor int4_pack(torch::Tensor q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kUInt8, "int4_pack: expects uint8 [N, K], got ",
              q.scalar_type(), " ", q.sizes());
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(K % kStepCols == 0, "int4_pack: K (", K, ") must be a multiple of ", kStepCols);
  TORCH_CHECK(q.numel() == 0 || q.max().item<int>() <= 15, "int4_pack: values must be in 0..15");
  const auto steps = q.contiguous().view({N, K / kStepCols, 2, kWidth});
  const torch::Tensor bytes = steps.select(2, 0).bitwise_or(steps.select(2, 1).bitwise_left_shift(4)).contiguous();
  auto out = empty_on_huge_pages({N, K / kStepCols, kWidth}, q.options());
  relayout(bytes.view({N, K / 2}), out, kChannels, /*to_packed=*/true);
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

// x: [M, K] float32 or bfloat16; w: int4_pack's layout; scale, offset: int4_pack_groups's layout
// (float16 [N, groups], K / groups a multiple of 2W); offset None: symmetric (q - 8); bias: [N] or
// None. Returns [M, N] in x's dtype.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale,
                          const c10::optional<torch::Tensor>& offset_opt, const c10::optional<torch::Tensor>& bias_opt) {
  check_layout(w, "int4_linear");
  const int64_t N = w.size(0), K = w.size(1) * kStepCols;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "int4_linear: shapes do not match, x ", x.sizes(), " for K = ", K);
  const auto out_dtype = x.scalar_type();
  TORCH_CHECK(out_dtype == torch::kFloat32 || out_dtype == torch::kBFloat16,
              "int4_linear: activations must be float32 or bfloat16, got ", out_dtype);
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && scale.scalar_type() == torch::kHalf && scale.is_contiguous(),
              "int4_linear: scale must be float16 [", N, ", groups] from int4_pack_groups, got ", scale.sizes());
  const int64_t groups = scale.size(1);
  const int64_t group_cols = group_columns(K, groups);
  TORCH_CHECK(group_cols > 0, "int4_linear: ", groups, " groups do not split K = ", K,
              " into groups of a power of two columns, a multiple of ", kStepCols);
  torch::Tensor offset, bias;
  if (offset_opt.has_value() && offset_opt->defined()) {
    offset = *offset_opt;
    TORCH_CHECK(offset.sizes() == scale.sizes() && offset.scalar_type() == torch::kHalf && offset.is_contiguous(),
                "int4_linear: offset must be float16 shaped like scale");
  }
  if (bias_opt.has_value() && bias_opt->defined() && bias_opt->numel() > 0) {
    bias = bias_opt->to(torch::kFloat32).contiguous();
    TORCH_CHECK(bias.numel() == N, "int4_linear: bias must have ", N, " elements");
  }
  const torch::Tensor xf = x.to(torch::kFloat32).contiguous();
  const int64_t M = x.size(0);
  auto xsum = torch::empty({M, groups}, xf.options());
  {
    const float* xp = xf.data_ptr<float>();
    float* sp = xsum.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t grp = 0; grp < groups; ++grp) {
        float sum = 0.f;  // vectorized (-ffast-math); a division per column cost more than the matmul
        for (int64_t k = grp * group_cols, end = std::min(K, k + group_cols); k < end; ++k) sum += xp[m * K + k];
        sp[m * groups + grp] = sum;
      }
  }
  const Operands o{scale.data_ptr<at::Half>(), offset.defined() ? offset.data_ptr<at::Half>() : nullptr,
                   xsum.data_ptr<float>(), bias.defined() ? bias.data_ptr<float>() : nullptr, groups,
                   group_cols / kStepCols, K / kStepCols};
  auto y = torch::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t tile_bytes = K / 2, num_tiles = N / kChannels;  // bytes per channel; full tiles
#pragma omp parallel for schedule(static) if (N * K > (1 << 15))
  for (int64_t t = 0; t < num_tiles; ++t)
    channels<kChannels>(xp, M, K, wp + t * kChannels * tile_bytes, t * kChannels, yp, N, o);
  const int64_t n = num_tiles * kChannels;
  switch (N - n) {  // the narrower last tile
    case 3: channels<3>(xp, M, K, wp + n * tile_bytes, n, yp, N, o); break;
    case 2: channels<2>(xp, M, K, wp + n * tile_bytes, n, yp, N, o); break;
    case 1: channels<1>(xp, M, K, wp + n * tile_bytes, n, yp, N, o); break;
    default: break;
  }
  return out_dtype == torch::kFloat32 ? y : y.to(out_dtype);
}

TORCH_LIBRARY_FRAGMENT(fivefold, m) {
  m.def("int4_pack(Tensor q) -> Tensor");
  m.def("int4_unpack(Tensor w) -> Tensor");
  m.def("int4_pack_groups(Tensor s, bool to_packed) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor w, Tensor scale, Tensor? offset, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(fivefold, CPU, m) {
  m.impl("int4_pack", &int4_pack);
  m.impl("int4_unpack", &int4_unpack);
  m.impl("int4_pack_groups", &int4_pack_groups);
  m.impl("int4_linear", &int4_linear);
}
