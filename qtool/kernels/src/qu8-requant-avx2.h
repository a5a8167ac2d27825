/* The AVX2 GEMM epilogue shared by the exact (vpmaddwd) and vpmaddubsw kernels: 16 int32
 * accumulators of one output row -> float requantization (qtool_kernels.h) -> u8, or float32
 * for a dequantizing GEMM. */
#ifndef QU8_REQUANT_AVX2_H
#define QU8_REQUANT_AVX2_H
#include <immintrin.h>

#include "qtool_kernels.h"

QT_TARGET_AVX2 QT_INLINE void qt_avx2_store_row16(__m256i a0, __m256i a1, const float* mult, void* c,
                                                  size_t nc, const qt_requant* rq) {
  __m256 m0 = _mm256_loadu_ps(mult), m1 = _mm256_loadu_ps(mult + 8);
  __m256 f0 = _mm256_mul_ps(_mm256_cvtepi32_ps(a0), m0);
  __m256 f1 = _mm256_mul_ps(_mm256_cvtepi32_ps(a1), m1);
  if (rq->out_f32) {
    float tmp[16];
    float* cf = (float*)c;
    if (nc == 16) {
      _mm256_storeu_ps(cf, f0);
      _mm256_storeu_ps(cf + 8, f1);
    } else {
      _mm256_storeu_ps(tmp, f0);
      _mm256_storeu_ps(tmp + 8, f1);
      memcpy(cf, tmp, nc * sizeof(float));
    }
    return;
  }
  const __m256 lo = _mm256_set1_ps(rq->lo_f), hi = _mm256_set1_ps(rq->hi_f);
  f0 = _mm256_min_ps(_mm256_max_ps(f0, lo), hi);
  f1 = _mm256_min_ps(_mm256_max_ps(f1, lo), hi);
  const __m256i zp = _mm256_set1_epi32(rq->zp);
  __m256i i0 = _mm256_add_epi32(_mm256_cvtps_epi32(f0), zp);
  __m256i i1 = _mm256_add_epi32(_mm256_cvtps_epi32(f1), zp);
  __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8); /* 16 x i16 in order */
  __m128i b = _mm_packus_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1));
  if (nc == 16) {
    _mm_storeu_si128((__m128i*)c, b);
  } else {
    uint8_t tmp[16];
    _mm_storeu_si128((__m128i*)tmp, b);
    memcpy(c, tmp, nc);
  }
}
#endif
