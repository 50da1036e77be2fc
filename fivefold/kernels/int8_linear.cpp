// Weight-only int8 linear (W8A16) for few rows: y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] + bias[n].
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

}  // namespace

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
}
TORCH_LIBRARY_IMPL(fivefold, CPU, m) { m.impl("int8_weight_linear", &int8_weight_linear); }
