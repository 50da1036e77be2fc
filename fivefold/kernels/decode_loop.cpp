// The Llama decoder's layer loop for a decode step (one new token per sequence), in C++.
//
// In Python a decode step of SmolLM2 runs ~20 PyTorch calls per layer (views, splits, index_put for
// the KV write, module calls), and at batch 1 those calls cost more than the small kernels they
// launch: ~7 ms of a 35 ms step on the AVX-512 machine (`fivefold profile --mode decode`). Here the
// same sequence of kernels runs from one call: every op is still a dispatcher op of ours or of
// oneDNN (so torch.profiler records each by name, and each is the kernel the Python path runs),
// only the glue between them is C++.
//
// Per layer (x: [B, hidden] float32, residual: [B, hidden]):
//   fused_add_rms_norm_(x, residual)          residual += x; x = norm(residual)
//   qkv = linear(x, qkv_proj)                 [B, (H + 2 KVH) D] (two row blocks side by side
//                                             when the projection is held in two forms)
//   rotary_qk_(q, k)                          views of qkv, in place
//   rotate_qk_(q, k, key_rotation)            int8 cache only, in place
//   k, v -> KV cache at their slots           plain copies (float32), quantized rows (int8)
//   attn = paged_decode_attention(q, cache)   [B, H, D]
//   x = linear(attn, o_proj); fused_add_rms_norm_(x, residual)
//   x = linear(silu_and_mul(linear(x, gate_up_proj)), down_proj)
// and the final norm. The first layer's residual starts at zero, so its add is exact.
//
// A linear is four tensors (an empty tensor stands for "none"): the weight in
// fivefold::stream_pack's layout (float32, bfloat16 or int8; empty where the layer keeps one
// copy, its large-batch weight), a per-channel or per-group scale (int8 weights), a bias, and the
// weight for larger batches: oneDNN's packed weight, or the row-major one. Up to
// `stream_max_rows` rows (and for int8 weights always) it runs fivefold::stream_linear; above,
// oneDNN's packed GEMM, or at::linear on the row-major weight. A 4-bit linear (uint8 weight in
// fivefold::int4_pack's layout) always runs fivefold::int4_linear: its scale, its bias, and in the
// last slot its group offsets (empty: symmetric); every 4-bit linear of the model takes float or
// int8 activations alike (`int4_int8_activations`), and so does every int8 one
// (`int8_int8_activations`: fivefold::int8_weight_linear_a8, a GGUF's Q8_0 served as stored, or
// its Q6_K at 6 bits: q6_pack's uint8 weight).
// A layer's fifth linear is the second row block of a qkv projection held in two forms (a
// Q4_K_M file: q and k 4-bit, v int8; SplitLinear), or four empty tensors.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kTensorsPerLinear = 4;
constexpr int64_t kLinearsPerLayer = 5;  // qkv (its first row block), o, gate_up, down, qkv's second block
// Per layer: input norm weight, post-attention norm weight, then 5 linears.
constexpr int64_t kTensorsPerLayer = 2 + kLinearsPerLayer * kTensorsPerLinear;

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// Boxed calls: the ops live in other extensions (and oneDNN's in libtorch), so they are reached
// through the dispatcher by name, whatever C++ types their kernels were registered with.
std::vector<c10::IValue> call(const c10::OperatorHandle& handle, std::vector<c10::IValue> args) {
  handle.callBoxed(&args);
  return args;
}

c10::IValue maybe(const torch::Tensor& t) { return t.numel() > 0 ? c10::IValue(t) : c10::IValue(); }

struct Ops {
  const c10::OperatorHandle stream = op("fivefold::stream_linear");
  const c10::OperatorHandle int8_stream = op("fivefold::int8_weight_linear");  // the same kernel, named for the profiler
  const c10::OperatorHandle int4 = op("fivefold::int4_linear");
  const c10::OperatorHandle int8_a8 = op("fivefold::int8_weight_linear_a8");
  const c10::OperatorHandle packed = op("mkldnn::_linear_pointwise");
  const c10::OperatorHandle attention = op("fivefold::paged_decode_attention");
  const c10::OperatorHandle chunk_attention = op("fivefold::paged_prefill_attention");
  const c10::OperatorHandle add_norm = op("fivefold::fused_add_rms_norm_");
  const c10::OperatorHandle silu_mul = op("fivefold::silu_and_mul");
  const c10::OperatorHandle rotary = op("fivefold::rotary_qk_");
  const c10::OperatorHandle rotate = op("fivefold::rotate_qk_");
};

const Ops& ops() {
  static const Ops instance;  // looked up once, after every extension is loaded
  return instance;
}

struct LinearArgs {
  int64_t stream_max_rows;
  bool int4_int8_activations;
  bool int8_int8_activations;
};

torch::Tensor linear(const torch::Tensor& x, const std::vector<torch::Tensor>& t, int64_t base, const LinearArgs& a) {
  const int64_t stream_max_rows = a.stream_max_rows;
  const torch::Tensor &w = t[base], &scale = t[base + 1], &bias = t[base + 2], &large = t[base + 3];
  if (w.scalar_type() == torch::kUInt8 && w.dim() == 2)  // q6_pack's 6-bit weights: int8 activations only
    return call(ops().int8_a8, {x, w, scale, maybe(bias)})[0].toTensor();
  if (w.scalar_type() == torch::kInt8)
    return call(a.int8_int8_activations ? ops().int8_a8 : ops().int8_stream, {x, w, scale, maybe(bias)})[0].toTensor();
  if (w.scalar_type() == torch::kUInt8)
    return call(ops().int4, {x, w, scale, maybe(large), maybe(bias), a.int4_int8_activations})[0].toTensor();
  if (w.numel() > 0 && x.size(0) <= stream_max_rows) {  // no streaming copy: the large-batch weight serves
    return call(ops().stream, {x, w, maybe(scale), maybe(bias)})[0].toTensor();
  }
  if (large.is_mkldnn()) {
    return call(ops().packed, {x, large, maybe(bias), std::string("none"),
                               c10::impl::GenericList(c10::OptionalType::create(c10::NumberType::get())), std::string("")})[0].toTensor();
  }
  return bias.numel() > 0 ? at::linear(x, large, bias) : at::linear(x, large);
}

void add_norm(const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& weight, double eps) {
  call(ops().add_norm, {x, residual, weight, eps});
}

// One row of an int8 cache (fivefold/models/kv_quant.py, the reference): D values, then the float32
// scale. Symmetric per row: scale = max(amax / 127, floor), q = clamp(round(x / scale), -127, 127),
// with multiplications by reciprocals as kv_quant.quantize_rows computes them, so both write the same bytes.
constexpr float kScaleFloor = 1e-12f;

inline void quantize_row(const float* x, int8_t* dst, int64_t D) {
  float amax = 0.f;
  for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = std::max(amax * (1.0f / 127.0f), kScaleFloor);
  const float inv = 1.0f / scale;
  for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] * inv), -127.f, 127.f));
  std::memcpy(dst + D, &scale, sizeof(float));
}

// k, v: [B, KVH, D] float32 (views); cache: [2, num_blocks, KVH, block_size, D] of float32, or
// int8 [..., D + 4] (quantized here), contiguous.
void write_kv(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& cache,
              const int64_t* blocks, const int64_t* offsets) {
  const int64_t B = k.size(0), KVH = k.size(1), D = k.size(2);
  const int64_t num_blocks = cache.size(1), block_size = cache.size(3), row_size = cache.size(4);
  const bool is_int8 = cache.scalar_type() == torch::kInt8;
  TORCH_CHECK(cache.is_contiguous() && (is_int8 ? row_size == D + 4 : (cache.scalar_type() == torch::kFloat32 &&
              row_size == D)), "decode_layers: the KV cache must be float32 [..., D] or int8 [..., D + 4], contiguous");
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t half = num_blocks * KVH * block_size * row_size;  // elements of the K (or V) half
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t dst = ((blocks[b] * KVH + h) * block_size + offsets[b]) * row_size;
      const float* krow = kp + b * k.stride(0) + h * k.stride(1);
      const float* vrow = vp + b * v.stride(0) + h * v.stride(1);
      if (is_int8) {
        int8_t* kc = cache.data_ptr<int8_t>();
        quantize_row(krow, kc + dst, D);
        quantize_row(vrow, kc + half + dst, D);
      } else {
        float* kc = cache.data_ptr<float>();
        std::memcpy(kc + dst, krow, D * sizeof(float));
        std::memcpy(kc + half + dst, vrow, D * sizeof(float));
      }
    }
  }
}

}  // namespace

// hidden: [T, hidden] float32 embeddings of the step's tokens; cos, sin: [T, D/2];
// layers: kTensorsPerLayer tensors per layer (see above); kv_caches: one per layer;
// block_tables: [S, n] int64; seq_lens: [S] int64 (context after this step's tokens); slot_blocks,
// slot_offsets: [T] int64, where each token's key and value go. query_start_loc: empty when every
// sequence adds one token (T == S: paged_decode_attention), else [S + 1] int64 offsets of each
// sequence's tokens (a few per sequence, e.g. speculative proposals: paged_prefill_attention).
// key_rotation: empty, or an orthonormal [D, D] applied to queries and keys after RoPE (an int8
// cache stores rotated keys: fivefold/models/kv_quant.py). Returns the final-norm hidden [T, hidden].
torch::Tensor decode_layers(torch::Tensor hidden, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> layers,
                            std::vector<torch::Tensor> kv_caches, torch::Tensor final_norm, torch::Tensor block_tables,
                            torch::Tensor seq_lens, torch::Tensor slot_blocks, torch::Tensor slot_offsets,
                            torch::Tensor query_start_loc, torch::Tensor key_rotation,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                            int64_t stream_max_rows, bool int4_int8_activations, bool int8_int8_activations) {
  const LinearArgs args{stream_max_rows, int4_int8_activations, int8_int8_activations};
  const int64_t num_layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == num_layers * kTensorsPerLayer, "decode_layers: expected ",
              kTensorsPerLayer, " tensors per layer for ", num_layers, " layers, got ", layers.size());
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == torch::kFloat32, "decode_layers: hidden must be [B, H] float32");
  const int64_t B = hidden.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  slot_blocks = slot_blocks.contiguous();
  slot_offsets = slot_offsets.contiguous();
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  torch::Tensor x = hidden.clone();
  torch::Tensor residual = torch::zeros_like(x);
  for (int64_t i = 0; i < num_layers; ++i) {
    const int64_t base = i * kTensorsPerLayer;
    const int64_t lin = base + 2;
    add_norm(x, residual, layers[base], eps);
    torch::Tensor qkv = linear(x, layers, lin, args);  // [B, q + 2 kv]
    const int64_t second = lin + 4 * kTensorsPerLinear;
    if (layers[second].numel() > 0 || layers[second + 3].numel() > 0)  // held in two forms: the rows side by side
      qkv = at::cat({qkv, linear(x, layers, second, args)}, 1);
    torch::Tensor q = qkv.narrow(1, 0, q_size).view({B, num_heads, head_dim});
    torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({B, num_kv_heads, head_dim});
    torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({B, num_kv_heads, head_dim});
    call(ops().rotary, {q, k, cos, sin});
    if (key_rotation.numel() > 0) call(ops().rotate, {q, k, key_rotation});
    write_kv(k, v, kv_caches[i], blocks, offsets);
    torch::Tensor attn = query_start_loc.numel() > 0
        ? call(ops().chunk_attention, {q, kv_caches[i], block_tables, query_start_loc, seq_lens, scale})[0].toTensor()
        : call(ops().attention, {q, kv_caches[i], block_tables, seq_lens, scale})[0].toTensor();
    x = linear(attn.view({B, q_size}), layers, lin + kTensorsPerLinear, args);
    add_norm(x, residual, layers[base + 1], eps);
    torch::Tensor gate_up = linear(x, layers, lin + 2 * kTensorsPerLinear, args);
    torch::Tensor act = call(ops().silu_mul, {gate_up})[0].toTensor();
    x = linear(act, layers, lin + 3 * kTensorsPerLinear, args);
  }
  add_norm(x, residual, final_norm, eps);
  return x;
}

TORCH_LIBRARY_FRAGMENT(fivefold, m) {
  m.def("decode_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor[] layers, Tensor[] kv_caches, Tensor final_norm, "
        "Tensor block_tables, Tensor seq_lens, Tensor slot_blocks, Tensor slot_offsets, Tensor query_start_loc, "
        "Tensor key_rotation, int num_heads, "
        "int num_kv_heads, int head_dim, float eps, float scale, int stream_max_rows, bool int4_int8_activations, bool int8_int8_activations) -> Tensor");
}
TORCH_LIBRARY_IMPL(fivefold, CPU, m) { m.impl("decode_layers", &decode_layers); }
// The tensor list holds oneDNN's packed weights, whose dispatch key is MkldnnCPU.
TORCH_LIBRARY_IMPL(fivefold, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
