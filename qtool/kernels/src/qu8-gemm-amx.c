/* AMX-INT8 GEMM (Sapphire Rapids and later): tdpbusd multiplies u8 activations by s8 weights,
 * 4-way dot products into int32, on 16 x 64-byte tiles: one instruction is 16 x 16 x 64 MACs.
 * The integer sums are exact, so results equal the VNNI kernels' (and numpy's) bit for bit.
 *
 * Operands:
 *   A: one row block of up to MR=32 rows, packed by qt_amx_pack_a into [32][kp] bytes
 *      (the ks taps of kc bytes each, back to back; kp = ks*kc rounded up to 64; the bytes past
 *      ks*kc may hold anything, since they meet zero weights).
 *   w: a 32-column panel: int32 bias[32], float mult[32], then two 16-column halves, each
 *      int8 [kp/4][16][4] (the VNNI layout: 16 rows of 64 bytes per 64 K).
 * Tiles (palette 1, all 16 rows x 64 bytes): 0-3 accumulators (rows 0-15 / 16-31 x columns
 * 0-15 / 16-31), 4-5 A, 6-7 B. */
#include "qtool_kernels.h"
#if QT_X86
#include <immintrin.h>

#include "qu8-requant-avx512.h"

#define QT_TARGET_AMX \
  __attribute__((target("avx2,fma,bmi2,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")))

#define MR 32
#define NR 32

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} qt_tilecfg;

QT_TARGET_AMX void qt_amx_begin(void) {
  qt_tilecfg cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int i = 0; i < 8; i++) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  /* not _tile_loadconfig: GCC 12's version names only the first 8 bytes of the config as its
   * memory operand, so the stores to the rest may be dropped */
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

QT_TARGET_AMX void qt_amx_end(void) { _tile_release(); }

/* Pack rows [0, rows) of one row block: row i, tap t reads kc bytes at x + ind[t * MR + i]
 * (ind < 0: the zero-point buffer). Masked moves never touch bytes past kc. */
QT_TARGET_AMX void qt_amx_pack_a(size_t rows, size_t kc, size_t ks, const intptr_t* ind,
                                 const uint8_t* x, const uint8_t* zero, uint8_t* a, size_t kp) {
  const size_t full = kc & ~(size_t)63, rem = kc & 63;
  const __mmask64 mrem = rem ? (~(__mmask64)0 >> (64 - rem)) : 0;
  for (size_t i = 0; i < rows; i++) {
    uint8_t* dst = a + i * kp;
    for (size_t t = 0; t < ks; t++, dst += kc) {
      const intptr_t o = ind[t * MR + i];
      const uint8_t* src = o >= 0 ? x + o : zero;
      size_t k = 0;
      for (; k < full; k += 64) _mm512_storeu_si512(dst + k, _mm512_loadu_si512(src + k));
      if (rem) _mm512_mask_storeu_epi8(dst + k, mrem, _mm512_maskz_loadu_epi8(mrem, src + k));
    }
  }
}

/* u8 epilogue for two rows x 32 columns (as in the VNNI kernel): float multiply, clamp to
 * hi - zp, round half to even, saturating packs with the zero point added in int16, max with lo,
 * one vpermd to undo the pack interleave. Equal to clip(rint(acc * m) + zp, lo, hi). */
/* Tile part of one row block (mr <= 32 rows of A, rows a_stride bytes apart, kp bytes each of
 * which those past the real K meet zero weights) x one panel (nc <= 32 columns): accumulators
 * 0-3 start from the panel's bias (a zero-stride load repeats it on every row). With a_loaded
 * (kp = 64) the A tiles 4-5 already hold the block and are not reloaded. */
QT_TARGET_AMX QT_INLINE void amx_compute(size_t mr, size_t nc, size_t kp, const uint8_t* a,
                                         size_t a_stride, const void* w, int a_loaded) {
  const int32_t* bias = (const int32_t*)w;
  const int8_t* b0 = (const int8_t*)((const float*)(bias + NR) + NR);
  const int8_t* b1 = b0 + kp * 16;
  const uint8_t* a1 = a + 16 * a_stride;
  const size_t nk = kp / 64;
  const long sa = (long)a_stride;
  _tile_loadd(0, bias, 0);
  _tile_loadd(1, bias + 16, 0);
  if (mr > 16 && nc > 16) {
    _tile_loadd(2, bias, 0);
    _tile_loadd(3, bias + 16, 0);
    for (size_t kb = 0; kb < nk; kb++) {
      if (!a_loaded) _tile_loadd(4, a + kb * 64, sa);
      _tile_loadd(6, b0 + kb * 1024, 64);
      _tile_dpbusd(0, 4, 6);
      _tile_loadd(7, b1 + kb * 1024, 64);
      _tile_dpbusd(1, 4, 7);
      if (!a_loaded) _tile_loadd(5, a1 + kb * 64, sa);
      _tile_dpbusd(2, 5, 6);
      _tile_dpbusd(3, 5, 7);
    }
  } else if (mr > 16) {
    _tile_loadd(2, bias, 0);
    for (size_t kb = 0; kb < nk; kb++) {
      if (!a_loaded) _tile_loadd(4, a + kb * 64, sa);
      _tile_loadd(6, b0 + kb * 1024, 64);
      _tile_dpbusd(0, 4, 6);
      if (!a_loaded) _tile_loadd(5, a1 + kb * 64, sa);
      _tile_dpbusd(2, 5, 6);
    }
  } else if (nc > 16) {
    for (size_t kb = 0; kb < nk; kb++) {
      if (!a_loaded) _tile_loadd(4, a + kb * 64, sa);
      _tile_loadd(6, b0 + kb * 1024, 64);
      _tile_dpbusd(0, 4, 6);
      _tile_loadd(7, b1 + kb * 1024, 64);
      _tile_dpbusd(1, 4, 7);
    }
  } else {
    for (size_t kb = 0; kb < nk; kb++) {
      if (!a_loaded) _tile_loadd(4, a + kb * 64, sa);
      _tile_loadd(6, b0 + kb * 1024, 64);
      _tile_dpbusd(0, 4, 6);
    }
  }
}

/* requantize mr rows x nc columns of the accumulator tiles (through cbuf, 32 x 32 int32) into c
 * (u8, or f32 with rq->out_f32) */
QT_TARGET_AMX QT_INLINE void amx_store_epilogue(size_t mr, size_t nc, const void* w,
                                                int32_t* cbuf, void* c, size_t cm_stride,
                                                const qt_requant* rq) {
  _tile_stored(0, cbuf, 128);
  _tile_stored(1, cbuf + 16, 128);
  if (mr > 16) {
    _tile_stored(2, cbuf + 16 * 32, 128);
    _tile_stored(3, cbuf + 16 * 32 + 16, 128);
  }
  const float* mult = (const float*)((const int32_t*)w + NR);
  char* cr = (char*)c;
  if (!rq->out_f32) {
    const u8_pair k = u8_pair_setup(mult, nc, rq);
    for (size_t i = 0; i < mr; i += 2, cr += 2 * cm_stride) {
      const int32_t* r0 = cbuf + i * 32;
      store_pair_u8(_mm512_loadu_si512(r0), _mm512_loadu_si512(r0 + 16), _mm512_loadu_si512(r0 + 32),
                    _mm512_loadu_si512(r0 + 48), &k, (uint8_t*)cr, (uint8_t*)cr + cm_stride, i + 1 < mr);
    }
    return;
  }
  const __mmask16 m0 = col_mask16(nc, 0), m1 = col_mask16(nc, 16);
  for (size_t i = 0; i < mr; i++, cr += cm_stride) {
    const int32_t* row = cbuf + i * 32;
    store16(_mm512_loadu_si512(row), mult, cr, m0, rq);
    if (m1) store16(_mm512_loadu_si512(row + 16), mult + 16, cr + 64, m1, rq);
  }
}

/* One row block x np consecutive panels (panel_bytes apart; the last one has nc_last <= 32
 * columns, the others 32), outputs 32 columns apart in c. With K <= 64 the A tiles are loaded
 * once for all panels. Tiles must be configured (qt_amx_begin) on the calling thread. */
QT_TARGET_AMX
void qu8_qs8w_gemm_minmax_fp32_ukernel_32x32c4__amx(size_t mr, size_t np, size_t nc_last,
                                                    size_t kp, const uint8_t* a, size_t a_stride,
                                                    const void* w, size_t panel_bytes, void* c,
                                                    size_t cm_stride, const qt_requant* rq,
                                                    int32_t* cbuf) {
  const size_t cstep = NR * (rq->out_f32 ? 4 : 1);
  const int a_loaded = kp == 64 && np > 1;
  if (a_loaded) {
    _tile_loadd(4, a, (long)a_stride);
    if (mr > 16) _tile_loadd(5, a + 16 * a_stride, (long)a_stride);
  }
  for (size_t p = 0; p < np; p++) {
    const char* wp = (const char*)w + p * panel_bytes;
    const size_t nc = p + 1 == np ? nc_last : NR;
    amx_compute(mr, nc, kp, a, a_stride, wp, a_loaded);
    amx_store_epilogue(mr, nc, wp, cbuf, (char*)c + p * cstep, cm_stride, rq);
  }
}

/* Weight packing for one panel: column j (< pnr valid), flattened K index kk (tap-major). */
static void pack_panel(size_t kp, size_t kk_n, size_t cols, const int8_t* const* wrows,
                       const int32_t* bias, const float* mult, void* panel) {
  int32_t* pb = (int32_t*)panel;
  float* pm = (float*)(pb + NR);
  int8_t* pw = (int8_t*)(pm + NR);
  for (size_t j = 0; j < cols; j++) {
    pb[j] = bias[j];
    pm[j] = mult[j];
    int8_t* half = pw + (j / 16) * kp * 16;
    for (size_t kk = 0; kk < kk_n; kk++) half[((kk / 4) * 16 + j % 16) * 4 + kk % 4] = wrows[j][kk];
  }
}

const qt_amx_gemm_config qt_gemm_amx = {
    "qu8_qs8w_gemm_minmax_fp32_ukernel_32x32c4__amx", MR, NR,
    qu8_qs8w_gemm_minmax_fp32_ukernel_32x32c4__amx, qt_amx_pack_a, pack_panel, qt_amx_begin,
    qt_amx_end};
#else
const qt_amx_gemm_config qt_gemm_amx = {0};
#endif
