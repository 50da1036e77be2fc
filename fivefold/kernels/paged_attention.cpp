// Decode attention straight from the paged KV cache (one query token per sequence).
//
// The pure-PyTorch path has to gather every sequence's blocks into a padded copy
// before calling SDPA, which moves the whole context twice per layer. This kernel
// reads each key and value row once, where it lies in its block (head-major inside
// a block, so one head's 16 rows are one contiguous 4 KB run), and keeps the
// scores of one (sequence, KV head) pair in a thread-local buffer: grouped-query
// heads that share a KV head share the reads. Float32 accumulation for every dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

namespace {

template <typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t d) {
  float acc = 0.f;
  for (int64_t i = 0; i < d; ++i) acc += q[i] * static_cast<float>(k[i]);
  return acc;
}

// Row t of head h of a sequence's keys or values, wherever its block lies.
template <typename scalar_t>
inline const scalar_t* row_ptr(const scalar_t* cache, const int64_t* table, int64_t t, int64_t h,
                               int64_t num_kv_heads, int64_t block_size, int64_t head_dim) {
  const int64_t block = table[t / block_size];
  return cache + ((block * num_kv_heads + h) * block_size + t % block_size) * head_dim;
}

// Blocks are scattered, so the hardware prefetcher restarts at each one: ask for the
// row kPrefetchAhead positions on while working on this one.
constexpr int64_t kPrefetchAhead = 8;

template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t head_dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < head_dim * static_cast<int64_t>(sizeof(scalar_t)); off += 64) __builtin_prefetch(p + off);
}

template <typename scalar_t>
void decode_kernel(const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                   const torch::Tensor& seq_lens, double scale, torch::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = kv_cache.size(2), block_size = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_cache = kv_cache[0].data_ptr<scalar_t>();
  const scalar_t* v_cache = kv_cache[1].data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(group * head_dim), acc(group * head_dim);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t s = work / num_kv_heads, h = work % num_kv_heads;
      const int64_t len = lens[s];
      scores.assign(group * len, 0.f);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < head_dim; ++i)
          qf[g * head_dim + i] = static_cast<float>(q_ptr[(s * num_heads + h * group + g) * head_dim + i]) * scale;
      // scores[g][t] = q_g . k_t
      const int64_t* table = tables + s * max_blocks;
      for (int64_t t = 0; t < len; ++t) {
        if (t + kPrefetchAhead < len)
          prefetch_row(row_ptr(k_cache, table, t + kPrefetchAhead, h, num_kv_heads, block_size, head_dim), head_dim);
        const scalar_t* k = row_ptr(k_cache, table, t, h, num_kv_heads, block_size, head_dim);
        for (int64_t g = 0; g < group; ++g) scores[g * len + t] = dot(qf.data() + g * head_dim, k, head_dim);
      }
      // softmax over t, per query head
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * len;
        float mx = -INFINITY;
        for (int64_t t = 0; t < len; ++t) mx = std::max(mx, row[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { row[t] = std::exp(row[t] - mx); sum += row[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) row[t] *= inv;
      }
      // out_g = sum_t p[g][t] v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        if (t + kPrefetchAhead < len)
          prefetch_row(row_ptr(v_cache, table, t + kPrefetchAhead, h, num_kv_heads, block_size, head_dim), head_dim);
        const scalar_t* v = row_ptr(v_cache, table, t, h, num_kv_heads, block_size, head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* a = acc.data() + g * head_dim;
          for (int64_t i = 0; i < head_dim; ++i) a[i] += p * static_cast<float>(v[i]);
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < head_dim; ++i)
          out_ptr[(s * num_heads + h * group + g) * head_dim + i] = static_cast<scalar_t>(acc[g * head_dim + i]);
    }
  });
}

}  // namespace

// q: [num_seqs, num_heads, head_dim]; kv_cache: [2, num_blocks, num_kv_heads, block_size, head_dim];
// block_tables: [num_seqs, max_blocks] int64; seq_lens: [num_seqs] int64. Returns [num_seqs, num_heads, head_dim].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5, "paged_decode_attention: bad ranks");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "paged_decode_attention: q and cache dtypes differ");
  TORCH_CHECK(q.size(1) % kv_cache.size(2) == 0, "paged_decode_attention: heads not a multiple of KV heads");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  TORCH_CHECK(kv_cache.is_contiguous(), "paged_decode_attention: the cache must be contiguous");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q, kv_cache, block_tables, seq_lens, scale, out);
  });
  return out;
}

// Registered as a dispatcher op (torch.ops.fivefold.paged_decode_attention) so that
// torch.profiler records it by name with its input shapes, like any aten op.
TORCH_LIBRARY_FRAGMENT(fivefold, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(fivefold, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
