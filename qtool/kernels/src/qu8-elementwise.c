/* Elementwise, pooling and requantizing-copy kernels. One C body per op, compiled for each ISA
 * by inlining it into a function with that ISA's target attribute (GCC/Clang auto-vectorize the
 * channel loops; float math is plain mul/add, no contraction, so every ISA is bit-exact). */
#include "qtool_kernels.h"

QT_INLINE uint8_t rq_u8(float y, const qt_requant* rq) {
  y = y < rq->lo_f ? rq->lo_f : y;
  y = y > rq->hi_f ? rq->hi_f : y;
  return (uint8_t)((int32_t)qt_rint_small(y) + rq->zp);
}

/* ONNX Runtime's QLinearAdd (MLAS) bit for bit: the zero points are folded into one float32
 * constant `fixed` = zy - fma(ma, za, mb * zb) (ORT's build contracts it); then t = fma(a, ma, fma(b, mb, fixed)) on the raw
 * u8 values, clamped to [lo, hi] and rounded half to even. (za, zb only enter through `fixed`.) */
QT_INLINE void add_body(size_t n, const uint8_t* a, const uint8_t* b, uint8_t* y, float ma, int32_t za,
                        float mb, int32_t zb, const qt_requant* rq) {
  const float lo = rq->lo_f, hi = rq->hi_f;
  const float fixed = (float)rq->zp - __builtin_fmaf(ma, (float)za, mb * (float)zb);
  for (size_t i = 0; i < n; i++) {
    float v = __builtin_fmaf((float)a[i], ma, __builtin_fmaf((float)b[i], mb, fixed));
    v = v < lo ? lo : v;
    v = v > hi ? hi : v;
    y[i] = (uint8_t)(int32_t)qt_rint_small(v);
  }
}

QT_INLINE void max_body(size_t n, const uint8_t* x, uint8_t* acc) {
  for (size_t i = 0; i < n; i++) acc[i] = x[i] > acc[i] ? x[i] : acc[i];
}

/* One pooled pixel: max over `nt` tap rows of n channels (no taps -> 0). */
QT_INLINE void maxpix_body(size_t n, size_t nt, const uint8_t* const* taps, uint8_t* y) {
  if (nt == 0) {
    memset(y, 0, n);
    return;
  }
  const uint8_t* t0 = taps[0];
  for (size_t i = 0; i < n; i++) y[i] = t0[i];
  for (size_t t = 1; t < nt; t++) {
    const uint8_t* x = taps[t];
    for (size_t i = 0; i < n; i++) y[i] = x[i] > y[i] ? x[i] : y[i];
  }
}

/* One pooled pixel: acc = sum over `nt` tap rows of n channels. */
QT_INLINE void sumpix_body(size_t n, size_t nt, const uint8_t* const* taps, int32_t* acc) {
  for (size_t i = 0; i < n; i++) acc[i] = 0;
  for (size_t t = 0; t < nt; t++) {
    const uint8_t* x = taps[t];
    for (size_t i = 0; i < n; i++) acc[i] += x[i];
  }
}

QT_INLINE void sum_body(size_t n, const uint8_t* x, int32_t* acc) {
  for (size_t i = 0; i < n; i++) acc[i] += x[i];
}

QT_INLINE void avg_out_body(size_t n, const int32_t* acc, int32_t bias, float m, uint8_t* y,
                            const qt_requant* rq) {
  const float lo = rq->lo_f, hi = rq->hi_f;
  const int32_t zp = rq->zp;
  for (size_t i = 0; i < n; i++) {
    float v = (float)(acc[i] + bias) * m;
    v = v < lo ? lo : v;
    v = v > hi ? hi : v;
    y[i] = (uint8_t)((int32_t)qt_rint_small(v) + zp);
  }
}

QT_INLINE void requant_copy_body(size_t n, const uint8_t* x, int32_t zx, float m, uint8_t* y,
                                 const qt_requant* rq) {
  const float lo = rq->lo_f, hi = rq->hi_f;
  const int32_t zp = rq->zp;
  for (size_t i = 0; i < n; i++) {
    float v = (float)((int32_t)x[i] - zx) * m;
    v = v < lo ? lo : v;
    v = v > hi ? hi : v;
    y[i] = (uint8_t)((int32_t)qt_rint_small(v) + zp);
  }
}

/* ONNX Runtime's QLinearMul (MLAS x86): p = (a - za) * (b - zb) in int32, t = float(p) * ratio +
 * float(zy) (two roundings, no FMA), y = sat_u8(rint(t)), then the fused clamp. */
QT_INLINE void mul_body(size_t n, const uint8_t* a, const uint8_t* b, uint8_t* y, float ratio,
                        int32_t za, int32_t zb, const qt_requant* rq) {
  const float lo = rq->lo_f, hi = rq->hi_f, zy = (float)rq->zp;
  for (size_t i = 0; i < n; i++) {
    const int32_t p = ((int32_t)a[i] - za) * ((int32_t)b[i] - zb);
    float v = (float)p * ratio;
    v = v + zy;
    v = v < lo ? lo : v;
    v = v > hi ? hi : v;
    y[i] = (uint8_t)(int32_t)qt_rint_small(v);
  }
}

/* QuantizeLinear of one contiguous float row: sat_u8(rint(x / scale) + zp) (true division). */
QT_INLINE void quant_row_body(size_t n, const float* x, float scale, int32_t zp, uint8_t* y) {
  const float lo = (float)(0 - zp), hi = (float)(255 - zp);
  for (size_t i = 0; i < n; i++) {
    float v = x[i] / scale;
    v = v > lo ? v : lo;  /* NaN -> lo, as MLAS's max_ps */
    v = v < hi ? v : hi;
    y[i] = (uint8_t)((int32_t)qt_rint_small(v) + zp);
  }
}

#define QT_DEFINE_ISA(SUFFIX, ATTR)                                                              \
  ATTR void qu8_vadd_minmax_fp32_ukernel__##SUFFIX(size_t n, const uint8_t* a, const uint8_t* b, \
                                                   uint8_t* y, float ma, int32_t za, float mb,   \
                                                   int32_t zb, const qt_requant* rq) {           \
    add_body(n, a, b, y, ma, za, mb, zb, rq);                                                    \
  }                                                                                              \
  ATTR void qu8_vmax_ukernel__##SUFFIX(size_t n, const uint8_t* x, uint8_t* acc) {               \
    max_body(n, x, acc);                                                                         \
  }                                                                                              \
  ATTR void qu8_vsum_ukernel__##SUFFIX(size_t n, const uint8_t* x, int32_t* acc) {               \
    sum_body(n, x, acc);                                                                         \
  }                                                                                              \
  ATTR void qu8_maxpool_ukernel__##SUFFIX(size_t n, size_t nt, const uint8_t* const* taps,      \
                                          uint8_t* y) {                                          \
    maxpix_body(n, nt, taps, y);                                                                 \
  }                                                                                              \
  ATTR void qu8_sumpool_ukernel__##SUFFIX(size_t n, size_t nt, const uint8_t* const* taps,      \
                                          int32_t* acc) {                                        \
    sumpix_body(n, nt, taps, acc);                                                               \
  }                                                                                              \
  ATTR void qs32_qu8_vrequant_fp32_ukernel__##SUFFIX(size_t n, const int32_t* acc, int32_t bias, \
                                                     float m, uint8_t* y, const qt_requant* rq) { \
    avg_out_body(n, acc, bias, m, y, rq);                                                        \
  }                                                                                              \
  ATTR void qu8_vrequant_fp32_ukernel__##SUFFIX(size_t n, const uint8_t* x, int32_t zx, float m, \
                                                uint8_t* y, const qt_requant* rq) {              \
    requant_copy_body(n, x, zx, m, y, rq);                                                       \
  }                                                                                              \
  ATTR void qu8_vmul_minmax_fp32_ukernel__##SUFFIX(size_t n, const uint8_t* a, const uint8_t* b, \
                                                   uint8_t* y, float ratio, int32_t za,          \
                                                   int32_t zb, const qt_requant* rq) {           \
    mul_body(n, a, b, y, ratio, za, zb, rq);                                                     \
  }                                                                                              \
  ATTR void f32_qu8_vcvt_ukernel__##SUFFIX(size_t n, const float* x, float scale, int32_t zp,    \
                                           uint8_t* y) {                                         \
    quant_row_body(n, x, scale, zp, y);                                                          \
  }

#if QT_X86
#include <immintrin.h>
void qu8_vadd_minmax_fp32_ukernel__avx512skx(size_t n, const uint8_t* a, const uint8_t* b, uint8_t* y,
                                             float ma, int32_t za, float mb, int32_t zb,
                                             const qt_requant* rq);
void qu8_maxpool_ukernel__avx512skx(size_t n, size_t nt, const uint8_t* const* taps, uint8_t* y);
void qu8_sumpool_ukernel__avx512skx(size_t n, size_t nt, const uint8_t* const* taps, int32_t* acc);
#endif

QT_DEFINE_ISA(scalar, )
#if QT_X86
QT_DEFINE_ISA(avx2, QT_TARGET_AVX2)
QT_DEFINE_ISA(avx512vnni, QT_TARGET_AVX512VNNI)
#endif

void qt_fill_elementwise(qt_dispatch* d, int isa) {
#define QT_FILL(SUFFIX)                                        \
  d->add = qu8_vadd_minmax_fp32_ukernel__##SUFFIX;             \
  d->add_name = "qu8_vadd_minmax_fp32_ukernel__" #SUFFIX;      \
  d->vmax = qu8_vmax_ukernel__##SUFFIX;                        \
  d->vsum = qu8_vsum_ukernel__##SUFFIX;                        \
  d->maxpix = qu8_maxpool_ukernel__##SUFFIX;                   \
  d->sumpix = qu8_sumpool_ukernel__##SUFFIX;                   \
  d->avg_out = qs32_qu8_vrequant_fp32_ukernel__##SUFFIX;       \
  d->requant_copy = qu8_vrequant_fp32_ukernel__##SUFFIX;       \
  d->mul = qu8_vmul_minmax_fp32_ukernel__##SUFFIX;             \
  d->quant_row = f32_qu8_vcvt_ukernel__##SUFFIX;
#if QT_X86
  if (isa == QT_ISA_AVX512VNNI) {
    QT_FILL(avx512vnni)
    d->add = qu8_vadd_minmax_fp32_ukernel__avx512skx;
    d->add_name = "qu8_vadd_minmax_fp32_ukernel__avx512skx";
    d->maxpix = qu8_maxpool_ukernel__avx512skx;
    d->sumpix = qu8_sumpool_ukernel__avx512skx;
    return;
  }
  if (isa == QT_ISA_AVX2) { QT_FILL(avx2) return; }
#endif
  (void)isa;
  QT_FILL(scalar)
#undef QT_FILL
}

/* 256-entry table lookup, y[i] = t[x[i]]. */
void qu8_lut_ukernel__scalar(size_t n, const uint8_t* x, const uint8_t* t, uint8_t* y) {
  for (size_t i = 0; i < n; i++) y[i] = t[x[i]];
}

#if QT_X86
#include <immintrin.h>
/* AVX-512 VBMI: two vpermi2b lookups (table halves) blended on bit 7; 64 bytes per step. */
__attribute__((target("avx512f,avx512bw,avx512vbmi")))
void qu8_lut_ukernel__avx512vbmi(size_t n, const uint8_t* x, const uint8_t* t, uint8_t* y) {
  const __m512i t0 = _mm512_loadu_si512(t), t1 = _mm512_loadu_si512(t + 64),
                t2 = _mm512_loadu_si512(t + 128), t3 = _mm512_loadu_si512(t + 192);
  size_t i = 0;
  for (; i < n; i += 64) {
    const __mmask64 m = n - i >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (n - i)) - 1);
    const __m512i v = _mm512_maskz_loadu_epi8(m, x + i);
    const __m512i lo = _mm512_permutex2var_epi8(t0, v, t1);  /* index bits 0-6 */
    const __m512i hi = _mm512_permutex2var_epi8(t2, v, t3);
    const __mmask64 upper = _mm512_movepi8_mask(v);            /* bit 7 */
    _mm512_mask_storeu_epi8(y + i, m, _mm512_mask_blend_epi8(upper, lo, hi));
  }
}
#endif

/* Three planes -> interleaved triples: y[3i + k] = plane k [i] (the NCHW -> NHWC step of the
 * graph-boundary quantize for RGB input). */
void qu8_interleave3_ukernel__scalar(size_t n, const uint8_t* p0, const uint8_t* p1,
                                     const uint8_t* p2, uint8_t* y) {
  for (size_t i = 0; i < n; i++) {
    y[3 * i] = p0[i];
    y[3 * i + 1] = p1[i];
    y[3 * i + 2] = p2[i];
  }
}

#if QT_X86
/* VBMI: 16 bytes of each plane side by side in one zmm, one vpermb to the 48 interleaved bytes. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi")))
void qu8_interleave3_ukernel__avx512vbmi(size_t n, const uint8_t* p0, const uint8_t* p1,
                                         const uint8_t* p2, uint8_t* y) {
  uint8_t idx[64];
  for (int i = 0; i < 64; i++) idx[i] = (uint8_t)(i < 48 ? (i % 3) * 16 + i / 3 : 0);
  const __m512i perm = _mm512_loadu_si512(idx);
  size_t i = 0;
  for (; i < n; i += 16) {
    const size_t r = n - i < 16 ? n - i : 16;
    const __mmask16 m = (__mmask16)((1u << r) - 1);
    __m512i v = _mm512_castsi128_si512(_mm_maskz_loadu_epi8(m, p0 + i));
    v = _mm512_inserti32x4(v, _mm_maskz_loadu_epi8(m, p1 + i), 1);
    v = _mm512_inserti32x4(v, _mm_maskz_loadu_epi8(m, p2 + i), 2);
    const __mmask64 sm = r == 16 ? (__mmask64)0xFFFFFFFFFFFFull : (((__mmask64)1 << (3 * r)) - 1);
    _mm512_mask_storeu_epi8(y + 3 * i, sm, _mm512_permutexvar_epi8(perm, v));
  }
}

/* AVX-512 add, same arithmetic as add_body (bit-exact): per 64 elements 8 zero-extensions, 8
 * conversions, 8 FMAs, 4 float clamps to hi, 4 round-half-even conversions, then saturating packs
 * (an out-of-range negative saturates to 0) and one u8 max/min for [lo, hi]. */
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq")))
void qu8_vadd_minmax_fp32_ukernel__avx512skx(size_t n, const uint8_t* a, const uint8_t* b, uint8_t* y,
                                             float ma, int32_t za, float mb, int32_t zb,
                                             const qt_requant* rq) {
  const float fixed_s = (float)rq->zp - __builtin_fmaf(ma, (float)za, mb * (float)zb);
  const __m512 vma = _mm512_set1_ps(ma), vmb = _mm512_set1_ps(mb), fixed = _mm512_set1_ps(fixed_s);
  const __m512 hi = _mm512_set1_ps(rq->hi_f);
  const __m512i lo8 = _mm512_set1_epi8((char)rq->lo);
  const __m512i perm = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
#define QT_ADD16(OFF)                                                                          \
  _mm512_cvt_roundps_epi32(                                                                    \
      _mm512_min_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(                   \
                                        _mm_loadu_si128((const __m128i*)(a + i + OFF)))),      \
                                    vma,                                                       \
                                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(   \
                                                        _mm_loadu_si128((const __m128i*)(b + i + OFF)))), \
                                                    vmb, fixed)),                              \
                    hi),                                                                       \
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i p01 = _mm512_packs_epi32(QT_ADD16(0), QT_ADD16(16));
    const __m512i p23 = _mm512_packs_epi32(QT_ADD16(32), QT_ADD16(48));
    __m512i v = _mm512_permutexvar_epi32(perm, _mm512_packus_epi16(p01, p23));
    v = _mm512_max_epu8(v, lo8);  /* hi was applied in float */
    _mm512_storeu_si512(y + i, v);
  }
#undef QT_ADD16
  if (i < n) add_body(n - i, a + i, b + i, y + i, ma, za, mb, zb, rq);
}
#endif

#if QT_X86
/* AVX-512 pooled pixel: the running max/sum stays in registers across the taps (the generic body
 * stores and reloads it per tap, which serializes on store forwarding). */
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq")))
void qu8_maxpool_ukernel__avx512skx(size_t n, size_t nt, const uint8_t* const* taps, uint8_t* y) {
  for (size_t c0 = 0; c0 < n; c0 += 64) {
    const __mmask64 m = n - c0 >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (n - c0)) - 1);
    __m512i acc = _mm512_setzero_si512();
    for (size_t t = 0; t < nt; t++) acc = _mm512_max_epu8(acc, _mm512_maskz_loadu_epi8(m, taps[t] + c0));
    _mm512_mask_storeu_epi8(y + c0, m, acc);
  }
}

__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq")))
void qu8_sumpool_ukernel__avx512skx(size_t n, size_t nt, const uint8_t* const* taps, int32_t* acc) {
  for (size_t c0 = 0; c0 < n; c0 += 16) {
    const __mmask16 m = n - c0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c0)) - 1);
    __m512i s = _mm512_setzero_si512();
    for (size_t t = 0; t < nt; t++)
      s = _mm512_add_epi32(s, _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, taps[t] + c0)));
    _mm512_mask_storeu_epi32(acc + c0, m, s);
  }
}
#endif
