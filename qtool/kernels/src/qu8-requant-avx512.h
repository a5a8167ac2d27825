/* The AVX-512 requantizing stores shared by the VNNI and AMX GEMMs: int32 sums times their
 * per-channel multipliers, then either float32 out, or clamp, round half to even, add the zero
 * point and narrow to uint8 (store16: one row of 16; store_pair_u8: two rows of 32 at once). One copy, so both tiers stay bit-identical by construction; the
 * AMX target is a superset of this one, so its kernels inline it too. */
#ifndef QU8_REQUANT_AVX512_H
#define QU8_REQUANT_AVX512_H
#include "qtool_kernels.h"
#if QT_X86
#include <immintrin.h>

QT_TARGET_AVX512VNNI QT_INLINE void store16(__m512i acc, const float* mult, void* c, __mmask16 m,
                                           const qt_requant* rq) {
  __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_loadu_ps(mult));
  if (rq->out_f32) {
    _mm512_mask_storeu_ps(c, m, f);
    return;
  }
  f = _mm512_min_ps(_mm512_max_ps(f, _mm512_set1_ps(rq->lo_f)), _mm512_set1_ps(rq->hi_f));
  __m512i i = _mm512_add_epi32(_mm512_cvt_roundps_epi32(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                               _mm512_set1_epi32(rq->zp));
  _mm_mask_storeu_epi8(c, m, _mm512_cvtepi32_epi8(i));
}

QT_TARGET_AVX512VNNI QT_INLINE __m512i rq_cvt(__m512i acc, __m512 m, __m512 hi) {
  __m512 f = _mm512_min_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc), m), hi);
  return _mm512_cvt_roundps_epi32(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* Lanes of columns from .. from + 15 of a panel whose first nc columns are valid. */
QT_INLINE __mmask16 col_mask16(size_t nc, size_t from) {
  return nc <= from ? 0 : nc - from >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nc - from)) - 1);
}

/* What store_pair_u8 needs for one 32-column panel, set up once per panel. */
typedef struct {
  __m512 m0, m1, hi;
  __m512i zp16, lo8, perm;
  __mmask32 mask;
} u8_pair;

QT_TARGET_AVX512VNNI QT_INLINE u8_pair u8_pair_setup(const float* mult, size_t nc, const qt_requant* rq) {
  u8_pair k;
  k.m0 = _mm512_loadu_ps(mult);
  k.m1 = _mm512_loadu_ps(mult + 16);
  k.hi = _mm512_set1_ps(rq->hi_f);
  k.zp16 = _mm512_set1_epi16((int16_t)rq->zp);
  k.lo8 = _mm512_set1_epi8((char)rq->lo);
  k.perm = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  k.mask = nc >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << nc) - 1);
  return k;
}

/* rows a (a0: columns 0-15, a1: 16-31) and b into ca and cb (cb only when store_b) */
QT_TARGET_AVX512VNNI QT_INLINE void store_pair_u8(__m512i a0, __m512i a1, __m512i b0, __m512i b1,
                                                 const u8_pair* k, uint8_t* ca, uint8_t* cb, int store_b) {
  const __m512i pa = _mm512_adds_epi16(_mm512_packs_epi32(rq_cvt(a0, k->m0, k->hi), rq_cvt(a1, k->m1, k->hi)), k->zp16);
  const __m512i pb = _mm512_adds_epi16(_mm512_packs_epi32(rq_cvt(b0, k->m0, k->hi), rq_cvt(b1, k->m1, k->hi)), k->zp16);
  __m512i y = _mm512_max_epu8(_mm512_packus_epi16(pa, pb), k->lo8);
  y = _mm512_permutexvar_epi32(k->perm, y);
  if (k->mask == 0xFFFFFFFFu) {  /* full panel: plain stores (masked ones cost more on AMD) */
    _mm256_storeu_si256((__m256i*)ca, _mm512_castsi512_si256(y));
    if (store_b) _mm256_storeu_si256((__m256i*)cb, _mm512_extracti64x4_epi64(y, 1));
    return;
  }
  _mm256_mask_storeu_epi8(ca, k->mask, _mm512_castsi512_si256(y));
  if (store_b) _mm256_mask_storeu_epi8(cb, k->mask, _mm512_extracti64x4_epi64(y, 1));
}

#endif
#endif
