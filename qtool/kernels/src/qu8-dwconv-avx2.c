/* AVX2 depthwise convolution, 16 channels per tile (kept for comparisons, qt_set_exact_only; the
 * tier runs qu8-dwconv-avx2-maddubs.c): inputs zero-extended to int32 (vpmovzxbd),
 * weights stored as int32 whose high 16 bits are 0, so vpmaddwd gives x * w exactly.
 * Tile: int32 bias[16], float mult[16], int32 w[ks][16]. */
#include "qtool_kernels.h"
#if QT_X86
#include <immintrin.h>

#define CT 16

static size_t packed_size(size_t channels, size_t ks) {
  size_t tiles = (channels + CT - 1) / CT;
  return tiles * (CT * 8 + ks * CT * 4);
}

static void pack(size_t channels, size_t ks, const int8_t* w, const int32_t* bias, const float* mult,
                 void* out) {
  char* p = (char*)out;
  for (size_t c0 = 0; c0 < channels; c0 += CT) {
    int32_t* b = (int32_t*)p;
    float* m = (float*)(b + CT);
    int32_t* wt = (int32_t*)(m + CT);
    for (size_t j = 0; j < CT; j++) {
      size_t c = c0 + j;
      b[j] = c < channels ? bias[c] : 0;
      m[j] = c < channels ? mult[c] : 0.0f;
      for (size_t t = 0; t < ks; t++)
        wt[t * CT + j] = c < channels ? (int32_t)(uint16_t)(int16_t)w[c * ks + t] : 0;
    }
    p += CT * 8 + ks * CT * 4;
  }
}

QT_TARGET_AVX2 QT_INLINE __m128i requant8(__m256i acc, const float* mult, const qt_requant* rq) {
  __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_loadu_ps(mult));
  f = _mm256_min_ps(_mm256_max_ps(f, _mm256_set1_ps(rq->lo_f)), _mm256_set1_ps(rq->hi_f));
  __m256i i = _mm256_add_epi32(_mm256_cvtps_epi32(f), _mm256_set1_epi32(rq->zp));
  return _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
}

QT_TARGET_AVX2
void qu8_qs8w_dwconv_minmax_fp32_ukernel_c16__avx2(size_t channels, size_t ow, size_t ks, const uint8_t* const* in, size_t in_step, ptrdiff_t in_offset, const uint8_t* zero, const void* w, uint8_t* out, size_t out_stride, const qt_requant* rq) {
  const size_t tile_bytes = CT * 8 + ks * CT * 4;
  const char* wtile = (const char*)w;
  for (size_t c0 = 0; c0 < channels; c0 += CT, wtile += tile_bytes) {
    const int32_t* bias = (const int32_t*)wtile;
    const float* mult = (const float*)(bias + CT);
    const int32_t* wt0 = (const int32_t*)(mult + CT);
    const size_t n = channels - c0 < CT ? channels - c0 : CT;
    for (size_t p = 0; p < ow; p++) {
      const uint8_t* const* ip = in + p * in_step;
      __m256i acc0 = _mm256_loadu_si256((const __m256i*)bias);
      __m256i acc1 = _mm256_loadu_si256((const __m256i*)(bias + 8));
      const int32_t* wt = wt0;
      if (n == CT) {
        for (size_t t = 0; t < ks; t++, wt += CT) {
          const __m128i xv = _mm_loadu_si128((const __m128i*)(QT_DW_PTR(ip[t], in_offset, zero) + c0));
          acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(_mm256_cvtepu8_epi32(xv),
                                                          _mm256_loadu_si256((const __m256i*)wt)));
          acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(_mm256_cvtepu8_epi32(_mm_srli_si128(xv, 8)),
                                                          _mm256_loadu_si256((const __m256i*)(wt + 8))));
        }
      } else {
        uint8_t tmp[CT] = {0};
        for (size_t t = 0; t < ks; t++, wt += CT) {
          memcpy(tmp, QT_DW_PTR(ip[t], in_offset, zero) + c0, n);
          const __m128i xv = _mm_loadu_si128((const __m128i*)tmp);
          acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(_mm256_cvtepu8_epi32(xv),
                                                          _mm256_loadu_si256((const __m256i*)wt)));
          acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(_mm256_cvtepu8_epi32(_mm_srli_si128(xv, 8)),
                                                          _mm256_loadu_si256((const __m256i*)(wt + 8))));
        }
      }
      __m128i b = _mm_packus_epi16(requant8(acc0, mult, rq), requant8(acc1, mult + 8, rq));
      uint8_t* o = out + p * out_stride + c0;
      if (n == CT) {
        _mm_storeu_si128((__m128i*)o, b);
      } else {
        uint8_t tmp[CT];
        _mm_storeu_si128((__m128i*)tmp, b);
        memcpy(o, tmp, n);
      }
    }
  }
}

const qt_dwconv_config qt_dwconv_avx2 = {"qu8_qs8w_dwconv_minmax_fp32_ukernel_c16__avx2",
                                         qu8_qs8w_dwconv_minmax_fp32_ukernel_c16__avx2, CT,
                                         packed_size, pack};
#else
const qt_dwconv_config qt_dwconv_avx2 = {0};
#endif
