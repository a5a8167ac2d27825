/* AVX2 depthwise convolution, 32 channels per tile, on vpmaddubsw where that is exact.
 *
 * Taps are the reduction axis: four taps' inputs are interleaved per channel (two vpunpck
 * levels), vpmaddubsw adds the products of taps (t0, t1) and (t2, t3) into int16 and vpmaddwd
 * with ones adds those into int32: 128 MACs for 20 vector ops. That is exact when each pair is
 * safe for every channel of the tile (qs8-pairing.c), so the packer chooses, per tile, which taps
 * are paired: ONNX's row-major pairing (0,1), (2,3), ... first (weights safe in ONNX Runtime's
 * order keep it), else a search. Taps left over (ks % 4), and every tap of a tile with no safe
 * pairing, run on the exact form: two taps interleaved and widened to int16 pairs for vpmaddwd
 * (64 MACs for 14 ops; the kernel this replaces took ~7 ops per 16).
 *
 * Accumulator j holds channels {4j..4j+3, 16+4j..16+4j+3} (what the in-lane unpacks give); the
 * epilogue's packs put them back in order.
 * Tile: int32 bias[32], float mult[32] (accumulator order), meta[32 * m] = {n4, n2, taps...}
 * (n4 four-tap groups, then n2 exact pairs; tap = packed index, ks = padding), then per group
 * 4 x 32 bytes of s8 weights [acc][lane][tap], per pair 4 x 32 bytes of int16 [acc][lane][tap]. */
#include "qtool_kernels.h"
#if QT_X86
#include <immintrin.h>

#define CT 32

static size_t round_up(size_t v, size_t m) { return (v + m - 1) / m * m; }

/* channel of accumulator j, lane l */
static size_t acc_channel(size_t j, size_t l) { return (l < 4 ? 0 : 16) + 4 * j + (l % 4); }

static size_t meta_bytes(size_t ks) { return round_up(2 + ks + 4, 32); }

static size_t tile_bytes(size_t n4, size_t n2, size_t ks) {
  return CT * 8 + meta_bytes(ks) + (n4 + n2) * 128;
}

static size_t packed_size(size_t channels, size_t ks) {
  /* the largest tile: every tap in exact pairs */
  return (channels + CT - 1) / CT * tile_bytes(0, (ks + 1) / 2, ks);
}

/* ---- choosing the pairs of one tile ---- */
typedef struct {
  size_t ks, n;
  const int8_t* w;  /* [channels][ks] packed order, already offset to the tile */
  uint8_t ok[64][64];
  long budget;
} pair_search;

static int tap_pair_ok(const pair_search* s, size_t a, size_t b) {
  for (size_t c = 0; c < s->n; c++)
    if (!qt_pair_is_safe(s->w[c * s->ks + a], s->w[c * s->ks + b])) return 0;
  return 1;
}

/* perfect matching of the taps in `left` (count m) over ok[][]; depth-first, bounded */
static int match(pair_search* s, uint8_t* left, size_t m, uint8_t* out) {
  if (m == 0) return 1;
  if (--s->budget < 0) return 0;
  const uint8_t a = left[0];
  for (size_t i = 1; i < m; i++) {
    const uint8_t b = left[i];
    if (!s->ok[a][b]) continue;
    uint8_t rest[64];
    size_t r = 0;
    for (size_t q = 1; q < m; q++)
      if (q != i) rest[r++] = left[q];
    out[0] = a;
    out[1] = b;
    if (match(s, rest, r, out + 2)) return 1;
  }
  return 0;
}

/* taps: row-major tap r -> packed index. Fills order[0..ks) = 4-tap groups then the leftovers;
 * returns 1 natural, 2 searched, 0 none (order = row-major, all exact). */
static int choose_taps(pair_search* s, const uint8_t* rm, uint8_t* order) {
  const size_t ks = s->ks, n4 = ks / 4, rem = ks % 4, m = 4 * n4;
  for (size_t t = 0; t < ks; t++) order[t] = rm[t];
  if (n4 == 0) return 0;
  int natural = 1;
  for (size_t p = 0; p < m; p += 2) natural &= tap_pair_ok(s, rm[p], rm[p + 1]);
  if (natural) return 1;
  if (ks > 64) return 0;
  for (size_t a = 0; a < ks; a++)
    for (size_t b = 0; b < ks; b++) s->ok[a][b] = a != b && tap_pair_ok(s, a, b);
  /* leftovers: the last `rem` row-major taps, else (one leftover) each tap in turn */
  const size_t tries = rem == 1 ? ks : 1;
  for (size_t tr = 0; tr < tries; tr++) {
    uint8_t left[64], pairs[64];
    size_t nl = 0;
    const size_t skip = rem == 1 ? (ks - 1 + tr) % ks : ks;  /* row-major index left out */
    for (size_t t = 0; t < ks; t++) {
      if (rem == 1 ? t == skip : t >= m) continue;
      left[nl++] = rm[t];
    }
    s->budget = 20000;
    if (match(s, left, nl, pairs)) {
      for (size_t t = 0; t < m; t++) order[t] = pairs[t];
      size_t q = m;
      for (size_t t = 0; t < ks; t++)
        if (rem == 1 ? t == skip : t >= m) order[q++] = rm[t];
      return 2;
    }
  }
  return 0;
}

static void pack_paired(size_t channels, size_t kh, size_t kw, const int8_t* w, const int32_t* bias,
                        const float* mult, void* out, qt_pair_stats* st) {
  const size_t ks = kh * kw;  /* <= QT_DW_MADDUBS_MAX_KS (operators-conv.c) */
  uint8_t rm[256], order[256];
  for (size_t ky = 0; ky < kh; ky++)
    for (size_t kx = 0; kx < kw; kx++) rm[ky * kw + kx] = (uint8_t)(kx * kh + ky);
  pair_search s;
  char* p = (char*)out;
  for (size_t c0 = 0; c0 < channels; c0 += CT) {
    const size_t n = channels - c0 < CT ? channels - c0 : CT;
    s.ks = ks; s.n = n; s.w = w + c0 * ks;
    const int r = choose_taps(&s, rm, order);
    st->blocks += n;
    if (r == 1) st->natural += n;
    else if (r == 2) st->reordered += n;
    else st->fallback += n;  /* the tile runs the exact 16-bit form */
    const size_t n4 = r ? ks / 4 : 0, n2 = (ks - 4 * n4 + 1) / 2;
    memset(p, 0, tile_bytes(n4, n2, ks));
    int32_t* b = (int32_t*)p;
    float* m = (float*)(b + CT);
    uint8_t* meta = (uint8_t*)(m + CT);
    for (size_t j = 0; j < 4; j++)
      for (size_t l = 0; l < 8; l++) {
        const size_t ch = c0 + acc_channel(j, l);
        b[j * 8 + l] = ch < channels ? bias[ch] : 0;
        m[j * 8 + l] = ch < channels ? mult[ch] : 0.0f;
      }
    meta[0] = (uint8_t)n4;
    meta[1] = (uint8_t)n2;
    for (size_t t = 0; t < 4 * n4 + 2 * n2; t++) meta[2 + t] = t < ks ? order[t] : (uint8_t)ks;
    int8_t* wg = (int8_t*)(meta + meta_bytes(ks));
    for (size_t g = 0; g < n4; g++, wg += 128)
      for (size_t j = 0; j < 4; j++)
        for (size_t l = 0; l < 8; l++) {
          const size_t ch = c0 + acc_channel(j, l);
          for (size_t i = 0; i < 4; i++)
            wg[j * 32 + l * 4 + i] = ch < channels ? w[ch * ks + order[4 * g + i]] : 0;
        }
    for (size_t q = 0; q < n2; q++, wg += 128) {
      int16_t* wq = (int16_t*)wg;
      for (size_t j = 0; j < 4; j++)
        for (size_t l = 0; l < 8; l++) {
          const size_t ch = c0 + acc_channel(j, l);
          for (size_t i = 0; i < 2; i++) {
            const size_t t = 4 * n4 + 2 * q + i;
            wq[j * 16 + l * 2 + i] = ch < channels && t < ks ? w[ch * ks + order[t]] : 0;
          }
        }
    }
    p += tile_bytes(n4, n2, ks);
  }
}

/* ---- the kernel ---- */
/* n channels of one tap, never reading past them (the last pixel's end is the buffer's end);
 * the lanes past n are multiplied by zero weights */
QT_TARGET_AVX2 QT_INLINE __m256i load32(const uint8_t* p, size_t n, __m256i mask) {
  if (n == CT) return _mm256_loadu_si256((const __m256i*)p);
  if (n == 16) return _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)p));
  if (n % 4 == 0) return _mm256_maskload_epi32((const int*)p, mask);
  uint8_t tmp[CT] = {0};
  memcpy(tmp, p, n);
  return _mm256_loadu_si256((const __m256i*)tmp);
}

QT_TARGET_AVX2 QT_INLINE __m256i requant8(__m256i acc, const float* mult, __m256 lo, __m256 hi) {
  __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_loadu_ps(mult));
  return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(f, lo), hi));
}

QT_TARGET_AVX2 QT_INLINE void tile_pixels(const size_t FULL, size_t n, size_t c0, size_t ow, size_t ks,
                                          const uint8_t* const* in, size_t in_step, ptrdiff_t in_offset,
                                          const uint8_t* zero, const char* tile, uint8_t* out,
                                          size_t out_stride, const qt_requant* rq) {
  const int32_t* bias = (const int32_t*)tile;
  const float* mult = (const float*)(bias + CT);
  const uint8_t* meta = (const uint8_t*)(mult + CT);
  const size_t n4 = meta[0], n2 = meta[1];
  const uint8_t* taps = meta + 2;
  const char* w0 = (const char*)meta + meta_bytes(ks);
  const __m256i ones = _mm256_set1_epi16(1), z = _mm256_setzero_si256();
  const __m256 lo = _mm256_set1_ps(rq->lo_f), hi = _mm256_set1_ps(rq->hi_f);
  const __m256i zp = _mm256_set1_epi16((int16_t)rq->zp);
  const size_t nn = FULL ? CT : n;
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(nn / 4)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  /* pp[t]: tap t's channels c0.. of this pixel, pp[ks] the padding (what a tap index of ks means) */
  const uint8_t* pp[QT_DW_MADDUBS_MAX_KS + 1];
  pp[ks] = zero + c0;
#define TAP(t) load32(pp[t], nn, mask)
  for (size_t p = 0; p < ow; p++) {
    const uint8_t* const* ip = in + p * in_step;
    if (in_offset == 0) {
      for (size_t t = 0; t < ks; t++) pp[t] = ip[t] + c0;
    } else {
      for (size_t t = 0; t < ks; t++) pp[t] = QT_DW_PTR(ip[t], in_offset, zero) + c0;
    }
    __m256i a0 = _mm256_loadu_si256((const __m256i*)bias);
    __m256i a1 = _mm256_loadu_si256((const __m256i*)(bias + 8));
    __m256i a2 = _mm256_loadu_si256((const __m256i*)(bias + 16));
    __m256i a3 = _mm256_loadu_si256((const __m256i*)(bias + 24));
    const __m256i* wv = (const __m256i*)w0;
    const uint8_t* tp = taps;
    for (size_t g = 0; g < n4; g++, tp += 4, wv += 4) {
      const __m256i x0 = TAP(tp[0]), x1 = TAP(tp[1]), x2 = TAP(tp[2]), x3 = TAP(tp[3]);
      const __m256i l01 = _mm256_unpacklo_epi8(x0, x1), l23 = _mm256_unpacklo_epi8(x2, x3);
      const __m256i h01 = _mm256_unpackhi_epi8(x0, x1), h23 = _mm256_unpackhi_epi8(x2, x3);
      a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_unpacklo_epi16(l01, l23), _mm256_load_si256(wv)), ones));
      a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_unpackhi_epi16(l01, l23), _mm256_load_si256(wv + 1)), ones));
      a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_unpacklo_epi16(h01, h23), _mm256_load_si256(wv + 2)), ones));
      a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_unpackhi_epi16(h01, h23), _mm256_load_si256(wv + 3)), ones));
    }
    for (size_t q = 0; q < n2; q++, tp += 2, wv += 4) {
      const __m256i x0 = TAP(tp[0]), x1 = TAP(tp[1]);
      const __m256i l = _mm256_unpacklo_epi8(x0, x1), h = _mm256_unpackhi_epi8(x0, x1);
      a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_unpacklo_epi8(l, z), _mm256_load_si256(wv)));
      a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_unpackhi_epi8(l, z), _mm256_load_si256(wv + 1)));
      a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(_mm256_unpacklo_epi8(h, z), _mm256_load_si256(wv + 2)));
      a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(_mm256_unpackhi_epi8(h, z), _mm256_load_si256(wv + 3)));
    }
    /* (0-3|16-19, 4-7|20-23) -> 0-7|16-23; (8-11|24-27, 12-15|28-31) -> 8-15|24-31; then 0-31 */
    const __m256i p01 = _mm256_adds_epi16(_mm256_packs_epi32(requant8(a0, mult, lo, hi), requant8(a1, mult + 8, lo, hi)), zp);
    const __m256i p23 = _mm256_adds_epi16(_mm256_packs_epi32(requant8(a2, mult + 16, lo, hi), requant8(a3, mult + 24, lo, hi)), zp);
    const __m256i y = _mm256_packus_epi16(p01, p23);
    uint8_t* o = out + p * out_stride + c0;
    if (FULL) {
      _mm256_storeu_si256((__m256i*)o, y);
    } else {
      uint8_t tmp[CT];
      _mm256_storeu_si256((__m256i*)tmp, y);
      memcpy(o, tmp, n);
    }
  }
#undef TAP
}

QT_TARGET_AVX2
void qu8_qs8w_dwconv_minmax_fp32_ukernel_c32__avx2_maddubs(size_t channels, size_t ow, size_t ks,
                                                          const uint8_t* const* in, size_t in_step,
                                                          ptrdiff_t in_offset, const uint8_t* zero,
                                                          const void* w, uint8_t* out, size_t out_stride,
                                                          const qt_requant* rq) {
  const char* tile = (const char*)w;
  for (size_t c0 = 0; c0 < channels; c0 += CT) {
    const uint8_t* meta = (const uint8_t*)tile + CT * 8;
    const size_t n = channels - c0 < CT ? channels - c0 : CT;
    if (n == CT) tile_pixels(1, n, c0, ow, ks, in, in_step, in_offset, zero, tile, out, out_stride, rq);
    else tile_pixels(0, n, c0, ow, ks, in, in_step, in_offset, zero, tile, out, out_stride, rq);
    tile += tile_bytes(meta[0], meta[1], ks);
  }
}

const qt_dwconv_config qt_dwconv_avx2_maddubs = {
    "qu8_qs8w_dwconv_minmax_fp32_ukernel_c32__avx2_maddubs",
    qu8_qs8w_dwconv_minmax_fp32_ukernel_c32__avx2_maddubs, CT, packed_size, NULL, pack_paired};
#else
const qt_dwconv_config qt_dwconv_avx2_maddubs = {0};
#endif
