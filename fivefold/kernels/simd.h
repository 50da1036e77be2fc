// Vector helpers shared by the kernels: one float vector type and its loads for the ISA the
// extension is compiled for (-march of fivefold.platform: native, or x86-64-v3 when AVX2 is
// forced). AVX-512: 16 floats per vector; AVX2: 8; otherwise plain C++ (width 1).
// Loads widen to float in registers: bf16 by a 16-bit shift, int8 by a sign extension, so no
// bf16 or VNNI instruction is needed and one source serves Zen 3 and Zen 4.
// Included by the kernels (each its own extension), directly or through panels.h: everything here
// is in an anonymous namespace, private to the including file.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using bf16 = at::BFloat16;

#if defined(__AVX512F__)
constexpr int64_t kWidth = 16;
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline Vec vload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline float vsum(Vec a) { return _mm512_reduce_add_ps(a); }
inline Vec vset1(float a) { return _mm512_set1_ps(a); }
inline void vstore(float* p, Vec a) { _mm512_storeu_ps(p, a); }
#elif defined(__AVX2__)
constexpr int64_t kWidth = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline Vec vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vset1(float a) { return _mm256_set1_ps(a); }
inline void vstore(float* p, Vec a) { _mm256_storeu_ps(p, a); }
inline float vsum(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
constexpr int64_t kWidth = 1;
using Vec = float;
inline Vec vzero() { return 0.f; }
inline Vec vload(const float* p) { return *p; }
inline Vec vload(const bf16* p) { return static_cast<float>(*p); }
inline Vec vload(const int8_t* p) { return static_cast<float>(*p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return a * b + c; }
inline Vec vmul(Vec a, Vec b) { return a * b; }
inline float vsum(Vec a) { return a; }
inline Vec vset1(float a) { return a; }
inline void vstore(float* p, Vec a) { *p = a; }
#endif

// The last, partial column step: the first `n` (< kWidth) floats, zeros after (the packed
// weights are zero there too, and x's row may end at the end of its allocation).
inline Vec xload_partial(const float* p, int64_t n) {
#if defined(__AVX512F__)
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
#elif defined(__AVX2__)
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane));
#else
  return n > 0 ? *p : 0.f;
#endif
}

}  // namespace
