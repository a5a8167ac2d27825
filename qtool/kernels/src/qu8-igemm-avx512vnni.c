/* AVX-512 VNNI indirect GEMM: vpdpbusd (u8 activations x s8 weights, 4-way dot into int32).
 * MR=8 x NR=32 (two zmm of 16 int32 per row), weights int8 [ks][kc/4][NR][4] per panel
 * (kc padded to 4 with zero weights; the activation tail is loaded without over-reading). */
#include "qtool_kernels.h"
#if QT_X86
#include <immintrin.h>

#include "qu8-requant-avx512.h"

#define MR 8
#define NR 32

QT_INLINE int32_t load4(const uint8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

QT_INLINE int32_t load_tail(const uint8_t* p, size_t n) {
  uint32_t v = p[0];
  if (n > 1) v |= (uint32_t)p[1] << 8;
  if (n > 2) v |= (uint32_t)p[2] << 16;
  return (int32_t)v;
}

/* u8 epilogue for two rows x 32 columns: float multiply, clamp to hi - zp, round half to even,
 * saturating packs (the zero point is added in int16), max with lo, one vpermd to undo the pack
 * interleave. 24 vector uops per 64 outputs instead of 32 with a vpmovdb per zmm. Equal to
 * clip(rint(acc * m) + zp, lo, hi): clamping to integer bounds commutes with rint. */
/* One row (GEMV, e.g. the classifier at batch 1): 2 vpdpbusd per 4 K instead of 16, with two
 * accumulator pairs to hide the vpdpbusd latency. */
QT_TARGET_AVX512VNNI
static void igemm_1x32c4(size_t nc, size_t kc, size_t ks, const intptr_t* ind, const uint8_t* x,
                         const uint8_t* zero, const void* w, void* c, const qt_requant* rq) {
  const int32_t* bias = (const int32_t*)w;
  const float* mult = (const float*)(bias + NR);
  const int8_t* wp = (const int8_t*)(mult + NR);
  __m512i acc0 = _mm512_loadu_si512(bias), acc1 = _mm512_loadu_si512(bias + 16);
  __m512i acc2 = _mm512_setzero_si512(), acc3 = _mm512_setzero_si512();
  const size_t kc8 = kc & ~(size_t)7, kc4 = kc & ~(size_t)3, krem = kc & 3;
  for (size_t t = 0; t < ks; t++) {
    const intptr_t o = ind[t * MR];
    const uint8_t* a = o >= 0 ? x + o : zero;
    size_t k = 0;
    for (; k < kc8; k += 8) {
      const __m512i va = _mm512_set1_epi32(load4(a + k)), vb = _mm512_set1_epi32(load4(a + k + 4));
      acc0 = _mm512_dpbusd_epi32(acc0, va, _mm512_loadu_si512(wp));
      acc1 = _mm512_dpbusd_epi32(acc1, va, _mm512_loadu_si512(wp + 64));
      acc2 = _mm512_dpbusd_epi32(acc2, vb, _mm512_loadu_si512(wp + 128));
      acc3 = _mm512_dpbusd_epi32(acc3, vb, _mm512_loadu_si512(wp + 192));
      wp += 256;
    }
    for (; k < kc4; k += 4) {
      const __m512i va = _mm512_set1_epi32(load4(a + k));
      acc0 = _mm512_dpbusd_epi32(acc0, va, _mm512_loadu_si512(wp));
      acc1 = _mm512_dpbusd_epi32(acc1, va, _mm512_loadu_si512(wp + 64));
      wp += 128;
    }
    if (krem) {
      const __m512i va = _mm512_set1_epi32(load_tail(a + k, krem));
      acc0 = _mm512_dpbusd_epi32(acc0, va, _mm512_loadu_si512(wp));
      acc1 = _mm512_dpbusd_epi32(acc1, va, _mm512_loadu_si512(wp + 64));
      wp += 128;
    }
  }
  acc0 = _mm512_add_epi32(acc0, acc2);
  acc1 = _mm512_add_epi32(acc1, acc3);
  const __mmask16 m0 = col_mask16(nc, 0), m1 = col_mask16(nc, 16);
  store16(acc0, mult, c, m0, rq);
  store16(acc1, mult + 16, (char*)c + 16 * (rq->out_f32 ? 4 : 1), m1, rq);
}

/* The 8x32 tile. acc_in (8 x 32 int32 partial sums, or NULL = start from the bias) and acc_out
 * (non-NULL = store the raw sums there and skip the epilogue) let the operator split K into
 * tap blocks whose weight slice stays in L1 across several row blocks. */
QT_TARGET_AVX512VNNI QT_INLINE void igemm_8x32c4_core(size_t mr, size_t nc, size_t kc, size_t ks,
                                                     const intptr_t* ind, const uint8_t* x,
                                                     const uint8_t* zero, const int8_t* wp,
                                                     const int32_t* bias, const float* mult,
                                                     const int32_t* acc_in, int32_t* acc_out,
                                                     void* c, size_t cm_stride,
                                                     const qt_requant* rq) {
  __m512i acc00, acc01, acc10, acc11, acc20, acc21, acc30, acc31, acc40, acc41, acc50, acc51, acc60,
      acc61, acc70, acc71;
  if (acc_in) {
#define QT_LD(A, I) A = _mm512_loadu_si512(acc_in + 16 * (I));
    QT_LD(acc00, 0) QT_LD(acc01, 1) QT_LD(acc10, 2) QT_LD(acc11, 3) QT_LD(acc20, 4) QT_LD(acc21, 5)
    QT_LD(acc30, 6) QT_LD(acc31, 7) QT_LD(acc40, 8) QT_LD(acc41, 9) QT_LD(acc50, 10) QT_LD(acc51, 11)
    QT_LD(acc60, 12) QT_LD(acc61, 13) QT_LD(acc70, 14) QT_LD(acc71, 15)
#undef QT_LD
  } else {
    const __m512i bias0 = _mm512_loadu_si512(bias), bias1 = _mm512_loadu_si512(bias + 16);
    acc00 = bias0; acc01 = bias1; acc10 = bias0; acc11 = bias1; acc20 = bias0; acc21 = bias1;
    acc30 = bias0; acc31 = bias1; acc40 = bias0; acc41 = bias1; acc50 = bias0; acc51 = bias1;
    acc60 = bias0; acc61 = bias1; acc70 = bias0; acc71 = bias1;
  }
  const size_t kc4 = kc & ~(size_t)3, krem = kc & 3;
  for (size_t t = 0; t < ks; t++) {
    const intptr_t* o = ind + t * MR;
    const uint8_t* a0 = o[0] >= 0 ? x + o[0] : zero;
    const uint8_t* a1 = o[1] >= 0 ? x + o[1] : zero;
    const uint8_t* a2 = o[2] >= 0 ? x + o[2] : zero;
    const uint8_t* a3 = o[3] >= 0 ? x + o[3] : zero;
    const uint8_t* a4 = o[4] >= 0 ? x + o[4] : zero;
    const uint8_t* a5 = o[5] >= 0 ? x + o[5] : zero;
    const uint8_t* a6 = o[6] >= 0 ? x + o[6] : zero;
    const uint8_t* a7 = o[7] >= 0 ? x + o[7] : zero;
#define QT_STEP(L0, L1, L2, L3, L4, L5, L6, L7)                      \
  {                                                                  \
    const __m512i w0 = _mm512_loadu_si512(wp);                       \
    const __m512i w1 = _mm512_loadu_si512(wp + 64);                  \
    wp += 128;                                                       \
    __m512i va;                                                      \
    va = _mm512_set1_epi32(L0);                                      \
    acc00 = _mm512_dpbusd_epi32(acc00, va, w0);                      \
    acc01 = _mm512_dpbusd_epi32(acc01, va, w1);                      \
    va = _mm512_set1_epi32(L1);                                      \
    acc10 = _mm512_dpbusd_epi32(acc10, va, w0);                      \
    acc11 = _mm512_dpbusd_epi32(acc11, va, w1);                      \
    va = _mm512_set1_epi32(L2);                                      \
    acc20 = _mm512_dpbusd_epi32(acc20, va, w0);                      \
    acc21 = _mm512_dpbusd_epi32(acc21, va, w1);                      \
    va = _mm512_set1_epi32(L3);                                      \
    acc30 = _mm512_dpbusd_epi32(acc30, va, w0);                      \
    acc31 = _mm512_dpbusd_epi32(acc31, va, w1);                      \
    va = _mm512_set1_epi32(L4);                                      \
    acc40 = _mm512_dpbusd_epi32(acc40, va, w0);                      \
    acc41 = _mm512_dpbusd_epi32(acc41, va, w1);                      \
    va = _mm512_set1_epi32(L5);                                      \
    acc50 = _mm512_dpbusd_epi32(acc50, va, w0);                      \
    acc51 = _mm512_dpbusd_epi32(acc51, va, w1);                      \
    va = _mm512_set1_epi32(L6);                                      \
    acc60 = _mm512_dpbusd_epi32(acc60, va, w0);                      \
    acc61 = _mm512_dpbusd_epi32(acc61, va, w1);                      \
    va = _mm512_set1_epi32(L7);                                      \
    acc70 = _mm512_dpbusd_epi32(acc70, va, w0);                      \
    acc71 = _mm512_dpbusd_epi32(acc71, va, w1);                      \
  }
    size_t k = 0;
    for (; k < kc4; k += 4)
      QT_STEP(load4(a0 + k), load4(a1 + k), load4(a2 + k), load4(a3 + k), load4(a4 + k),
              load4(a5 + k), load4(a6 + k), load4(a7 + k))
    if (krem)
      QT_STEP(load_tail(a0 + k, krem), load_tail(a1 + k, krem), load_tail(a2 + k, krem),
              load_tail(a3 + k, krem), load_tail(a4 + k, krem), load_tail(a5 + k, krem),
              load_tail(a6 + k, krem), load_tail(a7 + k, krem))
#undef QT_STEP
  }
  if (acc_out) {
#define QT_ST(A, I) _mm512_storeu_si512(acc_out + 16 * (I), A);
    QT_ST(acc00, 0) QT_ST(acc01, 1) QT_ST(acc10, 2) QT_ST(acc11, 3) QT_ST(acc20, 4) QT_ST(acc21, 5)
    QT_ST(acc30, 6) QT_ST(acc31, 7) QT_ST(acc40, 8) QT_ST(acc41, 9) QT_ST(acc50, 10) QT_ST(acc51, 11)
    QT_ST(acc60, 12) QT_ST(acc61, 13) QT_ST(acc70, 14) QT_ST(acc71, 15)
#undef QT_ST
    return;
  }
  char* cr = (char*)c;
  if (!rq->out_f32) {
    const u8_pair k = u8_pair_setup(mult, nc, rq);
    store_pair_u8(acc00, acc01, acc10, acc11, &k, (uint8_t*)cr, (uint8_t*)cr + cm_stride, mr > 1);
    if (mr > 2)
      store_pair_u8(acc20, acc21, acc30, acc31, &k, (uint8_t*)cr + 2 * cm_stride, (uint8_t*)cr + 3 * cm_stride, mr > 3);
    if (mr > 4)
      store_pair_u8(acc40, acc41, acc50, acc51, &k, (uint8_t*)cr + 4 * cm_stride, (uint8_t*)cr + 5 * cm_stride, mr > 5);
    if (mr > 6)
      store_pair_u8(acc60, acc61, acc70, acc71, &k, (uint8_t*)cr + 6 * cm_stride, (uint8_t*)cr + 7 * cm_stride, mr > 7);
    return;
  }
  const __mmask16 m0 = col_mask16(nc, 0), m1 = col_mask16(nc, 16);
#define QT_ROW(I, A0, A1)                                     \
  if (mr > I) {                                               \
    store16(A0, mult, cr + I * cm_stride, m0, rq);            \
    store16(A1, mult + 16, cr + I * cm_stride + 64, m1, rq);  \
  }
  QT_ROW(0, acc00, acc01) QT_ROW(1, acc10, acc11) QT_ROW(2, acc20, acc21) QT_ROW(3, acc30, acc31)
  QT_ROW(4, acc40, acc41) QT_ROW(5, acc50, acc51) QT_ROW(6, acc60, acc61) QT_ROW(7, acc70, acc71)
#undef QT_ROW
}

QT_TARGET_AVX512VNNI
void qu8_qs8w_igemm_minmax_fp32_ukernel_8x32c4__avx512vnni(size_t mr, size_t nc, size_t kc, size_t ks,
                                                          const intptr_t* ind, const uint8_t* x,
                                                          const uint8_t* zero, const void* w,
                                                          void* c, size_t cm_stride,
                                                          const qt_requant* rq) {
  const int32_t* bias = (const int32_t*)w;
  const float* mult = (const float*)(bias + NR);
  const int8_t* wp = (const int8_t*)(mult + NR);
  if (mr == 1) {
    igemm_1x32c4(nc, kc, ks, ind, x, zero, w, c, rq);
    return;
  }
  igemm_8x32c4_core(mr, nc, kc, ks, ind, x, zero, wp, bias, mult, NULL, NULL, c, cm_stride, rq);
}

/* K-blocked entry: taps [t0, t0 + ks) of the panel at w (ind already points at tap t0). */
QT_TARGET_AVX512VNNI
void qu8_qs8w_igemm_minmax_fp32_ukernel_8x32c4__avx512vnni_acc(
    size_t mr, size_t nc, size_t kc, size_t t0, size_t ks, const intptr_t* ind, const uint8_t* x,
    const uint8_t* zero, const void* w, const int32_t* acc_in, int32_t* acc_out, void* c,
    size_t cm_stride, const qt_requant* rq) {
  const int32_t* bias = (const int32_t*)w;
  const float* mult = (const float*)(bias + NR);
  const int8_t* wp = (const int8_t*)(mult + NR) + t0 * ((kc + 3) & ~(size_t)3) * NR;
  igemm_8x32c4_core(mr, nc, kc, ks, ind, x, zero, wp, bias, mult, acc_in, acc_out, c, cm_stride, rq);
}

/* Half panel: MR=8 x 16 columns, for the last <= 16 output channels of a group (Cout = 16, 40,
 * ...). Weights int8 [ks][kc/4][16][4]; bias/mult 16 wide. */
QT_TARGET_AVX512VNNI
void qu8_qs8w_igemm_minmax_fp32_ukernel_8x16c4__avx512vnni(size_t mr, size_t nc, size_t kc, size_t ks,
                                                          const intptr_t* ind, const uint8_t* x,
                                                          const uint8_t* zero, const void* w,
                                                          void* c, size_t cm_stride,
                                                          const qt_requant* rq) {
  const int32_t* bias = (const int32_t*)w;
  const float* mult = (const float*)(bias + 16);
  const int8_t* wp = (const int8_t*)(mult + 16);
  const __m512i b0 = _mm512_loadu_si512(bias);
  __m512i acc0 = b0, acc1 = b0, acc2 = b0, acc3 = b0, acc4 = b0, acc5 = b0, acc6 = b0, acc7 = b0;
  const size_t kc4 = kc & ~(size_t)3, krem = kc & 3;
  for (size_t t = 0; t < ks; t++) {
    const intptr_t* o = ind + t * MR;
    const uint8_t* a0 = o[0] >= 0 ? x + o[0] : zero;
    const uint8_t* a1 = o[1] >= 0 ? x + o[1] : zero;
    const uint8_t* a2 = o[2] >= 0 ? x + o[2] : zero;
    const uint8_t* a3 = o[3] >= 0 ? x + o[3] : zero;
    const uint8_t* a4 = o[4] >= 0 ? x + o[4] : zero;
    const uint8_t* a5 = o[5] >= 0 ? x + o[5] : zero;
    const uint8_t* a6 = o[6] >= 0 ? x + o[6] : zero;
    const uint8_t* a7 = o[7] >= 0 ? x + o[7] : zero;
#define QT_STEP(L0, L1, L2, L3, L4, L5, L6, L7)                 \
  {                                                             \
    const __m512i w0 = _mm512_loadu_si512(wp);                  \
    wp += 64;                                                   \
    acc0 = _mm512_dpbusd_epi32(acc0, _mm512_set1_epi32(L0), w0); \
    acc1 = _mm512_dpbusd_epi32(acc1, _mm512_set1_epi32(L1), w0); \
    acc2 = _mm512_dpbusd_epi32(acc2, _mm512_set1_epi32(L2), w0); \
    acc3 = _mm512_dpbusd_epi32(acc3, _mm512_set1_epi32(L3), w0); \
    acc4 = _mm512_dpbusd_epi32(acc4, _mm512_set1_epi32(L4), w0); \
    acc5 = _mm512_dpbusd_epi32(acc5, _mm512_set1_epi32(L5), w0); \
    acc6 = _mm512_dpbusd_epi32(acc6, _mm512_set1_epi32(L6), w0); \
    acc7 = _mm512_dpbusd_epi32(acc7, _mm512_set1_epi32(L7), w0); \
  }
    size_t k = 0;
    for (; k < kc4; k += 4)
      QT_STEP(load4(a0 + k), load4(a1 + k), load4(a2 + k), load4(a3 + k), load4(a4 + k),
              load4(a5 + k), load4(a6 + k), load4(a7 + k))
    if (krem)
      QT_STEP(load_tail(a0 + k, krem), load_tail(a1 + k, krem), load_tail(a2 + k, krem),
              load_tail(a3 + k, krem), load_tail(a4 + k, krem), load_tail(a5 + k, krem),
              load_tail(a6 + k, krem), load_tail(a7 + k, krem))
#undef QT_STEP
  }
  const __mmask16 m0 = col_mask16(nc, 0);
  char* cr = (char*)c;
#define QT_ROW(I, A)                                                  \
  if (mr > I) store16(A, mult, cr + I * cm_stride, m0, rq);
  QT_ROW(0, acc0) QT_ROW(1, acc1) QT_ROW(2, acc2) QT_ROW(3, acc3)
  QT_ROW(4, acc4) QT_ROW(5, acc5) QT_ROW(6, acc6) QT_ROW(7, acc7)
#undef QT_ROW
}

const qt_igemm_config qt_igemm_avx512vnni = {
    "qu8_qs8w_igemm_minmax_fp32_ukernel_8x32c4__avx512vnni",
    qu8_qs8w_igemm_minmax_fp32_ukernel_8x32c4__avx512vnni, MR, NR, 4, 1,
    qu8_qs8w_igemm_minmax_fp32_ukernel_8x16c4__avx512vnni,
    qu8_qs8w_igemm_minmax_fp32_ukernel_8x32c4__avx512vnni_acc};
#else
const qt_igemm_config qt_igemm_avx512vnni = {0};
#endif
