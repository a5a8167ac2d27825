/* AVX2 indirect GEMM, exact for any weights: u8 zero-extended and s8 sign-extended to 16 bits,
 * vpmaddwd into int32. The AVX2 tier runs qu8-igemm-avx2-maddubs.c (vpmaddubsw, pairs proven
 * safe at pack time); this one stays for comparisons (qt_set_exact_only) and as the reference
 * point of its speed-up. MR=4 x NR=16, weights int16 [ks][kc/2][NR][2] per panel (kc padded to 2). */
#include "qtool_kernels.h"
#if QT_X86
#include <immintrin.h>

#include "qu8-requant-avx2.h"

#define MR 4
#define NR 16

QT_TARGET_AVX2
void qu8_qs8w_igemm_minmax_fp32_ukernel_4x16c2__avx2(size_t mr, size_t nc, size_t kc, size_t ks,
                                                     const intptr_t* ind, const uint8_t* x,
                                                     const uint8_t* zero, const void* w, void* c,
                                                     size_t cm_stride, const qt_requant* rq) {
  const int32_t* bias = (const int32_t*)w;
  const float* mult = (const float*)(bias + NR);
  const int16_t* wp = (const int16_t*)(mult + NR);
  __m256i acc[MR][2];
  const __m256i b0i = _mm256_loadu_si256((const __m256i*)bias);
  const __m256i b1i = _mm256_loadu_si256((const __m256i*)(bias + 8));
#pragma GCC unroll 4
  for (size_t i = 0; i < MR; i++) { acc[i][0] = b0i; acc[i][1] = b1i; }
  const size_t kc4 = kc & ~(size_t)3;
  const __m256i sh01 = _mm256_set1_epi32((int32_t)0x80018000u);  /* bytes 0, -, 1, - */
  const __m256i sh23 = _mm256_set1_epi32((int32_t)0x80038002u);  /* bytes 2, -, 3, - */
  for (size_t t = 0; t < ks; t++) {
    const uint8_t* a[MR];
#pragma GCC unroll 4
    for (size_t i = 0; i < MR; i++) {
      intptr_t o = ind[t * MR + i];
      a[i] = o >= 0 ? x + o : zero;
    }
    /* A: 4 bytes broadcast per row, then vpshufb to (a0, a1) and (a2, a3) zero-extended 16-bit
     * pairs for vpmaddwd against the int16 weight pairs. */
    size_t k = 0;
    for (; k < kc4; k += 4) {
      const __m256i w0 = _mm256_loadu_si256((const __m256i*)wp);
      const __m256i w1 = _mm256_loadu_si256((const __m256i*)(wp + 16));
      const __m256i w2 = _mm256_loadu_si256((const __m256i*)(wp + 32));
      const __m256i w3 = _mm256_loadu_si256((const __m256i*)(wp + 48));
      wp += 4 * NR;
#pragma GCC unroll 4
      for (size_t i = 0; i < MR; i++) {
        int32_t v;
        memcpy(&v, a[i] + k, 4);
        const __m256i vb = _mm256_set1_epi32(v);
        const __m256i va01 = _mm256_shuffle_epi8(vb, sh01);
        const __m256i va23 = _mm256_shuffle_epi8(vb, sh23);
        acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(va01, w0));
        acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(va01, w1));
        acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(va23, w2));
        acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(va23, w3));
      }
    }
    if (k < kc) {  /* 1..3 left: one or two zero-padded pairs, no over-read of A */
      const size_t rem = kc - k;
      const __m256i w0 = _mm256_loadu_si256((const __m256i*)wp);
      const __m256i w1 = _mm256_loadu_si256((const __m256i*)(wp + 16));
      wp += 2 * NR;
      __m256i w2 = _mm256_setzero_si256(), w3 = _mm256_setzero_si256();
      if (rem > 2) {
        w2 = _mm256_loadu_si256((const __m256i*)wp);
        w3 = _mm256_loadu_si256((const __m256i*)(wp + 16));
        wp += 2 * NR;
      }
#pragma GCC unroll 4
      for (size_t i = 0; i < MR; i++) {
        uint32_t v = a[i][k];
        if (rem > 1) v |= (uint32_t)a[i][k + 1] << 8;
        if (rem > 2) v |= (uint32_t)a[i][k + 2] << 16;
        const __m256i vb = _mm256_set1_epi32((int32_t)v);
        const __m256i va01 = _mm256_shuffle_epi8(vb, sh01);
        const __m256i va23 = _mm256_shuffle_epi8(vb, sh23);
        acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(va01, w0));
        acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(va01, w1));
        acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(va23, w2));
        acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(va23, w3));
      }
    }
  }
  for (size_t i = 0; i < mr; i++)
    qt_avx2_store_row16(acc[i][0], acc[i][1], mult, (char*)c + i * cm_stride, nc, rq);
}

const qt_igemm_config qt_igemm_avx2 = {
    "qu8_qs8w_igemm_minmax_fp32_ukernel_4x16c2__avx2",
    qu8_qs8w_igemm_minmax_fp32_ukernel_4x16c2__avx2, MR, NR, 2, 2};
#else
const qt_igemm_config qt_igemm_avx2 = {0};
#endif
