/* AVX-512 VNNI depthwise convolution, 64 channels per tile, no shuffles in the tap loop:
 * one zmm load of 64 input channels feeds four vpdpbusd against four weight vectors in which
 * only byte r of every dword is non-zero, so accumulator r, lane j sums channel 4j + r.
 * The epilogue re-interleaves by packing the four requantized dwords into bytes.
 * Tile: int32 bias[4][16] and float mult[4][16] in (r, j) order, then per tap 4 x 64 bytes. */
#include "qtool_kernels.h"
#if QT_X86
#include <immintrin.h>

#define CT 64

/* vpdpbusd through inline asm: GCC 12 copies every accumulator in and out of the tap loop when
 * the builtin is used here (16 extra zmm moves per iteration); the asm keeps them in place. */
#define DPBUSD(acc, x, w) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w))

static size_t tile_bytes(size_t ks) { return CT * 8 + ks * 4 * CT; }
static size_t packed_size(size_t channels, size_t ks) {
  return (channels + CT - 1) / CT * tile_bytes(ks);
}

static void pack(size_t channels, size_t ks, const int8_t* w, const int32_t* bias, const float* mult,
                 void* out) {
  char* p = (char*)out;
  memset(out, 0, packed_size(channels, ks));
  for (size_t c0 = 0; c0 < channels; c0 += CT, p += tile_bytes(ks)) {
    int32_t* b = (int32_t*)p;
    float* m = (float*)(b + CT);
    int8_t* wt = (int8_t*)(m + CT);
    for (size_t r = 0; r < 4; r++)
      for (size_t j = 0; j < 16; j++) {
        size_t c = c0 + 4 * j + r;
        b[r * 16 + j] = c < channels ? bias[c] : 0;
        m[r * 16 + j] = c < channels ? mult[c] : 0.0f;
      }
    for (size_t t = 0; t < ks; t++)
      for (size_t r = 0; r < 4; r++)
        for (size_t j = 0; j < 16; j++) {
          size_t c = c0 + 4 * j + r;
          wt[(t * 4 + r) * CT + 4 * j + r] = c < channels ? w[c * ks + t] : 0;
        }
  }
}

QT_TARGET_AVX512VNNI QT_INLINE __m512i rq_cvt16(__m512i acc, const float* mult, __m512 hi) {
  __m512 f = _mm512_min_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_loadu_ps(mult)), hi);
  return _mm512_cvt_roundps_epi32(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

QT_TARGET_AVX512VNNI QT_INLINE __m256i rq_cvt8(__m256i acc, const float* mult, __m512 hi) {
  __m256 f = _mm256_min_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_loadu_ps(mult)),
                           _mm512_castps512_ps256(hi));
  return _mm256_cvtps_epi32(f);
}

/* P pixels x 64 channels (zmm) of one channel tile. */
QT_TARGET_AVX512VNNI QT_INLINE void dw_zmm(const int same, const size_t P, size_t ks, size_t step, const uint8_t* const* ip,
                                          ptrdiff_t off, const uint8_t* zero, const int32_t* bias,
                                          const float* mult, const int8_t* wt, size_t c0,
                                          __mmask64 mask, uint8_t* out, size_t out_stride, __m512i lo8,
                                          __m512 hi, __m512i zp) {
  __m512i acc[4][4];
#pragma GCC unroll 4
  for (size_t p = 0; p < P; p++)
#pragma GCC unroll 4
    for (size_t r = 0; r < 4; r++) acc[p][r] = _mm512_loadu_si512(bias + 16 * r);
  for (size_t t = 0; t < ks; t++, wt += 4 * CT) {
    const __m512i w0 = _mm512_loadu_si512(wt), w1 = _mm512_loadu_si512(wt + 64),
                  w2 = _mm512_loadu_si512(wt + 128), w3 = _mm512_loadu_si512(wt + 192);
#pragma GCC unroll 4
    for (size_t p = 0; p < P; p++) {
      const __m512i xv = _mm512_maskz_loadu_epi8(mask, (same ? ip[p * step + t] : QT_DW_PTR(ip[p * step + t], off, zero)) + c0);
      DPBUSD(acc[p][0], xv, w0);
      DPBUSD(acc[p][1], xv, w1);
      DPBUSD(acc[p][2], xv, w2);
      DPBUSD(acc[p][3], xv, w3);
    }
  }
  /* epilogue: float multiply, clamp to hi - zp, round, saturating packs (zero point added in
   * int16), max with lo; the packs leave lane bytes in (r, j) order, one vpshufb restores 4j + r */
  const __m512i zp16 = _mm512_set1_epi16((int16_t)_mm_cvtsi128_si32(_mm512_castsi512_si128(zp)));
  const __m512i tr = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
#pragma GCC unroll 4
  for (size_t p = 0; p < P; p++) {
    const __m512i p01 = _mm512_adds_epi16(_mm512_packs_epi32(rq_cvt16(acc[p][0], mult, hi), rq_cvt16(acc[p][1], mult + 16, hi)), zp16);
    const __m512i p23 = _mm512_adds_epi16(_mm512_packs_epi32(rq_cvt16(acc[p][2], mult + 32, hi), rq_cvt16(acc[p][3], mult + 48, hi)), zp16);
    __m512i y = _mm512_shuffle_epi8(_mm512_packus_epi16(p01, p23), tr);
    y = _mm512_max_epu8(y, lo8);
    _mm512_mask_storeu_epi8(out + p * out_stride + c0, mask, y);
  }
}

/* 2P pixels x 32 channels for tiles of <= 32 channels: a zmm holds two pixels (one per 256-bit
 * half), the ymm weights, bias and multipliers are repeated in both halves, so the lane layout
 * (and the epilogue) is dw_zmm's, at half the vpdpbusd count of dw_ymm. */
QT_TARGET_AVX512VNNI QT_INLINE void dw_pair(const int same, const size_t P, size_t ks, size_t step,
                                           const uint8_t* const* ip, ptrdiff_t off,
                                           const uint8_t* zero, const int32_t* bias,
                                           const float* mult, const int8_t* wt, size_t c0,
                                           __mmask32 mask, uint8_t* out, size_t out_stride,
                                           __m512i lo8, __m512 hi, __m512i zp) {
  __m512i acc[4][4];
#pragma GCC unroll 4
  for (size_t p = 0; p < P; p++)
#pragma GCC unroll 4
    for (size_t r = 0; r < 4; r++)
      acc[p][r] = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(bias + 16 * r)));
  for (size_t t = 0; t < ks; t++, wt += 4 * CT) {
    const __m512i w0 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)wt)),
                  w1 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(wt + 64))),
                  w2 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(wt + 128))),
                  w3 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(wt + 192)));
#pragma GCC unroll 4
    for (size_t p = 0; p < P; p++) {
      const uint8_t* a = same ? ip[2 * p * step + t] : QT_DW_PTR(ip[2 * p * step + t], off, zero);
      const uint8_t* b = same ? ip[(2 * p + 1) * step + t] : QT_DW_PTR(ip[(2 * p + 1) * step + t], off, zero);
      const __m512i xv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_maskz_loadu_epi8(mask, a + c0)),
                                            _mm256_maskz_loadu_epi8(mask, b + c0), 1);
      DPBUSD(acc[p][0], xv, w0);
      DPBUSD(acc[p][1], xv, w1);
      DPBUSD(acc[p][2], xv, w2);
      DPBUSD(acc[p][3], xv, w3);
    }
  }
  const __m512i zp16 = _mm512_set1_epi16((int16_t)_mm_cvtsi128_si32(_mm512_castsi512_si128(zp)));
  const __m512i tr = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  const __m512 m0 = _mm512_broadcast_f32x8(_mm256_loadu_ps(mult)),
               m1 = _mm512_broadcast_f32x8(_mm256_loadu_ps(mult + 16)),
               m2 = _mm512_broadcast_f32x8(_mm256_loadu_ps(mult + 32)),
               m3 = _mm512_broadcast_f32x8(_mm256_loadu_ps(mult + 48));
#pragma GCC unroll 4
  for (size_t p = 0; p < P; p++) {
#define QT_RQ(A, M) _mm512_cvt_roundps_epi32(_mm512_min_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(A), M), hi), \
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
    const __m512i p01 = _mm512_adds_epi16(_mm512_packs_epi32(QT_RQ(acc[p][0], m0), QT_RQ(acc[p][1], m1)), zp16);
    const __m512i p23 = _mm512_adds_epi16(_mm512_packs_epi32(QT_RQ(acc[p][2], m2), QT_RQ(acc[p][3], m3)), zp16);
#undef QT_RQ
    __m512i y = _mm512_shuffle_epi8(_mm512_packus_epi16(p01, p23), tr);
    y = _mm512_max_epu8(y, lo8);
    _mm256_mask_storeu_epi8(out + 2 * p * out_stride + c0, mask, _mm512_castsi512_si256(y));
    _mm256_mask_storeu_epi8(out + (2 * p + 1) * out_stride + c0, mask, _mm512_extracti64x4_epi64(y, 1));
  }
}

/* P pixels x 32 channels (ymm) for tail tiles of <= 32 channels: the first half of each packed
 * weight vector holds channels 0..31 in the same (4j + r) order. */
QT_TARGET_AVX512VNNI QT_INLINE void dw_ymm(const int same, const size_t P, size_t ks, size_t step, const uint8_t* const* ip,
                                          ptrdiff_t off, const uint8_t* zero, const int32_t* bias,
                                          const float* mult, const int8_t* wt, size_t c0,
                                          __mmask32 mask, uint8_t* out, size_t out_stride, __m512i lo8,
                                          __m512 hi, __m512i zp) {
  __m256i acc[4][4];
#pragma GCC unroll 4
  for (size_t p = 0; p < P; p++)
#pragma GCC unroll 4
    for (size_t r = 0; r < 4; r++) acc[p][r] = _mm256_loadu_si256((const __m256i*)(bias + 16 * r));
  for (size_t t = 0; t < ks; t++, wt += 4 * CT) {
    const __m256i w0 = _mm256_loadu_si256((const __m256i*)wt),
                  w1 = _mm256_loadu_si256((const __m256i*)(wt + 64)),
                  w2 = _mm256_loadu_si256((const __m256i*)(wt + 128)),
                  w3 = _mm256_loadu_si256((const __m256i*)(wt + 192));
#pragma GCC unroll 4
    for (size_t p = 0; p < P; p++) {
      const __m256i xv = _mm256_maskz_loadu_epi8(mask, (same ? ip[p * step + t] : QT_DW_PTR(ip[p * step + t], off, zero)) + c0);
      DPBUSD(acc[p][0], xv, w0);
      DPBUSD(acc[p][1], xv, w1);
      DPBUSD(acc[p][2], xv, w2);
      DPBUSD(acc[p][3], xv, w3);
    }
  }
  const __m256i zp16 = _mm256_set1_epi16((int16_t)_mm_cvtsi128_si32(_mm512_castsi512_si128(zp)));
  const __m256i tr = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
#pragma GCC unroll 4
  for (size_t p = 0; p < P; p++) {
    const __m256i p01 = _mm256_adds_epi16(_mm256_packs_epi32(rq_cvt8(acc[p][0], mult, hi), rq_cvt8(acc[p][1], mult + 16, hi)), zp16);
    const __m256i p23 = _mm256_adds_epi16(_mm256_packs_epi32(rq_cvt8(acc[p][2], mult + 32, hi), rq_cvt8(acc[p][3], mult + 48, hi)), zp16);
    __m256i y = _mm256_shuffle_epi8(_mm256_packus_epi16(p01, p23), tr);
    y = _mm256_max_epu8(y, _mm512_castsi512_si256(lo8));
    _mm256_mask_storeu_epi8(out + p * out_stride + c0, mask, y);
  }
}

/* SAME: the input is where the indirection was built (in_offset 0, the executor's case), so the
 * tap pointers are used as they are, without the padding test. */
QT_TARGET_AVX512VNNI QT_INLINE void dw_rows(const int same, size_t channels, size_t ow, size_t ks,
                                           const uint8_t* const* in, size_t in_step,
                                           ptrdiff_t in_offset, const uint8_t* zero, const void* w,
                                           uint8_t* out, size_t out_stride, const qt_requant* rq) {
  const __m512 hi = _mm512_set1_ps(rq->hi_f);
  const __m512i lo8 = _mm512_set1_epi8((char)rq->lo);
  const __m512i zp = _mm512_set1_epi32(rq->zp);
  const char* wtile = (const char*)w;
  for (size_t c0 = 0; c0 < channels; c0 += CT, wtile += tile_bytes(ks)) {
    const int32_t* bias = (const int32_t*)wtile;
    const float* mult = (const float*)(bias + CT);
    const int8_t* wt = (const int8_t*)(mult + CT);
    const size_t n = channels - c0 < CT ? channels - c0 : CT;
    size_t p = 0;
    if (n > 32) {
      const __mmask64 mask = n == CT ? ~(__mmask64)0 : (((__mmask64)1 << n) - 1);
      for (; p + 4 <= ow; p += 4)
        dw_zmm(same, 4, ks, in_step, in + p * in_step, in_offset, zero, bias, mult, wt, c0, mask,
               out + p * out_stride, out_stride, lo8, hi, zp);
      for (; p < ow; p++)
        dw_zmm(same, 1, ks, in_step, in + p * in_step, in_offset, zero, bias, mult, wt, c0, mask,
               out + p * out_stride, out_stride, lo8, hi, zp);
    } else {
      const __mmask32 mask = n == 32 ? ~(__mmask32)0 : (__mmask32)(((uint64_t)1 << n) - 1);
      for (; p + 8 <= ow; p += 8)
        dw_pair(same, 4, ks, in_step, in + p * in_step, in_offset, zero, bias, mult, wt, c0, mask,
                out + p * out_stride, out_stride, lo8, hi, zp);
      for (; p + 2 <= ow; p += 2)
        dw_pair(same, 1, ks, in_step, in + p * in_step, in_offset, zero, bias, mult, wt, c0, mask,
                out + p * out_stride, out_stride, lo8, hi, zp);
      for (; p < ow; p++)
        dw_ymm(same, 1, ks, in_step, in + p * in_step, in_offset, zero, bias, mult, wt, c0, mask,
               out + p * out_stride, out_stride, lo8, hi, zp);
    }
  }
}

QT_TARGET_AVX512VNNI
void qu8_qs8w_dwconv_minmax_fp32_ukernel_c64__avx512vnni(size_t channels, size_t ow, size_t ks,
                                                         const uint8_t* const* in, size_t in_step, ptrdiff_t in_offset,
                                                         const uint8_t* zero, const void* w,
                                                         uint8_t* out, size_t out_stride,
                                                         const qt_requant* rq) {
  if (in_offset == 0)
    dw_rows(1, channels, ow, ks, in, in_step, 0, zero, w, out, out_stride, rq);
  else
    dw_rows(0, channels, ow, ks, in, in_step, in_offset, zero, w, out, out_stride, rq);
}

const qt_dwconv_config qt_dwconv_avx512vnni = {"qu8_qs8w_dwconv_minmax_fp32_ukernel_c64__avx512vnni",
                                               qu8_qs8w_dwconv_minmax_fp32_ukernel_c64__avx512vnni, CT,
                                               packed_size, pack};
#else
const qt_dwconv_config qt_dwconv_avx512vnni = {0};
#endif
