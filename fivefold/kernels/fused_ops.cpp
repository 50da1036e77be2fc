// Fused elementwise ops of the Llama decoder's hot path (float32, CPU).
//
// Each replaces a chain of 3-6 ATen ops, each of which reads and writes the whole
// activation, by one pass over it (benchmarks/fused_hot_path.py has the measurements):
//
//   fused_add_rms_norm_(x, residual, w, eps):  residual += x; x = w * rms_norm(residual)   (in place)
//   silu_and_mul(gate_up) -> silu(gate) * up                                                 ([T, 2I] -> [T, I])
//   rotary_qk_(q, k, cos, sin): "rotate half" RoPE on q and k in one call                   (in place)
//   rotate_qk_(q, k, r): q = q @ r, k = k @ r, row by row, for an int8 KV cache's key rotation   (in place)
//
// Rows are independent, so threads split the rows; the inner loops are plain loops that
// the compiler vectorises (-O3 -march=native). Non-float32 inputs are the caller's to avoid.
#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

void check_f32(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, what, ": expects float32, got ", t.scalar_type());
  TORCH_CHECK(t.stride(-1) == 1, what, ": the last dimension must be contiguous");
}

}  // namespace

// x, residual: [T, N] (row stride may exceed N); weight: [N].
void fused_add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_f32(x, "fused_add_rms_norm_");
  check_f32(residual, "fused_add_rms_norm_");
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes() && weight.numel() == x.size(1),
              "fused_add_rms_norm_: shapes do not match");
  weight = weight.contiguous();
  const int64_t T = x.size(0), N = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
#pragma omp parallel for schedule(static) if (T > 1)
  for (int64_t t = 0; t < T; ++t) {
    float* xr = xp + t * xs;
    float* rr = rp + t * rs;
    float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < N; ++i) {
      const float v = xr[i] + rr[i];
      rr[i] = v;
      sum_sq += v * v;
    }
    const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(N) + static_cast<float>(eps));
#pragma omp simd
    for (int64_t i = 0; i < N; ++i) xr[i] = wp[i] * (rr[i] * inv);
  }
}

// gate_up: [T, 2I] -> [T, I].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_f32(gate_up, "silu_and_mul");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_and_mul: expects [T, 2I]");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, gs = gate_up.stride(0);
  auto out = torch::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Split the flat [T, I] output so one token still uses every thread.
  const int64_t total = T * I;
  const int64_t chunk = 1024;
#pragma omp parallel for schedule(static) if (total > 4 * chunk)
  for (int64_t start = 0; start < total; start += chunk) {
    const int64_t end = std::min(total, start + chunk);
    for (int64_t idx = start; idx < end;) {
      const int64_t t = idx / I, i0 = idx % I, i1 = std::min(I, i0 + (end - idx));
      const float* g = gp + t * gs;
      const float* u = g + I;
      float* o = op + t * I;
#pragma omp simd
      // exp's argument capped at 80: beyond it exp overflows to inf, and the vectorised division
      // (a reciprocal refined by Newton's step) turns g / inf into NaN instead of 0. silu(g) for
      // g < -80 is below 1e-33 either way.
      for (int64_t i = i0; i < i1; ++i) o[i] = g[i] / (1.f + std::exp(std::min(-g[i], 80.f))) * u[i];
      idx += i1 - i0;
    }
  }
  return out;
}

namespace {

// x: [T, heads, D] with contiguous last dim; cos/sin: [T, D/2] contiguous.
void rotate_in_place(torch::Tensor x, const float* cp, const float* sp) {
  const int64_t T = x.size(0), H = x.size(1), half = x.size(2) / 2;
  const int64_t ts = x.stride(0), hs = x.stride(1);
  float* xp = x.data_ptr<float>();
  // A fork/join costs more than rotating a decode step's few heads (one token: ~600 values)
#pragma omp parallel for collapse(2) schedule(static) if (T * H * half > (1 << 14))
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      float* x1 = xp + t * ts + h * hs;
      float* x2 = x1 + half;
      const float* c = cp + t * half;
      const float* s = sp + t * half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = x1[i], b = x2[i];
        x1[i] = a * c[i] - b * s[i];
        x2[i] = b * c[i] + a * s[i];
      }
    }
  }
}

}  // namespace

// q: [T, H, D], k: [T, KVH, D] (views into the fused qkv output are fine); cos, sin: [T, D/2].
void rotary_qk_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  check_f32(q, "rotary_qk_");
  check_f32(k, "rotary_qk_");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                  q.size(2) % 2 == 0, "rotary_qk_: expects q [T, H, D] and k [T, KVH, D] with even D");
  cos = cos.to(torch::kFloat32).contiguous().view({q.size(0), q.size(2) / 2});
  sin = sin.to(torch::kFloat32).contiguous().view({q.size(0), q.size(2) / 2});
  rotate_in_place(q, cos.data_ptr<float>(), sin.data_ptr<float>());
  rotate_in_place(k, cos.data_ptr<float>(), sin.data_ptr<float>());
}

namespace {

// One row y = x @ r (D values), x and y distinct. kD > 0 fixes D at compile time, so that the D
// output values stay in registers across the D rank-1 updates (for D = 64: 8 AVX2 vectors);
// kD = 0 takes D at run time and accumulates in memory (~5x slower at D = 64).
template <int kD>
inline void rotate_row(const float* x, const float* r, float* y, int64_t D) {
  if constexpr (kD > 0) {
    float acc[kD] = {};
    for (int i = 0; i < kD; ++i) {
      const float a = x[i];
#pragma omp simd
      for (int j = 0; j < kD; ++j) acc[j] += a * r[i * kD + j];
    }
    std::copy(acc, acc + kD, y);
  } else {
    std::fill(y, y + D, 0.f);
    for (int64_t i = 0; i < D; ++i) {
      const float a = x[i];
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) y[j] += a * r[i * D + j];
    }
  }
}

// x: [T, heads, D] with contiguous last dim; r: [D, D] contiguous. Each row becomes row @ r.
template <int kD>
void rotate_rows(torch::Tensor x, const float* rp) {
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  const int64_t ts = x.stride(0), hs = x.stride(1);
  float* xp = x.data_ptr<float>();
#pragma omp parallel if (T * H * D * D > (1 << 17))
  {
    std::vector<float> row(D);  // the input row, since the output overwrites it
#pragma omp for collapse(2) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        float* y = xp + t * ts + h * hs;
        std::copy(y, y + D, row.begin());
        rotate_row<kD>(row.data(), rp, y, D);
      }
    }
  }
}

}  // namespace

// q: [T, H, D], k: [T, KVH, D] (views into the fused qkv output are fine); r: [D, D] orthonormal
// (fivefold/models/kv_quant.py key_rotation). One loop over the step's rows instead of two
// at::matmul calls per layer: those cost ~25 us each at one token (1.5 ms of a 46 ms decode step
// on Zen 3) and ~4.6 ms a step at batch 64 (Zen 4), more than the products themselves.
void rotate_qk_(torch::Tensor q, torch::Tensor k, torch::Tensor r) {
  check_f32(q, "rotate_qk_");
  check_f32(k, "rotate_qk_");
  const int64_t D = q.size(-1);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && k.size(2) == D,
              "rotate_qk_: expects q [T, H, D] and k [T, KVH, D]");
  TORCH_CHECK(r.dim() == 2 && r.size(0) == D && r.size(1) == D, "rotate_qk_: r must be [", D, ", ", D, "], got ", r.sizes());
  r = r.to(torch::kFloat32).contiguous();
  const float* rp = r.data_ptr<float>();
  for (const torch::Tensor& x : {q, k}) {
    if (D == 64) rotate_rows<64>(x, rp);  // SmolLM2's and most small Llamas' head_dim
    else if (D == 128) rotate_rows<128>(x, rp);
    else rotate_rows<0>(x, rp);
  }
}

TORCH_LIBRARY_FRAGMENT(fivefold, m) {
  m.def("fused_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_qk_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("rotate_qk_(Tensor(a!) q, Tensor(b!) k, Tensor r) -> ()");
}
TORCH_LIBRARY_IMPL(fivefold, CPU, m) {
  m.impl("fused_add_rms_norm_", &fused_add_rms_norm_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_qk_", &rotary_qk_);
  m.impl("rotate_qk_", &rotate_qk_);
}
