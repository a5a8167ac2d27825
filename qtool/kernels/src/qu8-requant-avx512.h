/* The AVX-512 requantizing store shared by the VNNI and AMX GEMMs: 16 int32 sums times their
 * per-channel multipliers, then either float32 out, or clamp, round half to even, add the zero
 * point and narrow to uint8. One copy, so both tiers stay bit-identical by construction; the
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

#endif
#endif
