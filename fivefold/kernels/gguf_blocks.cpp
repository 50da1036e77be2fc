// GGUF 4-bit and K-quant blocks -> the codes and scales the int4 and int8 kernels take, at load time.
//
// A Q4_K_M 8B file holds 7.5 G weights in Q4_K and Q6_K super-blocks of 256. Unpacked with numpy
// (fivefold/models/gguf_file.py keeps that path as the reference and the fallback) they took
// 25 s of a 45 s load on two cores: each step of the bit manipulation is a full pass that writes
// a temporary as large as the tensor. Here each super-block is unpacked in one pass, in
// registers, blocks spread over the threads; the outputs are exactly numpy's (the same integer
// operations; d x sc is computed in float32, exact for a float16 times a 6- or 8-bit integer, and
// rounded to float16 to nearest even as numpy's astype does).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstring>
#include <tuple>

namespace {

constexpr int64_t kSuper = 256;       // weights per K-quant super-block
constexpr int64_t kQ4KBytes = 144;    // d, dmin (float16), 12 bytes of 6-bit sc_j and m_j, 128 of nibbles
constexpr int64_t kQ6KBytes = 210;    // 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d
constexpr int64_t kQ4 = 32;           // weights per Q4_0 / Q4_1 block
constexpr int64_t kGrain = 256;       // super-blocks per parallel task (64 KB of codes)

torch::Tensor blocks_of(const torch::Tensor& raw, int64_t bytes, const char* op) {
  TORCH_CHECK(raw.scalar_type() == torch::kUInt8 && raw.numel() % bytes == 0, op, ": expects uint8 blocks of ",
              bytes, " bytes, got ", raw.scalar_type(), " with ", raw.numel(), " elements");
  return raw.contiguous().view({raw.numel() / bytes, bytes});
}

float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

}  // namespace

// Q4_0 (d, 16 bytes of nibbles: w = d (q - 8)) or Q4_1 (d, m, 16 bytes: w = d q + m) blocks, uint8
// [B * 18 or 20] -> (codes uint8 [B, 32], scale float16 [B], offset float16 [B]: Q4_1's m, empty
// for Q4_0). Byte j of a block holds weight j in its low nibble and j + 16 in its high one.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> gguf_q4_unpack(torch::Tensor raw, bool has_min) {
  const int64_t head = has_min ? 4 : 2;
  const torch::Tensor blocks = blocks_of(raw, head + kQ4 / 2, "gguf_q4_unpack");
  const int64_t B = blocks.size(0);
  auto codes = torch::empty({B, kQ4}, blocks.options());
  auto scale = torch::empty({B}, blocks.options().dtype(torch::kHalf));
  auto offset = torch::empty({has_min ? B : 0}, blocks.options().dtype(torch::kHalf));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* q = codes.data_ptr<uint8_t>();
  uint16_t *d = reinterpret_cast<uint16_t*>(scale.data_ptr<c10::Half>()),
           *m = reinterpret_cast<uint16_t*>(offset.data_ptr<c10::Half>());
  at::parallel_for(0, B, 4 * kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* blk = src + b * (head + kQ4 / 2);
      std::memcpy(d + b, blk, 2);
      if (has_min) std::memcpy(m + b, blk + 2, 2);
      for (int l = 0; l < kQ4 / 2; ++l) {
        q[b * kQ4 + l] = blk[head + l] & 15;
        q[b * kQ4 + kQ4 / 2 + l] = blk[head + l] >> 4;
      }
    }
  });
  return {codes, scale, offset};
}

// Q4_K super-blocks, uint8 [B * 144] -> (codes uint8 [B, 256], sc uint8 [B, 8], m uint8 [B, 8],
// scale float16 [B, 8] = d sc_j, offset float16 [B, 8] = -dmin m_j). Sub-block j (32 weights) is
// w = d sc_j q - dmin m_j; its codes are the low nibbles of bytes 32 (j / 2) .. + 31 of the 128 for
// even j, the high ones for odd j. sc_j, m_j for j < 4: the low 6 bits of bytes j and j + 4 of the
// 12; for j >= 4: a nibble of byte j + 4 below the top 2 bits of bytes j - 4 (sc) and j (m).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> gguf_q4_k_unpack(
    torch::Tensor raw) {
  const torch::Tensor blocks = blocks_of(raw, kQ4KBytes, "gguf_q4_k_unpack");
  const int64_t B = blocks.size(0);
  const auto u8 = blocks.options();
  auto codes = torch::empty({B, kSuper}, u8), sc = torch::empty({B, 8}, u8), mn = torch::empty({B, 8}, u8);
  auto scale = torch::empty({B, 8}, u8.dtype(torch::kHalf)), offset = torch::empty({B, 8}, u8.dtype(torch::kHalf));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t *q = codes.data_ptr<uint8_t>(), *s = sc.data_ptr<uint8_t>(), *m = mn.data_ptr<uint8_t>();
  c10::Half *ds = scale.data_ptr<c10::Half>(), *dm = offset.data_ptr<c10::Half>();
  at::parallel_for(0, B, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* blk = src + b * kQ4KBytes;
      const float d = half_at(blk), dmin = half_at(blk + 2);
      const uint8_t* p = blk + 4;
      for (int j = 0; j < 8; ++j) {
        const uint8_t sj = j < 4 ? p[j] & 63 : (p[j + 4] & 15) | ((p[j - 4] >> 6) << 4);
        const uint8_t mj = j < 4 ? p[j + 4] & 63 : (p[j + 4] >> 4) | ((p[j] >> 6) << 4);
        s[b * 8 + j] = sj;
        m[b * 8 + j] = mj;
        ds[b * 8 + j] = c10::Half(d * static_cast<float>(sj));
        dm[b * 8 + j] = c10::Half(-(dmin * static_cast<float>(mj)));
      }
      const uint8_t* nib = blk + 16;
      uint8_t* out = q + b * kSuper;
      for (int i = 0; i < 4; ++i)
        for (int l = 0; l < 32; ++l) {
          out[64 * i + l] = nib[32 * i + l] & 15;
          out[64 * i + 32 + l] = nib[32 * i + l] >> 4;
        }
    }
  });
  return {codes, sc, mn, scale, offset};
}

// Q6_K super-blocks, uint8 [B * 210] -> (codes int8 [B, 256] = q - 32 in [-32, 31], scale float32
// [B, 16] = d sc_j rounded to float16). Each half h of 128 weights takes 64 low-nibble bytes
// (weights 0-63 from their low nibbles, 64-127 from their high ones) and 32 bytes of bit pairs
// (weight i's two high bits at bit 2 (i / 32) of byte i % 32); sc_j (int8) scales weights 16 j.. .
std::tuple<torch::Tensor, torch::Tensor> gguf_q6_k_unpack(torch::Tensor raw) {
  const torch::Tensor blocks = blocks_of(raw, kQ6KBytes, "gguf_q6_k_unpack");
  const int64_t B = blocks.size(0);
  auto codes = torch::empty({B, kSuper}, blocks.options().dtype(torch::kInt8));
  auto scale = torch::empty({B, 16}, blocks.options().dtype(torch::kFloat));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  int8_t* q = codes.data_ptr<int8_t>();
  float* sc = scale.data_ptr<float>();
  at::parallel_for(0, B, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* blk = src + b * kQ6KBytes;
      const float d = half_at(blk + 208);
      for (int j = 0; j < 16; ++j)
        sc[b * 16 + j] = static_cast<float>(c10::Half(d * static_cast<float>(static_cast<int8_t>(blk[192 + j]))));
      int8_t* out = q + b * kSuper;
      for (int h = 0; h < 2; ++h) {
        const uint8_t *low = blk + 64 * h, *high = blk + 128 + 32 * h;
        for (int i = 0; i < 128; ++i) {
          const int lo = i < 64 ? low[i] & 15 : low[i - 64] >> 4;
          const int hi = (high[i % 32] >> (2 * (i / 32))) & 3;
          out[128 * h + i] = static_cast<int8_t>((lo | (hi << 4)) - 32);
        }
      }
    }
  });
  return {codes, scale};
}

TORCH_LIBRARY_FRAGMENT(fivefold, m) {
  m.def("gguf_q4_unpack(Tensor blocks, bool has_min) -> (Tensor, Tensor, Tensor)");
  m.def("gguf_q4_k_unpack(Tensor blocks) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("gguf_q6_k_unpack(Tensor blocks) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(fivefold, CPU, m) {
  m.impl("gguf_q4_unpack", &gguf_q4_unpack);
  m.impl("gguf_q4_k_unpack", &gguf_q4_k_unpack);
  m.impl("gguf_q6_k_unpack", &gguf_q6_k_unpack);
}
