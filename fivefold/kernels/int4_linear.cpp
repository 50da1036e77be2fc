// 4-bit weight-streaming linear (W4A16) for decode-sized batches (M = 1..64 rows):
//   y[m, n] = sum_g ( scale[n, g] * sum_{k in g} x[m, k] * q[n, k]  +  offset[n, g] * sum_{k in g} x[m, k] ) + bias[n]
// with q in 0..15 and groups of G consecutive columns, G a power of two and a multiple of 2W (32,
// 64, 128, 256 on AVX-512; also 16 on AVX2); K a multiple of 2W; the last group may be shorter
// (SmolLM2's K = 576 in groups of 128: four of 128 and one of 64, as GPTQ checkpoints do). G is not
// passed: it is the power of two that ceil(K / G) = groups pins (for 2+ groups it is unique). One formula covers every 4-bit format: symmetric int4 (q - 8: offset = -8 scale,
// passed as no offset), a minimum (GGUF Q4_1: w = d q + m, offset = m), a zero point
// (w = s (q - z): offset = -s z), GGUF Q4_K's sub-blocks (offset = -dmin * m_j).
//
// As in linear_stream.cpp (read its top for the reasons), the time at decode is the time to stream
// the weights, and the layout is made for that: tiles of C = 4 output channels, each one contiguous
// run; inside a tile, for each step of 2W columns (W = 16 floats per vector with AVX-512, 8 with
// AVX2), the C channels' W bytes side by side, byte j holding column j in its low nibble and
// column W + j in its high nibble. A byte vector widens to two float vectors with one zero
// extension, one AND and one shift (plain AVX2/AVX-512F: no VNNI needed), and on AVX-512 the
// 16 bytes of a step are exactly a GGUF Q4_0/Q4_1 block's quants. Scales and offsets (float16, as
// GGUF stores them) are in the same tile-major order, [G-groups, C] per tile, so a thread reads
// three sequential streams.
//
// Group scales: one row folds a group's partial sums into the accumulators once per group; several
// rows multiply each widened weight vector by its scale once, shared by the rows. The offset term
// needs only each row's per-group sums of x, computed once per call.
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
constexpr int kRows = 4;  // 16 accumulators + 8 activation vectors + 2 weight vectors of 32 registers
#else
constexpr int kRows = 2;  // 8 accumulators + 4 activation vectors + 2 weight vectors of 16 registers
#endif
constexpr int64_t kStepCols = 2 * kWidth;  // columns per step: one byte vector, two float vectors
constexpr int64_t kAheadBytes = 4096;

// W bytes -> (low nibbles, high nibbles) as two float vectors.
inline void widen(const uint8_t* p, Vec& lo, Vec& hi) {
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

inline float half_to_float(at::Half h) { return static_cast<float>(h); }

struct Operands {
  const at::Half* scale;   // tile-major [N, groups]
  const at::Half* offset;  // tile-major [N, groups], or null: symmetric, offset = -8 * scale
  const float* xsum;       // [M, groups]: each row's sum of x over each group
  const float* bias;       // [N] or null
  int64_t groups, steps;   // groups per row; column steps per (full) group
  int64_t total_steps;     // column steps per row (the last group may have fewer than `steps`)
};

// R rows x C channels starting at channel n; wt: the tile's weights, st: the tile's scales and
// offsets (index g * C + c).
template <int R, int C>
inline void tile(const float* x, int64_t K, const uint8_t* wt, int64_t st, int64_t n, int64_t m, float* y,
                 int64_t N, const Operands& o) {
  Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  float off[R][C] = {};
  const uint8_t* p = wt;
  int64_t s = 0;  // column step
  for (int64_t grp = 0; grp < o.groups; ++grp) {
    float sc[C], of[C];
    for (int c = 0; c < C; ++c) {
      sc[c] = half_to_float(o.scale[st + grp * C + c]);
      of[c] = o.offset ? half_to_float(o.offset[st + grp * C + c]) : -8.f * sc[c];
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) off[r][c] += of[c] * o.xsum[(m + r) * o.groups + grp];
    if constexpr (R == 1) {
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
          widen(p + c * kWidth, lo, hi);
          part[c] = vfma(xhi, hi, vfma(xlo, lo, part[c]));
        }
      }
      for (int c = 0; c < C; ++c) acc[0][c] = vfma(part[c], vset1(sc[c]), acc[0][c]);
    } else {
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
          widen(p + c * kWidth, lo, hi);
          const Vec sv = vset1(sc[c]);
          lo = vmul(lo, sv);
          hi = vmul(hi, sv);
          for (int r = 0; r < R; ++r) acc[r][c] = vfma(xhi[r], hi, vfma(xlo[r], lo, acc[r][c]));
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      y[r * N + n + c] = vsum(acc[r][c]) + off[r][c] + (o.bias ? o.bias[n + c] : 0.f);
}

// All M rows against the C channels of the tile at n: groups of kRows rows, then the remainder.
template <int C>
inline void channels(const float* x, int64_t M, int64_t K, const uint8_t* wt, int64_t n, float* y, int64_t N,
                     const Operands& o) {
  const int64_t st = n * o.groups;
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) tile<kRows, C>(x + m * K, K, wt, st, n, m, y + m * N, N, o);
  for (; m < M; ++m) tile<1, C>(x + m * K, K, wt, st, n, m, y + m * N, N, o);
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
  auto xsum = torch::zeros({M, groups}, xf.options());
  {
    const float* xp = xf.data_ptr<float>();
    float* sp = xsum.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) sp[m * groups + k / group_cols] += xp[m * K + k];
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
