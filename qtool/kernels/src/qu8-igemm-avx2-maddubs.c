/* AVX2 indirect GEMM on vpmaddubsw, exact for the weights its packer accepts.
 *
 * vpmaddubsw multiplies 32 u8 inputs by 32 s8 weights and adds neighbouring products into a
 * saturating int16; vpmaddwd with ones then adds those pairs into int32. That is twice the
 * products per multiply of the exact 16-bit kernel (qu8-igemm-avx2.c), and exact whenever no
 * int16 pair can saturate (qs8-pairing.c). The packer chooses, per output column and block of
 * 16 K (8 or 4 at a tap's end), which weights share an int16; the kernel applies that choice with
 * one vpshufb of the broadcast input block per row and 8 columns (measured free on Zen 3: the
 * shuffle runs beside the two multiplies, which issue 2 per cycle). A column whose block has no
 * safe pairing is split there: w = hi + lo with |hi|, |lo| <= 64, a second pass over that block.
 *
 * Panel (NR = 16 columns): int32 bias[16], float mult[16], uint8 split[ks * blocks] (padded to
 * 32 bytes; 1 = the block has a second pass), then per tap, per block, per substep (4 K):
 * ctl0[32] w0[32] ctl1[32] w1[32] for columns 0-7 and 8-15 (ctl: byte positions within the block,
 * 4 per column). Blocks: kc / 16 of 16 K, then one of 8, one of 4, one of 1-3 as kc needs. */
#include "qtool_kernels.h"
#if QT_X86
#include <immintrin.h>

#include "qu8-requant-avx2.h"

#define NR 16
#define SUB 128  /* bytes per 4-K substep: two (control, weights) vectors */

static size_t round_up(size_t v, size_t m) { return (v + m - 1) / m * m; }

static size_t blocks_per_tap(size_t kc) {
  const size_t r = kc % 16;
  return kc / 16 + (r >= 8) + ((r % 8) >= 4) + ((r % 4) != 0);
}

/* length of a tap's block b: kc / 16 blocks of 16, then 8, 4 and 1-3 as the rest needs */
static size_t block_len(size_t kc, size_t b) {
  if (b < kc / 16) return 16;
  size_t r = kc % 16;
  if (r >= 8) { if (b == kc / 16) return 8; b--; r -= 8; }
  if (r >= 4) { if (b == kc / 16) return 4; b--; r -= 4; }
  return r;
}

static size_t pack_panel(size_t ks, size_t kc, size_t cols, const int8_t* const* wrows,
                         const int32_t* bias, const float* mult, void* out, qt_pair_stats* st) {
  const size_t nb = blocks_per_tap(kc), hdr = NR * 8 + round_up(ks * nb, 32);
  /* pass 1: which blocks split (any column without a safe pairing) */
  uint8_t perm[NR][QT_PAIR_BLOCK];
  size_t bytes = hdr;
  uint8_t* split = out ? (uint8_t*)out + NR * 8 : NULL;
  if (out) memset(out, 0, hdr);
  for (size_t t = 0; t < ks; t++) {
    size_t k0 = 0;
    for (size_t b = 0; b < nb; b++) {
      const size_t L = block_len(kc, b), Lp = round_up(L, 4);
      int sp = 0;
      for (size_t j = 0; j < cols; j++) {
        int8_t wb[QT_PAIR_BLOCK] = {0};
        memcpy(wb, wrows[j] + t * kc + k0, L);
        sp |= qt_pair_block(wb, Lp, perm[j]) == 0;
      }
      bytes += (Lp / 4) * SUB * (sp ? 2 : 1);
      if (split) split[t * nb + b] = (uint8_t)sp;
      k0 += L;
    }
  }
  if (!out) return bytes;
  memset((char*)out + hdr, 0, bytes - hdr);
  int32_t* pb = (int32_t*)out;
  float* pm = (float*)(pb + NR);
  for (size_t j = 0; j < cols; j++) { pb[j] = bias[j]; pm[j] = mult[j]; }
  uint8_t* wp = (uint8_t*)out + hdr;
  for (size_t t = 0; t < ks; t++) {
    size_t k0 = 0;
    for (size_t b = 0; b < nb; b++) {
      const size_t L = block_len(kc, b), Lp = round_up(L, 4), S = Lp / 4;
      const int sp = split[t * nb + b];
      for (size_t pass = 0; pass < (sp ? 2u : 1u); pass++) {
        for (size_t j = 0; j < NR; j++) {
          int8_t wb[QT_PAIR_BLOCK] = {0};
          if (j < cols) memcpy(wb, wrows[j] + t * kc + k0, L);
          uint8_t pj[QT_PAIR_BLOCK];
          int r = qt_pair_block(wb, Lp, pj);
          if (j < cols && pass == 0) {
            st->blocks++;
            if (r == 1) st->natural++;
            else if (r == 2) st->reordered++;
            else st->fallback++;
          }
          for (size_t q = 0; q < Lp; q++) {
            int8_t v = wb[pj[q]];
            if (r == 0) v = pass == 0 ? (int8_t)(v - v / 2) : (int8_t)(v / 2); /* |hi|, |lo| <= 64 */
            else if (pass == 1) v = 0;
            const size_t s = q / 4, lane = (j % 8) * 4 + q % 4;
            uint8_t* sub = wp + s * SUB + (j / 8) * 64;
            sub[lane] = pj[q];        /* vpshufb control: source byte within the 128-bit lane */
            sub[32 + lane] = (uint8_t)v;
          }
        }
        wp += S * SUB;
      }
      k0 += L;
    }
  }
  return bytes;
}

/* S substeps of one block on MR rows; xb[i] holds row i's block in every 128-bit lane */
#define RUN_SUBSTEPS(S) RUN_SUBSTEPS_X(S, xb[i])
#define RUN_SUBSTEPS_X(S, XI)                                                                \
  for (size_t s = 0; s < (S); s++, wp += SUB) {                                              \
    const __m256i c0 = _mm256_load_si256((const __m256i*)wp);                                \
    const __m256i w0 = _mm256_load_si256((const __m256i*)(wp + 32));                         \
    const __m256i c1 = _mm256_load_si256((const __m256i*)(wp + 64));                         \
    const __m256i w1 = _mm256_load_si256((const __m256i*)(wp + 96));                         \
    _Pragma("GCC unroll 8") for (size_t i = 0; i < MRC; i++) {                               \
      const __m256i xi = (XI);                                                               \
      __m256i p0 = _mm256_maddubs_epi16(_mm256_shuffle_epi8(xi, c0), w0);                    \
      __m256i p1 = _mm256_maddubs_epi16(_mm256_shuffle_epi8(xi, c1), w1);                    \
      acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(p0, ones));                  \
      acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(p1, ones));                  \
      /* keeps GCC from reassociating the adds into trees of spilled products */             \
      __asm__("" : "+x"(acc[i][0]), "+x"(acc[i][1]));                                        \
    }                                                                                        \
  }

/* a broadcast GCC cannot merge with the same one a substep earlier (it would hold it in a
 * register, and spill the accumulators instead) */
QT_TARGET_AVX2 QT_INLINE __m256i bcast16_again(const uint8_t* p) {
  __m256i r;
  __asm__ volatile("vbroadcasti128 %1, %0" : "=x"(r) : "m"(*(const __m128i*)p));
  return r;
}

QT_TARGET_AVX2 QT_INLINE void igemm_body(const size_t MRC, size_t mr, size_t nc, size_t kc, size_t ks,
                                         const intptr_t* ind, const uint8_t* x, const uint8_t* zero,
                                         const void* w, void* c, size_t cm_stride,
                                         const qt_requant* rq) {
  const int32_t* bias = (const int32_t*)w;
  const float* mult = (const float*)(bias + NR);
  const uint8_t* sp = (const uint8_t*)(mult + NR);
  const uint8_t* wp = sp + round_up(ks * blocks_per_tap(kc), 32);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[8][2], xb[8];
  const __m256i b0 = _mm256_loadu_si256((const __m256i*)bias);
  const __m256i b1 = _mm256_loadu_si256((const __m256i*)(bias + 8));
#pragma GCC unroll 8
  for (size_t i = 0; i < MRC; i++) { acc[i][0] = b0; acc[i][1] = b1; }
  for (size_t t = 0; t < ks; t++) {
    const uint8_t* a[8];
#pragma GCC unroll 8
    for (size_t i = 0; i < MRC; i++) {
      const intptr_t o = ind[t * MRC + i];
      a[i] = o >= 0 ? x + o : zero;
    }
    size_t k = 0;
    for (; k + 16 <= kc; k += 16) {
      /* the block is broadcast again for each substep: a load, and MR fewer registers held */
      const int split = *sp++;
      RUN_SUBSTEPS_X(4, bcast16_again(a[i] + k))
      if (split) { RUN_SUBSTEPS_X(4, bcast16_again(a[i] + k)) }
    }
    if (k < kc) {  /* the tap's tail: blocks of 8, 4 and 1-3 K, loads never past kc */
      if (kc - k >= 8) {
#pragma GCC unroll 8
        for (size_t i = 0; i < MRC; i++) {
          int64_t v;
          memcpy(&v, a[i] + k, 8);
          xb[i] = _mm256_set1_epi64x(v);
        }
        const int split = *sp++;
        RUN_SUBSTEPS(2)
        if (split) { RUN_SUBSTEPS(2) }
        k += 8;
      }
      if (kc - k >= 4) {
#pragma GCC unroll 8
        for (size_t i = 0; i < MRC; i++) {
          int32_t v;
          memcpy(&v, a[i] + k, 4);
          xb[i] = _mm256_set1_epi32(v);
        }
        const int split = *sp++;
        RUN_SUBSTEPS(1)
        if (split) { RUN_SUBSTEPS(1) }
        k += 4;
      }
      if (k < kc) {
        const size_t rem = kc - k;
#pragma GCC unroll 8
        for (size_t i = 0; i < MRC; i++) {
          uint32_t v = a[i][k];
          if (rem > 1) v |= (uint32_t)a[i][k + 1] << 8;
          if (rem > 2) v |= (uint32_t)a[i][k + 2] << 16;
          xb[i] = _mm256_set1_epi32((int32_t)v);
        }
        const int split = *sp++;
        RUN_SUBSTEPS(1)
        if (split) { RUN_SUBSTEPS(1) }
      }
    }
  }
#pragma GCC unroll 8
  for (size_t i = 0; i < mr; i++)
    qt_avx2_store_row16(acc[i][0], acc[i][1], mult, (char*)c + i * cm_stride, nc, rq);
}

/* Tile: 4 rows x 16 columns, the input block broadcast again for every substep. Measured on the
 * Zen 3 VM (one thread, Gaussian weights, ResNet-50 / EfficientNet 1x1 and 3x3 shapes, the exact
 * kernel timed alongside): 2x16 70-75 GMAC/s, 3x16 72-77, 4x16 holding the 4 broadcasts in
 * registers 58-77 (GCC spills accumulators), 4x16 re-broadcast 74-77, 5x16 and 6x16 re-broadcast
 * 53-75 (spills). 16 ymm registers: 8 accumulators, 2 x (control, weights), ones, input, temps. */
QT_TARGET_AVX2 void qu8_qs8w_igemm_minmax_fp32_ukernel_4x16c16__avx2_maddubs(
    size_t mr, size_t nc, size_t kc, size_t ks, const intptr_t* ind, const uint8_t* x,
    const uint8_t* zero, const void* w, void* c, size_t cm_stride, const qt_requant* rq) {
  igemm_body(4, mr, nc, kc, ks, ind, x, zero, w, c, cm_stride, rq);
}

const qt_igemm_config qt_igemm_avx2_maddubs = {
    "qu8_qs8w_igemm_minmax_fp32_ukernel_4x16c16__avx2_maddubs",
    qu8_qs8w_igemm_minmax_fp32_ukernel_4x16c16__avx2_maddubs, 4, NR, 4, 2, NULL, NULL, pack_panel};
#else
const qt_igemm_config qt_igemm_avx2_maddubs = {0};
#endif
