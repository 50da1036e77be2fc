// Decode attention straight from the paged KV cache (one query token per sequence).
//
// The pure-PyTorch path has to gather every sequence's blocks into a padded copy
// before calling SDPA, which moves the whole context twice per layer. This kernel
// reads each key and value row once, where it lies in its block (head-major inside
// a block, so one head's 16 rows are one contiguous 4 KB run), and keeps the
// scores of one (sequence, KV head) pair in a thread-local buffer: grouped-query
// heads that share a KV head share the reads. Float32 accumulation for every dtype.
//
// The cache is float32, bfloat16 (the model's dtype) or int8 (kv_cache_dtype="int8",
// fivefold/models/kv_quant.py): int8 rows are head_dim values followed by their float32 scale,
// so a row is head_dim + 4 bytes and one read brings its scale; q . k is computed on the int8
// values converted to float and then scaled, and a value row's scale folds into its softmax weight.
// No float copy of the context is ever made.
//
// paged_prefill_attention is the same for several queries per sequence (a prompt chunk after
// earlier chunks, a prefix-cache hit, speculative verification): a tile of queries walks the
// context block by block with an online softmax (running max, sum and output per query), so
// neither a score row of the whole context nor a copy of it is held.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

template <typename cache_t>
inline float dot(const float* q, const cache_t* k, int64_t d) {
  float acc = 0.f;
  for (int64_t i = 0; i < d; ++i) acc += q[i] * static_cast<float>(k[i]);
  return acc;
}

// An int8 row carries its float32 scale after its head_dim values (kv_quant.py); other rows scale by 1.
template <typename cache_t>
constexpr int64_t row_extra() { return std::is_same_v<cache_t, int8_t> ? 4 : 0; }

template <typename cache_t>
inline float row_scale(const cache_t* row, int64_t head_dim) {
  if constexpr (std::is_same_v<cache_t, int8_t>) {
    float s;
    std::memcpy(&s, row + head_dim, sizeof(float));
    return s;
  } else {
    return 1.f;
  }
}

// Where a layer's keys or values lie: rows of row_size elements, head-major inside a block.
template <typename cache_t>
struct PagedRows {
  const cache_t* base;
  int64_t num_kv_heads, block_size, head_dim, row_size;

  PagedRows(const torch::Tensor& kv_cache, int64_t which)
      : base(kv_cache.data_ptr<cache_t>() + which * kv_cache.stride(0)), num_kv_heads(kv_cache.size(2)), block_size(kv_cache.size(3)),
        head_dim(kv_cache.size(4) - row_extra<cache_t>()), row_size(kv_cache.size(4)) {}

  // Row t of head h of a sequence, wherever its block lies.
  inline const cache_t* row(const int64_t* table, int64_t t, int64_t h) const {
    const int64_t block = table[t / block_size];
    return base + ((block * num_kv_heads + h) * block_size + t % block_size) * row_size;
  }
};

// Blocks are scattered, so the hardware prefetcher restarts at each one: ask for the
// row kPrefetchAhead positions on while working on this one.
constexpr int64_t kPrefetchAhead = 8;

// Locality 3 asks for the row in L1, 2 in L2 (the far prefetch of the vector kernel).
template <int kLocality = 3, typename cache_t>
inline void prefetch_row(const cache_t* row, int64_t row_size) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < row_size * static_cast<int64_t>(sizeof(cache_t)); off += 64) __builtin_prefetch(p + off, 0, kLocality);
}

// scalar_t: q and out (float32 or bfloat16); cache_t: the cache (scalar_t, or int8_t).
// Any head_dim: the fallback of decode_kernel_vec (head_dims that are not a multiple of the vector width).
template <typename scalar_t, typename cache_t>
void decode_kernel_any_dim(const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                   const torch::Tensor& seq_lens, double scale, torch::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const PagedRows<cache_t> keys(kv_cache, 0), vals(kv_cache, 1);
  const int64_t num_kv_heads = keys.num_kv_heads, row_size = keys.row_size;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
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
      // scores[g][t] = q_g . k_t (times k_t's scale for an int8 row)
      const int64_t* table = tables + s * max_blocks;
      for (int64_t t = 0; t < len; ++t) {
        if (t + kPrefetchAhead < len) prefetch_row(keys.row(table, t + kPrefetchAhead, h), row_size);
        const cache_t* k = keys.row(table, t, h);
        const float ks = row_scale(k, head_dim);
        for (int64_t g = 0; g < group; ++g) scores[g * len + t] = dot(qf.data() + g * head_dim, k, head_dim) * ks;
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
        if (t + kPrefetchAhead < len) prefetch_row(vals.row(table, t + kPrefetchAhead, h), row_size);
        const cache_t* v = vals.row(table, t, h);
        const float vs = row_scale(v, head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t] * vs;
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

// Block b's rows of head h: block_size rows of row_size elements, one contiguous run.
template <typename cache_t>
inline const cache_t* block_rows(const PagedRows<cache_t>& rows, int64_t block, int64_t h) {
  return rows.base + (block * rows.num_kv_heads + h) * rows.block_size * rows.row_size;
}

// The vector kernel asks for the row kPrefetchAhead rows on (into L1), and, into L2, the row
// of the run kFarRuns blocks on in the thread's walk (see Walk). The near prefetch alone was not
// enough: at ~25 cycles a row, 8 rows ahead is ~60 ns, less than a DRAM miss, and the vector
// kernel read 13 GB/s from DRAM where the scalar one, slower per row, read 16. With the far
// prefetch it reads 23-24 GB/s (64 sequences x 192 tokens, 30 layers' caches), 19-21 GB/s (one
// sequence of 2048); 4 runs ahead measured a little slower than 8, 16 rows ahead into L1 slower.
constexpr int64_t kFarRuns = 8;

// While on row r of a block, ask for the row kPrefetchAhead rows on: in this block, or in `next`.
template <typename cache_t>
inline void prefetch_ahead(const cache_t* row, const cache_t* next, int64_t r, int64_t block_size, int64_t row_size) {
  const int64_t ahead = r + kPrefetchAhead;
  if (ahead < block_size) prefetch_row(row + kPrefetchAhead * row_size, row_size);
  else if (ahead < 2 * block_size) prefetch_row(next + (ahead - block_size) * row_size, row_size);
}

// A thread reads its work items' runs in one order: item w's key blocks, its value blocks, then
// item w + 1's. Run i of that walk (counted from item w's first key block), or null past the
// thread's last item.
template <typename cache_t>
struct Walk {
  const PagedRows<cache_t>& keys;
  const PagedRows<cache_t>& vals;
  const int64_t* tables;
  const int64_t* lens;
  int64_t max_blocks, num_kv_heads, end;

  const cache_t* run(int64_t work, int64_t i) const {
    for (; work < end; ++work) {
      const int64_t s = work / num_kv_heads, h = work % num_kv_heads;
      const int64_t num_blocks = (lens[s] + keys.block_size - 1) / keys.block_size;
      if (i < 2 * num_blocks) {
        const int64_t* table = tables + s * max_blocks;
        return i < num_blocks ? block_rows(keys, table[i], h) : block_rows(vals, table[i - num_blocks], h);
      }
      i -= 2 * num_blocks;
    }
    return nullptr;
  }
};

// decode_kernel_any_dim for head_dim = NV vectors (simd.h's width): the same arithmetic in vector
// registers. The scalar kernel spends ~170 cycles per (row, KV head): a division by the block size
// per row it finds, and dot products and sums element by element; from cache it reads 22 GB/s.
// Here a work item walks its blocks (no division per row), holds a key row in NV registers while
// each grouped query head takes its dot product, and accumulates value rows in NV registers per
// query head while the block is in L1 (35-39 GB/s from cache); the prefetches above keep DRAM busy.
// Measured against the scalar kernel, same shapes, alternating runs (SmolLM2: 9 heads, 3 KV heads,
// head_dim 64; scattered blocks of 16; each layer's cache from DRAM): 64 x 192 tokens 1.10-1.20 ->
// 0.78-0.82 ms per layer, 1 x 2048 0.23-0.24 -> 0.15-0.17, 1 x 192 19 -> 13 us.
template <typename scalar_t, typename cache_t, int NV>
void decode_kernel_vec(const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                       const torch::Tensor& seq_lens, double scale, torch::Tensor& out) {
  constexpr int64_t D = NV * kWidth;
  const int64_t num_seqs = q.size(0), num_heads = q.size(1);
  const PagedRows<cache_t> keys(kv_cache, 0), vals(kv_cache, 1);
  const int64_t num_kv_heads = keys.num_kv_heads, row_size = keys.row_size, block_size = keys.block_size;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    const Walk<cache_t> walk{keys, vals, tables, lens, max_blocks, num_kv_heads, end};
    std::vector<float> scores, qf(group * D), acc(group * D), inv_sum(group);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t s = work / num_kv_heads, h = work % num_kv_heads;
      const int64_t len = lens[s], num_blocks = (len + block_size - 1) / block_size;
      const int64_t* table = tables + s * max_blocks;
      scores.resize(group * len);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < D; ++i)
          qf[g * D + i] = static_cast<float>(q_ptr[(s * num_heads + h * group + g) * D + i]) * scale;
      // scores[g][t] = q_g . k_t (times k_t's scale for an int8 row)
      for (int64_t b = 0; b < num_blocks; ++b) {
        const cache_t* row = block_rows(keys, table[b], h);
        const cache_t* next = b + 1 < num_blocks ? block_rows(keys, table[b + 1], h) : block_rows(vals, table[0], h);
        const int64_t t0 = b * block_size, n = std::min(block_size, len - t0);
        const cache_t* far = walk.run(work, b + kFarRuns);
        for (int64_t r = 0; r < n; ++r, row += row_size) {
          prefetch_ahead(row, next, r, block_size, row_size);
          if (far != nullptr) prefetch_row<2>(far + r * row_size, row_size);
          Vec k[NV];
          for (int j = 0; j < NV; ++j) k[j] = vload(row + j * kWidth);
          const float ks = row_scale(row, D);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * D;
            Vec a = vzero();
            for (int j = 0; j < NV; ++j) a = vfma(vload(qg + j * kWidth), k[j], a);
            scores[g * len + t0 + r] = vsum(a) * ks;
          }
        }
      }
      // softmax numerators per query head; the 1 / sum is applied to the output
      for (int64_t g = 0; g < group; ++g) {
        float* p = scores.data() + g * len;
        float mx = -std::numeric_limits<float>::max();
        for (int64_t t = 0; t < len; ++t) mx = std::max(mx, p[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { p[t] = std::exp(p[t] - mx); sum += p[t]; }
        inv_sum[g] = 1.f / sum;
      }
      // out_g = sum_t p[g][t] v_t, block by block; each query head's accumulators in registers
      for (int64_t b = 0; b < num_blocks; ++b) {
        const cache_t* rows = block_rows(vals, table[b], h);
        const cache_t* next = b + 1 < num_blocks ? block_rows(vals, table[b + 1], h) : rows;
        const cache_t* far = walk.run(work, num_blocks + b + kFarRuns);
        const int64_t t0 = b * block_size, n = std::min(block_size, len - t0);
        for (int64_t g = 0; g < group; ++g) {
          float* ag = acc.data() + g * D;
          Vec a[NV];
          for (int j = 0; j < NV; ++j) a[j] = b == 0 ? vzero() : vload(ag + j * kWidth);
          const float* p = scores.data() + g * len + t0;
          const cache_t* row = rows;
          for (int64_t r = 0; r < n; ++r, row += row_size) {
            if (g == 0) {
              prefetch_ahead(row, next, r, block_size, row_size);
              if (far != nullptr) prefetch_row<2>(far + r * row_size, row_size);
            }
            const Vec w = vset1(p[r] * row_scale(row, D));
            for (int j = 0; j < NV; ++j) a[j] = vfma(w, vload(row + j * kWidth), a[j]);
          }
          for (int j = 0; j < NV; ++j) vstore(ag + j * kWidth, a[j]);
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < D; ++i)
          out_ptr[(s * num_heads + h * group + g) * D + i] = static_cast<scalar_t>(acc[g * D + i] * inv_sum[g]);
    }
  });
}

// The vector kernel where head_dim is 1, 2, 4, 8 or 16 vectors, else the scalar one.
template <typename scalar_t, typename cache_t>
void decode_kernel(const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                   const torch::Tensor& seq_lens, double scale, torch::Tensor& out) {
  const int64_t head_dim = q.size(2);
  const int64_t num_vectors = kWidth > 1 && head_dim % kWidth == 0 ? head_dim / kWidth : 0;
  if constexpr (std::is_same_v<cache_t, double>) {  // instantiated by the dtype dispatch, refused by check_cache
    return decode_kernel_any_dim<scalar_t, cache_t>(q, kv_cache, block_tables, seq_lens, scale, out);
  } else switch (num_vectors) {
    case 1: return decode_kernel_vec<scalar_t, cache_t, 1>(q, kv_cache, block_tables, seq_lens, scale, out);
    case 2: return decode_kernel_vec<scalar_t, cache_t, 2>(q, kv_cache, block_tables, seq_lens, scale, out);
    case 4: return decode_kernel_vec<scalar_t, cache_t, 4>(q, kv_cache, block_tables, seq_lens, scale, out);
    case 8: return decode_kernel_vec<scalar_t, cache_t, 8>(q, kv_cache, block_tables, seq_lens, scale, out);
    case 16: return decode_kernel_vec<scalar_t, cache_t, 16>(q, kv_cache, block_tables, seq_lens, scale, out);
    default: return decode_kernel_any_dim<scalar_t, cache_t>(q, kv_cache, block_tables, seq_lens, scale, out);
  }
}

// Queries per tile of paged_prefill_attention: a tile shares each key and value row it reads
// (and an int8 row's conversion) among its queries and their grouped heads.
constexpr int64_t kQueryTile = 16;

template <typename scalar_t, typename cache_t>
void prefill_kernel(const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                    const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens, double scale,
                    torch::Tensor& out) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const PagedRows<cache_t> keys(kv_cache, 0), vals(kv_cache, 1);
  const int64_t num_kv_heads = keys.num_kv_heads, block_size = keys.block_size;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t num_seqs = seq_lens.size(0);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();

  // Work items: (sequence, first query of its tile); each runs every KV head of the tile.
  std::vector<std::pair<int64_t, int64_t>> tiles;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t j = starts[s]; j < starts[s + 1]; j += kQueryTile) tiles.emplace_back(s, j);

  const int64_t num_items = static_cast<int64_t>(tiles.size()) * num_kv_heads;
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows = kQueryTile * group;  // (query, grouped head) pairs of a tile
    std::vector<float> qf(rows * head_dim), acc(rows * head_dim), mx(rows), sum(rows), p(rows * block_size);
    for (int64_t work = begin; work < end; ++work) {
      const auto [s, j0] = tiles[work / num_kv_heads];
      const int64_t h = work % num_kv_heads;
      const int64_t j1 = std::min(j0 + kQueryTile, starts[s + 1]);
      const int64_t num_q = j1 - j0;
      // Query j (a flat row) sits at position first_pos + (j - starts[s]) and sees keys 0..that position.
      const int64_t first_pos = lens[s] - (starts[s + 1] - starts[s]);
      const int64_t pos0 = first_pos + (j0 - starts[s]);
      const int64_t last = first_pos + (j1 - 1 - starts[s]);  // the tile's last query position
      const int64_t* table = tables + s * max_blocks;
      for (int64_t r = 0; r < num_q; ++r)
        for (int64_t g = 0; g < group; ++g)
          for (int64_t i = 0; i < head_dim; ++i)
            qf[(r * group + g) * head_dim + i] =
                static_cast<float>(q_ptr[((j0 + r) * num_heads + h * group + g) * head_dim + i]) * scale;
      std::fill(acc.begin(), acc.begin() + num_q * group * head_dim, 0.f);
      std::fill(mx.begin(), mx.begin() + num_q * group, -std::numeric_limits<float>::max());
      std::fill(sum.begin(), sum.begin() + num_q * group, 0.f);
      for (int64_t t0 = 0; t0 <= last; t0 += block_size) {
        const int64_t t1 = std::min(t0 + block_size, last + 1);  // keys t0..t1-1 of this block
        // Scores of the block: p[row][t - t0], 0 (unused) past a query's position. No infinities
        // anywhere: the kernels are compiled with -ffast-math, which assumes finite floats.
        for (int64_t t = t0; t < t1; ++t) {
          const cache_t* k = keys.row(table, t, h);
          const float ks = row_scale(k, head_dim);
          for (int64_t r = 0; r < num_q; ++r) {
            const bool visible = t <= pos0 + r;
            for (int64_t g = 0; g < group; ++g) {
              const int64_t row = r * group + g;
              p[row * block_size + (t - t0)] = visible ? dot(qf.data() + row * head_dim, k, head_dim) * ks : 0.f;
            }
          }
        }
        // Online softmax: rescale what was summed so far to the new running max.
        for (int64_t r = 0; r < num_q; ++r) {
          const int64_t num_visible = std::min(t1, pos0 + r + 1) - t0;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t row = r * group + g;
            float* pr = p.data() + row * block_size;
            if (num_visible <= 0) {
              for (int64_t t = 0; t < t1 - t0; ++t) pr[t] = 0.f;
              continue;
            }
            float block_max = -std::numeric_limits<float>::max();
            for (int64_t t = 0; t < num_visible; ++t) block_max = std::max(block_max, pr[t]);
            const float new_max = std::max(mx[row], block_max);
            const float correction = std::exp(mx[row] - new_max);  // exp(-3e38) = 0 on the first visible block
            float block_sum = 0.f;
            for (int64_t t = 0; t < num_visible; ++t) { pr[t] = std::exp(pr[t] - new_max); block_sum += pr[t]; }
            for (int64_t t = num_visible; t < t1 - t0; ++t) pr[t] = 0.f;
            sum[row] = sum[row] * correction + block_sum;
            mx[row] = new_max;
            float* a = acc.data() + row * head_dim;
            for (int64_t i = 0; i < head_dim; ++i) a[i] *= correction;
          }
        }
        for (int64_t t = t0; t < t1; ++t) {
          const cache_t* v = vals.row(table, t, h);
          const float vs = row_scale(v, head_dim);
          for (int64_t row = 0; row < num_q * group; ++row) {
            const float w = p[row * block_size + (t - t0)] * vs;
            if (w == 0.f) continue;
            float* a = acc.data() + row * head_dim;
            for (int64_t i = 0; i < head_dim; ++i) a[i] += w * static_cast<float>(v[i]);
          }
        }
      }
      for (int64_t r = 0; r < num_q; ++r)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t row = r * group + g;
          const float inv = 1.f / sum[row];
          for (int64_t i = 0; i < head_dim; ++i)
            out_ptr[((j0 + r) * num_heads + h * group + g) * head_dim + i] =
                static_cast<scalar_t>(acc[row * head_dim + i] * inv);
        }
    }
  });
}

// The cache's row width and dtype against q: the model's dtype with rows of head_dim, or int8
// with rows of head_dim + 4 (the scale).
bool check_cache(const char* op, const torch::Tensor& q, const torch::Tensor& kv_cache) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2, op, ": bad ranks");
  TORCH_CHECK(q.size(1) % kv_cache.size(2) == 0, op, ": heads not a multiple of KV heads");
  TORCH_CHECK(kv_cache.is_contiguous(), op, ": the cache must be contiguous");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16, op,
              ": q must be float32 or bfloat16");
  const bool is_int8 = kv_cache.scalar_type() == torch::kInt8;
  if (is_int8) {
    TORCH_CHECK(kv_cache.size(4) == q.size(2) + 4 && q.size(2) % 4 == 0, op,
                ": an int8 cache's rows are head_dim + 4 bytes (values, then a float32 scale), head_dim % 4 == 0");
  } else {
    TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), op, ": q and cache dtypes differ");
    TORCH_CHECK(kv_cache.size(4) == q.size(2), op, ": the cache's head_dim differs from q's");
  }
  return is_int8;
}

}  // namespace

// q: [num_seqs, num_heads, head_dim]; kv_cache: [2, num_blocks, num_kv_heads, block_size, head_dim]
// of q's dtype, or int8 [..., head_dim + 4]; block_tables: [num_seqs, max_blocks] int64;
// seq_lens: [num_seqs] int64. Returns [num_seqs, num_heads, head_dim].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale) {
  const bool is_int8 = check_cache("paged_decode_attention", q, kv_cache);
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    if (is_int8) decode_kernel<scalar_t, int8_t>(q, kv_cache, block_tables, seq_lens, scale, out);
    else decode_kernel<scalar_t, scalar_t>(q, kv_cache, block_tables, seq_lens, scale, out);
  });
  return out;
}

// q: [num_tokens, num_heads, head_dim], the new tokens of num_seqs sequences concatenated, sequence s
// owning rows query_start_loc[s]:query_start_loc[s+1] ([num_seqs + 1] int64); seq_lens: [num_seqs]
// int64, each context after its new tokens (all already written to the cache); kv_cache and
// block_tables as above. Causal: query j of sequence s sits at position seq_lens[s] - query_len + j
// and sees keys 0..that position. Returns [num_tokens, num_heads, head_dim].
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                      torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale) {
  const bool is_int8 = check_cache("paged_prefill_attention", q, kv_cache);
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.size(0) == seq_lens.size(0) + 1 &&
              block_tables.size(0) == seq_lens.size(0), "paged_prefill_attention: inconsistent sequence counts");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  query_start_loc = query_start_loc.contiguous();
  seq_lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, q.scalar_type(), "paged_prefill_attention", [&] {
    if (is_int8) prefill_kernel<scalar_t, int8_t>(q, kv_cache, block_tables, query_start_loc, seq_lens, scale, out);
    else prefill_kernel<scalar_t, scalar_t>(q, kv_cache, block_tables, query_start_loc, seq_lens, scale, out);
  });
  return out;
}

// Registered as dispatcher ops (torch.ops.fivefold.paged_decode_attention, ...) so that
// torch.profiler records them by name with their input shapes, like any aten op.
TORCH_LIBRARY_FRAGMENT(fivefold, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
  m.def("paged_prefill_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor query_start_loc, "
        "Tensor seq_lens, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(fivefold, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
