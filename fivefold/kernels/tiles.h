// The weight-streaming kernels' tile-major layout and its memory, shared by linear_stream.cpp
// (float32, bfloat16, int8 weights) and int4_linear.cpp (4-bit weights and their group scales).
// Everything here is in an anonymous namespace, private to the including file (each its own
// extension).
#pragma once

#include <torch/extension.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <cstdint>
#include <utility>
#include <vector>

namespace {

// Copies between a row-major [N, steps * inner] tensor and the tile-major layout [N, steps, inner]
// of tiles of C channels, either way: full tiles are [tiles, C, steps, inner] row-major and
// [tiles, steps, C, inner] in the layout; the narrower last tile of c channels is [c, steps, inner]
// and [steps, c, inner]. A tile is then one contiguous run that its thread reads front to back, and
// rows [n0, n0 + m) of the layout (n0 and m multiples of C, or m reaching N) are the memory of those
// channels: a slice of the layout is still in the layout.
void relayout(const torch::Tensor& row_major, const torch::Tensor& packed, int64_t C, bool to_packed) {
  const int64_t N = row_major.size(0), steps = packed.size(1), inner = packed.size(2);
  const int64_t full = N / C * C, rest = N - full;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> parts;  // (row-major view, packed view permuted to it)
  if (full > 0)
    parts.emplace_back(row_major.narrow(0, 0, full).view({full / C, C, steps, inner}),
                       packed.narrow(0, 0, full).view({full / C, steps, C, inner}).permute({0, 2, 1, 3}));
  if (rest > 0)
    parts.emplace_back(row_major.narrow(0, full, rest).view({rest, steps, inner}),
                       packed.narrow(0, full, rest).view({steps, rest, inner}).permute({1, 0, 2}));
  for (auto& [rows, tiles] : parts) to_packed ? tiles.copy_(rows) : rows.copy_(tiles);
}

// A weight is read front to back once per decode step. On 4 KB pages each page is a TLB miss (a
// two-level walk inside a VM) and a point where the hardware prefetcher stops; on 2 MB pages it
// streamed 5-8% faster (Zen 3, 121 SmolLM2 matrices from DRAM, alternating runs: float32
// 12.6-14.6 -> 13.1-15.6 GB/s, int8 10.6-12.1 -> 10.7-12.7). Transparent huge pages are asked for
// with madvise, the mode most distributions default to; where THP is off, the memory is plain
// 4 KB pages, as torch::empty's would be. Below 2 MB (no whole huge page) it is torch::empty.
torch::Tensor empty_on_huge_pages(at::IntArrayRef sizes, const torch::TensorOptions& options) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const size_t nbytes = c10::multiply_integers(sizes) * options.dtype().itemsize();
  if (nbytes >= kHuge) {
    const size_t len = (nbytes + 4095) / 4096 * 4096;
    void* raw = mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw != MAP_FAILED) {
      // Keep the 2 MB-aligned part of the mapping, so that every whole 2 MB of the weight can be a huge page.
      const uintptr_t begin = reinterpret_cast<uintptr_t>(raw), start = (begin + kHuge - 1) & ~(kHuge - 1);
      if (start > begin) munmap(raw, start - begin);
      if (const uintptr_t end = begin + len + kHuge; end > start + len) munmap(reinterpret_cast<void*>(start + len), end - start - len);
      void* data = reinterpret_cast<void*>(start);
      madvise(data, len, MADV_HUGEPAGE);  // advice: where THP is off it does nothing, and the pages stay 4 KB
      return torch::from_blob(data, sizes, [len](void* ptr) { munmap(ptr, len); }, options);
    }
  }
#endif
  return torch::empty(sizes, options);
}

}  // namespace
