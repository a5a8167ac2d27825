/* Convolution and fully connected operators on top of the igemm / dwconv / AMX microkernels:
 * packing, indirection, threading over output tiles. */
#include <stdlib.h>
#include <string.h>

#include "operators.h"

static size_t round_up(size_t v, size_t m) { return (v + m - 1) / m * m; }

#define QT_L1_SLICE (24 * 1024)

/* The AMX tier runs a convolution on tiles only when K = KH*KW*Cin/group >= QT_AMX_MIN_K and a
 * group has more than 16 output channels: below that the padding of K to 64 (and of N to 32) and
 * the trip of the sums through memory lose to the VNNI kernel. Single-thread A/B on
 * EfficientNet-Lite0's and ResNet-50's 1x1 shapes: K = 16: 1.1-1.4x slower on tiles, K = 24:
 * 0.85-1.0x, K = 32 with N = 16: 1.07x, K = 40-80: 0.6-0.8x, K = 64 (N = 256): 0.55x,
 * K >= 96: 0.6-0.85x; the 3x3 stem with Cin = 3 (K = 27): a tie. */
#define QT_AMX_MIN_K 24
#define QT_AMX_MIN_N 17
#define QT_AMX_MIN_M 4   /* fully connected layers with fewer rows run on their VNNI twin */

/* K blocking: 0 off, 1 on (row-block runs >= 8), 2 forced on every run (tests). Applies to
 * objects packed afterwards. */
static int g_kblock = 1;
void qt_set_kblock(int mode) { g_kblock = mode; }

/* 1: objects packed afterwards use the tier's exact 16-bit kernels where it has them (AVX2), so
 * benchmarks and tests can compare them with the vpmaddubsw kernels in one process */
static int g_exact_only = 0;
void qt_set_exact_only(int on) { g_exact_only = on; }
int qt_get_exact_only(void) { return g_exact_only; }

static void* qt_alloc(size_t n) {
  void* p = NULL;
  if (posix_memalign(&p, 64, n ? round_up(n, 64) : 64) != 0) return NULL;
  return p;
}

void qt_conv_free(qt_conv* cv) {
  if (!cv) return;
  qt_conv_free(cv->small_m);
  free(cv->w);
  free(cv->panel_off);
  free(cv->zero);
  free(cv->ind);
  free((void*)cv->dw_ind);
  free(cv->col);
  pthread_mutex_destroy(&cv->lock);
  free(cv);
}


static qt_conv* conv_create(const qt_dispatch* d, const int8_t* w, const int32_t* bias,
                            const float* mult, size_t groups, size_t cin_g, size_t cout_g,
                            size_t kh, size_t kw, size_t sh, size_t sw, size_t pt, size_t pl,
                            size_t dh, size_t dw, int32_t x_zp, int32_t y_zp, int32_t lo,
                            int32_t hi, int out_f32, int kind);

qt_conv* qt_conv_create(const int8_t* w, const int32_t* bias, const float* mult, size_t groups,
                        size_t cin_g, size_t cout_g, size_t kh, size_t kw, size_t sh, size_t sw,
                        size_t pt, size_t pl, size_t dh, size_t dw, int32_t x_zp, int32_t y_zp,
                        int32_t lo, int32_t hi, int out_f32, int kind) {
  return conv_create(qt_get_dispatch(), w, bias, mult, groups, cin_g, cout_g, kh, kw, sh, sw, pt,
                     pl, dh, dw, x_zp, y_zp, lo, hi, out_f32, kind);
}

static qt_conv* conv_create(const qt_dispatch* d, const int8_t* w, const int32_t* bias,
                            const float* mult, size_t groups, size_t cin_g, size_t cout_g,
                            size_t kh, size_t kw, size_t sh, size_t sw, size_t pt, size_t pl,
                            size_t dh, size_t dw, int32_t x_zp, int32_t y_zp, int32_t lo,
                            int32_t hi, int out_f32, int kind) {
  const int depthwise = kind == QT_KIND_DEPTHWISE;
  qt_conv* cv = (qt_conv*)calloc(1, sizeof(qt_conv));
  if (!cv) return NULL;
  pthread_mutex_init(&cv->lock, NULL);
  cv->d = d;
  cv->kind = depthwise ? QT_CONV_DW : QT_CONV_IGEMM;
  cv->groups = groups; cv->cin_g = cin_g; cv->cout_g = cout_g;
  cv->cin = groups * cin_g; cv->cout = groups * cout_g;
  cv->kh = kh; cv->kw = kw; cv->sh = sh; cv->sw = sw; cv->pt = pt; cv->pl = pl; cv->dh = dh; cv->dw = dw;
  cv->x_zp = x_zp;
  qt_fill_requant(&cv->rq, y_zp, lo, hi, out_f32);
  const size_t ks = kh * kw;
  cv->zero_len = (cv->cin > cin_g ? cv->cin : cin_g) + 128;
  cv->zero = (uint8_t*)qt_alloc(cv->zero_len);
  if (!cv->zero) goto fail;
  memset(cv->zero, (int)x_zp, cv->zero_len);
  if (depthwise) {
    const qt_dwconv_config* dc =
        cv->d->dwconv_exact.ukernel && (g_exact_only || ks > QT_DW_MADDUBS_MAX_KS)
            ? &cv->d->dwconv_exact : &cv->d->dwconv;
    cv->dc = dc;
    cv->kernel_name = dc->name;
    cv->w_bytes = dc->packed_size(cv->cout, ks);
    cv->w = qt_alloc(cv->w_bytes);
    if (!cv->w) goto fail;
    /* taps in kx-major order so that neighbouring pixels can share indirection columns */
    int8_t* wt = (int8_t*)malloc(cv->cout * ks + 1);
    if (!wt) goto fail;
    for (size_t ch = 0; ch < cv->cout; ch++)
      for (size_t ky = 0; ky < kh; ky++)
        for (size_t kx = 0; kx < kw; kx++) wt[ch * ks + kx * kh + ky] = w[ch * ks + ky * kw + kx];
    if (dc->pack_paired) dc->pack_paired(cv->cout, kh, kw, wt, bias, mult, cv->w, &cv->pairs);
    else dc->pack(cv->cout, ks, wt, bias, mult, cv->w);
    free(wt);
    return cv;
  }
  if (cv->d->amx.ukernel && ks * cin_g >= QT_AMX_MIN_K && cout_g >= QT_AMX_MIN_N) {
    /* AMX: packing A is an im2col of one row block, so no K split. Stems (Cin < 8) are
     * im2col'd whole first, and the tiles read those rows in place (packing them tap by tap,
     * a few bytes each, cost twice the GEMM). */
    const qt_amx_gemm_config* ac = &cv->d->amx;
    const size_t nr = ac->nr, kk_n = ks * cin_g;
    cv->amx = 1;
    cv->mr = ac->mr;
    cv->kernel_name = ac->name;
    cv->im2col = groups == 1 && ks > 1 && cin_g < 8;
    cv->gemm_ks = cv->im2col ? 1 : ks;
    cv->gemm_kc = cv->im2col ? kk_n : cin_g;
    cv->ksplit = 1;
    cv->amx_kp = round_up(kk_n, 64);
    cv->panel_bytes = round_up(nr * 8 + cv->amx_kp * nr, 64);
    cv->panels_per_group = (cout_g + nr - 1) / nr;
    cv->w_bytes = cv->panel_bytes * cv->panels_per_group * groups;
    cv->w = qt_alloc(cv->w_bytes);
    if (!cv->w) goto fail;
    memset(cv->w, 0, cv->w_bytes);
    const int8_t* wrows[64];
    for (size_t g = 0; g < groups; g++)
      for (size_t p = 0; p < cv->panels_per_group; p++) {
        const size_t oc0 = g * cout_g + p * nr;
        const size_t cols = cout_g - p * nr < nr ? cout_g - p * nr : nr;
        for (size_t j = 0; j < cols; j++) wrows[j] = w + (oc0 + j) * kk_n;  /* [ks][cin_g] */
        ac->pack_panel(cv->amx_kp, kk_n, cols, wrows, bias + oc0, mult + oc0,
                       (char*)cv->w + (g * cv->panels_per_group + p) * cv->panel_bytes);
      }
    /* a fully connected layer usually sees one row (batch 1), where the VNNI GEMV kernel beats
     * 16-row tiles (1280 -> 1000: 13 vs 20 us): keep a VNNI-packed twin for M < QT_AMX_MIN_M */
    if (kind == QT_KIND_FC) {
      cv->small_m = conv_create(qt_dispatch_for(QT_ISA_AVX512VNNI), w, bias, mult, groups, cin_g,
                                cout_g, kh, kw, sh, sw, pt, pl, dh, dw, x_zp, y_zp, lo, hi, out_f32,
                                QT_KIND_CONV);
      if (!cv->small_m) goto fail;
    }
    return cv;
  }
  const qt_igemm_config* gc =
      g_exact_only && cv->d->igemm_exact.ukernel ? &cv->d->igemm_exact : &cv->d->igemm;
  cv->gc = gc;
  cv->kernel_name = gc->name;
  cv->mr = gc->mr;
  const size_t nr = gc->nr, kr = gc->kr, es = gc->welem;
  /* Few input channels (network stems): K per tap would be mostly padding and tail loads, so
   * copy the patches once (im2col) and run one tap of K = KH*KW*Cin; the packed weight order
   * [tap][cin] is the same. */
  cv->im2col = groups == 1 && ks > 1 && cin_g < 8;
  /* A pairing packer pairs within a tap; with an odd Cin, ONNX Runtime's pairs (even K over
   * (kh, kw, cin)) cross taps, so weights made safe for that order are paired in it: one tap of
   * K = KH*KW*Cin (im2col) */
  if (gc->pack_panel && groups == 1 && ks > 1 && cin_g % 2) cv->im2col = 1;
  cv->gemm_ks = cv->im2col ? 1 : ks;
  cv->gemm_kc = cv->im2col ? ks * cin_g : cin_g;
  cv->ksplit = 1;
  if (g_kblock && gc->ukernel_acc && !cv->im2col && ks == 1 && cin_g * nr * es > QT_L1_SLICE) {
    /* 1x1 with a long K: split K into S "virtual taps" (kc/S a multiple of 4) so the K blocking
     * below applies; the packed order [K/4][NR][4] is unchanged. */
    for (size_t sp = 2; sp <= cin_g / 4; sp++)
      if (cin_g % (4 * sp) == 0 && (cin_g / sp) * nr * es <= QT_L1_SLICE) {
        cv->ksplit = sp;
        break;
      }
    cv->gemm_ks = cv->ksplit;
    cv->gemm_kc = cin_g / cv->ksplit;
  }
  const size_t kcp = round_up(cv->gemm_kc, kr);
  cv->panel_bytes = round_up(nr * 8 + cv->gemm_ks * kcp * nr * es, 64);
  /* K blocking: when a panel's weights exceed ~L1, run blocks of taps over several row blocks
   * with int32 partial sums, so each weight slice is read from L2 once per row-block run. */
  if (g_kblock && gc->ukernel_acc && cv->gemm_ks > 1 && cv->gemm_ks * kcp * nr * es > QT_L1_SLICE) {
    size_t tb = QT_L1_SLICE / (kcp * nr * es);
    cv->tap_block = tb < 1 ? 1 : tb;
    cv->kblock_forced = g_kblock == 2;
  }
  cv->panels_per_group = (cout_g + nr - 1) / nr;
  /* Short K (all of a group's panels fit in L1) with more than one thread: loop over row blocks
   * outside and panels inside, so each thread writes whole output rows. A/B on EfficientNet-Lite0's
   * short-K 1x1s (K = 16-40, N = 96-240): 15-30 % faster with 2 threads than panel-major order,
   * but ~10 % slower with one (conv_run_locked decides per call). */
  cv->rows_outer = !cv->tap_block && cv->panels_per_group > 1 &&
                   cv->panels_per_group * cv->panel_bytes <= QT_L1_SLICE / 2;
  if (gc->pack_panel) {
    /* the kernel packs its own panels, whose size depends on the weights (pairing) */
    const size_t np = groups * cv->panels_per_group;
    cv->panel_off = (size_t*)malloc(sizeof(size_t) * (np + 1));
    if (!cv->panel_off) goto fail;
    const int8_t* wrows[64];
    size_t off = 0, maxb = 0;
    for (int pass = 0; pass < 2; pass++) {
      off = 0;
      for (size_t g = 0; g < groups; g++)
        for (size_t p = 0; p < cv->panels_per_group; p++) {
          const size_t oc0 = g * cout_g + p * nr;
          const size_t cols = cout_g - p * nr < nr ? cout_g - p * nr : nr;
          for (size_t j = 0; j < cols; j++) wrows[j] = w + (oc0 + j) * ks * cin_g;
          qt_pair_stats st = {0, 0, 0, 0};
          void* dst = pass ? (char*)cv->w + off : NULL;
          size_t b = round_up(gc->pack_panel(cv->gemm_ks, cv->gemm_kc, cols, wrows, bias + oc0,
                                             mult + oc0, dst, pass ? &cv->pairs : &st), 64);
          if (!pass) cv->panel_off[g * cv->panels_per_group + p] = off;
          maxb = b > maxb ? b : maxb;
          off += b;
        }
      if (!pass) {
        cv->w_bytes = off;
        cv->panel_bytes = maxb;
        cv->rows_outer = cv->panels_per_group > 1 && off / groups <= QT_L1_SLICE / 2;
        cv->w = qt_alloc(cv->w_bytes);
        if (!cv->w) goto fail;
        memset(cv->w, 0, cv->w_bytes);
      }
    }
    return cv;
  }
  cv->w_bytes = cv->panel_bytes * cv->panels_per_group * groups;
  cv->w = qt_alloc(cv->w_bytes);
  if (!cv->w) goto fail;
  memset(cv->w, 0, cv->w_bytes);
  for (size_t g = 0; g < groups; g++) {
    for (size_t p = 0; p < cv->panels_per_group; p++) {
      char* panel = (char*)cv->w + (g * cv->panels_per_group + p) * cv->panel_bytes;
      /* the last panel of a group with <= nr/2 columns uses the half-width layout and kernel */
      const size_t pnr = (gc->ukernel_half && cout_g - p * nr <= nr / 2) ? nr / 2 : nr;
      int32_t* pb = (int32_t*)panel;
      float* pm = (float*)(pb + pnr);
      char* pw = (char*)(pm + pnr);
      for (size_t j = 0; j < pnr; j++) {
        size_t oc = p * nr + j;
        if (oc >= cout_g) break;
        pb[j] = bias[g * cout_g + oc];
        pm[j] = mult[g * cout_g + oc];
        const int8_t* wrow = w + (g * cout_g + oc) * ks * cin_g;  /* [ks][cin_g] */
        for (size_t t = 0; t < cv->gemm_ks; t++)
          for (size_t k = 0; k < cv->gemm_kc; k++) {
            size_t idx = ((t * (kcp / kr) + k / kr) * pnr + j) * kr + k % kr;
            int8_t v = wrow[t * cv->gemm_kc + k];
            if (es == 1) ((int8_t*)pw)[idx] = v;
            else ((int16_t*)pw)[idx] = v;
          }
      }
    }
  }
  return cv;
fail:
  qt_conv_free(cv);
  return NULL;
}

/* Indirection buffer [mblocks][ks][MR] of byte offsets into x (-1 = padding), cached per shape. */
static int build_indirection(qt_conv* cv, size_t n, size_t h, size_t w, size_t oh, size_t ow) {
  if (cv->ind && cv->ind_n == n && cv->ind_h == h && cv->ind_w == w && cv->ind_oh == oh &&
      cv->ind_ow == ow)
    return 0;
  free(cv->ind);
  cv->ind = NULL;
  const size_t mr = cv->mr, ks = cv->gemm_ks;
  const size_t m = n * oh * ow, mblocks = (m + mr - 1) / mr;
  intptr_t* ind = (intptr_t*)malloc(sizeof(intptr_t) * (mblocks * ks * mr + 1));
  if (!ind) return -1;
  if (cv->im2col) {
    for (size_t mb = 0; mb < mblocks; mb++)
      for (size_t i = 0; i < mr; i++) {
        size_t row = mb * mr + i < m ? mb * mr + i : m - 1;
        ind[mb * mr + i] = (intptr_t)(row * cv->gemm_kc);
      }
  } else
  for (size_t mb = 0; mb < mblocks; mb++)
    for (size_t i = 0; i < mr; i++) {
      size_t row = mb * mr + i;
      if (row >= m) row = m - 1;  /* rows past the end repeat the last one (stores are skipped) */
      size_t b = row / (oh * ow), rem = row % (oh * ow), oy = rem / ow, ox = rem % ow;
      const size_t S = cv->ksplit;  /* virtual taps per real tap (K split), usually 1 */
      for (size_t ky = 0; ky < cv->kh; ky++)
        for (size_t kx = 0; kx < cv->kw; kx++) {
          ptrdiff_t iy = (ptrdiff_t)(oy * cv->sh + ky * cv->dh) - (ptrdiff_t)cv->pt;
          ptrdiff_t ix = (ptrdiff_t)(ox * cv->sw + kx * cv->dw) - (ptrdiff_t)cv->pl;
          intptr_t off = -1;
          if (iy >= 0 && iy < (ptrdiff_t)h && ix >= 0 && ix < (ptrdiff_t)w)
            off = (intptr_t)(((b * h + (size_t)iy) * w + (size_t)ix) * cv->cin);
          for (size_t vt = 0; vt < S; vt++)
            ind[(mb * ks + (ky * cv->kw + kx) * S + vt) * mr + i] =
                off < 0 ? -1 : off + (intptr_t)(vt * cv->gemm_kc);
        }
    }
  cv->ind = ind;
  cv->ind_n = n; cv->ind_h = h; cv->ind_w = w; cv->ind_oh = oh; cv->ind_ow = ow;
  cv->mblocks = mblocks;
  return 0;
}

typedef struct {
  const qt_conv* cv;
  const uint8_t* x;
  void* y;
  size_t n, h, w, oh, ow, m;
  size_t nch;                    /* AMX: panel chunks per row block */
  int rows_outer;                /* igemm: row blocks outer, panels inner (see rows_outer) */
  size_t rb;                     /* igemm, panel-major: row blocks per row chunk (row_chunk);
                                    im2col_igemm_task: output rows per task */
  int failed;                    /* a task could not allocate its buffer */
} conv_job;

/* AMX: per-thread packed-A block and accumulator scratch (pool threads live for the process) */
static __thread uint8_t* tl_amx_a;
static __thread size_t tl_amx_cap;
static __thread int32_t* tl_amx_c;

/* task t = (group, row block, panel chunk), chunk fastest so that a thread packs each row block
 * once for its run of chunks */
static void amx_task(void* ctx, size_t begin, size_t end) {
  const conv_job* j = (const conv_job*)ctx;
  const qt_conv* cv = j->cv;
  const qt_amx_gemm_config* ac = &cv->d->amx;
  const size_t mr = ac->mr, nr = ac->nr, kp = cv->amx_kp, ks = cv->gemm_ks;
  const size_t mblocks = cv->mblocks, nch = j->nch, ppg = cv->panels_per_group;
  const size_t es = cv->rq.out_f32 ? 4 : 1, cstride = cv->cout * es;
  const size_t need = mr * kp;
  if (tl_amx_cap < need) {
    free(tl_amx_a);
    tl_amx_a = (uint8_t*)qt_alloc(need);
    tl_amx_cap = tl_amx_a ? need : 0;
    if (!tl_amx_a) return;
    memset(tl_amx_a, 0, need);
  }
  if (!tl_amx_c) {
    tl_amx_c = (int32_t*)qt_alloc(sizeof(int32_t) * mr * nr);
    if (!tl_amx_c) return;
  }
  ac->begin();
  size_t packed = (size_t)-1;
  const uint8_t* a = tl_amx_a;
  size_t a_stride = kp;
  const size_t x_bytes = cv->im2col ? cv->col_bytes : j->n * j->h * j->w * cv->cin;
  for (size_t t = begin; t < end; t++) {
    const size_t ch = t % nch, gm = t / nch, mb = gm % mblocks, g = gm / mblocks;
    const size_t row0 = mb * mr, rows = j->m - row0 < mr ? j->m - row0 : mr;
    if (gm != packed) {
      const intptr_t* ind = cv->ind + mb * ks * mr;
      const uint8_t* xg = j->x + g * cv->cin_g;
      a = tl_amx_a;
      a_stride = kp;
      /* 1x1 over a full block of equally spaced pixels: tile loads read the input in place.
       * They read kp bytes per row: those past kc meet zero weights, and must stay inside x. */
      if (ks == 1 && rows == mr && ind[0] >= 0 && ind[1] > ind[0] &&
          (size_t)ind[mr - 1] + kp <= x_bytes - g * cv->cin_g) {
        const intptr_t d = ind[1] - ind[0];
        size_t i = 2;
        while (i < mr && ind[i] - ind[i - 1] == d) i++;
        if (i == mr) {
          a = xg + ind[0];
          a_stride = (size_t)d;
        }
      }
      if (a == tl_amx_a) ac->pack_a(rows, cv->gemm_kc, ks, ind, xg, cv->zero, tl_amx_a, kp);
      packed = gm;
    }
    const size_t p0 = ppg * ch / nch, p1 = ppg * (ch + 1) / nch;
    if (p1 > p0) {
      const size_t last = (p1 - 1) * nr, nc_last = cv->cout_g - last < nr ? cv->cout_g - last : nr;
      ac->ukernel(rows, p1 - p0, nc_last, kp, a, a_stride,
                  (const char*)cv->w + (g * ppg + p0) * cv->panel_bytes, cv->panel_bytes,
                  (char*)j->y + row0 * cstride + (g * cv->cout_g + p0 * nr) * es, cstride, &cv->rq,
                  tl_amx_c);
    }
  }
  ac->end();
}

static inline const char* panel_at(const qt_conv* cv, size_t gp) {
  return (const char*)cv->w + (cv->panel_off ? cv->panel_off[gp] : gp * cv->panel_bytes);
}

/* Panel-major order over all of M sweeps the whole input once per panel and writes each output
 * row a panel's columns at a time: with M large (ResNet-50's first stage at batch 8: 25088 rows,
 * 6.4 MB out) every output line is fetched and written back once per panel pair and the input
 * comes from L3 each time. Cut M into chunks whose input rows and output rows fit in L2 with room
 * to spare, and run the panels over one chunk before the next; the weights (small enough to stay
 * in L2) are read once per chunk. Rows a chunk reads: K bytes for a 1x1 or an im2col'd layer,
 * about Cin * stride^2 new input bytes per output pixel for a strided or 3x3 window. */
#define QT_ROW_CHUNK_BYTES (256 * 1024)
static size_t row_chunk(const qt_conv* cv, size_t m) {
  const size_t mblocks = cv->mblocks, mr = cv->mr;
  if (cv->panels_per_group < 2 || cv->panels_per_group * cv->panel_bytes > QT_ROW_CHUNK_BYTES)
    return mblocks;
  const size_t es = cv->rq.out_f32 ? 4 : 1;
  const size_t a_row = (cv->kh * cv->kw == 1 || cv->im2col) ? cv->gemm_ks * cv->gemm_kc
                                                             : cv->cin_g * cv->sh * cv->sw;
  const size_t row_bytes = a_row + cv->cout_g * es;
  if (m * row_bytes <= 2 * QT_ROW_CHUNK_BYTES) return mblocks;
  size_t rb = QT_ROW_CHUNK_BYTES / row_bytes / mr;
  if (rb < 8) rb = 8;  /* K blocking wants runs of >= 8 row blocks */
  return rb < mblocks ? rb : mblocks;
}

static void igemm_task(void* ctx, size_t begin, size_t end) {
  const conv_job* j = (const conv_job*)ctx;
  const qt_conv* cv = j->cv;
  const qt_igemm_config* gc = cv->gc;
  const size_t mr = gc->mr, nr = gc->nr, ks = cv->gemm_ks, kc = cv->gemm_kc;
  const size_t es = cv->rq.out_f32 ? 4 : 1;
  const size_t mblocks = cv->mblocks, ppg = cv->panels_per_group;
  int32_t* scratch = NULL;
  if (j->rows_outer) {
    const size_t cstride = cv->cout * es;
    for (size_t t = begin; t < end; t++) {
      const size_t g = t / (mblocks * ppg), rem = t % (mblocks * ppg), mb = rem / ppg, p = rem % ppg;
      const size_t col0 = p * nr, nc = cv->cout_g - col0 < nr ? cv->cout_g - col0 : nr;
      const size_t row0 = mb * mr, rows = j->m - row0 < mr ? j->m - row0 : mr;
      const qt_igemm_ukernel uk = (gc->ukernel_half && nc <= nr / 2) ? gc->ukernel_half : gc->ukernel;
      uk(rows, nc, kc, ks, cv->ind + mb * ks * mr, j->x + g * cv->cin_g, cv->zero,
         panel_at(cv, g * ppg + p),
         (char*)j->y + row0 * cstride + (g * cv->cout_g + col0) * es, cstride, &cv->rq);
    }
    return;
  }
  /* task order: group, row chunk (rb row blocks; the last may be shorter), panel, row block */
  const size_t rb = j->rb, full = mblocks / rb, per_group = mblocks * ppg;
  size_t t = begin;
  while (t < end) {
    const size_t g = t / per_group, u = t % per_group;
    size_t chunk0, rbc, rem;
    if (u < full * rb * ppg) {
      chunk0 = u / (rb * ppg) * rb; rbc = rb; rem = u % (rb * ppg);
    } else {
      chunk0 = full * rb; rbc = mblocks - chunk0; rem = u - full * rb * ppg;
    }
    const size_t p = rem / rbc, gp = g * ppg + p;
    const size_t mb0 = chunk0 + rem % rbc;
    size_t mb1 = chunk0 + rbc;                  /* this run: row blocks of one panel in the chunk */
    if (mb1 - mb0 > end - t) mb1 = mb0 + (end - t);
    const size_t col0 = p * nr;
    const size_t nc = cv->cout_g - col0 < nr ? cv->cout_g - col0 : nr;
    const uint8_t* xg = j->x + g * cv->cin_g;
    const char* panel = panel_at(cv, gp);
    char* cbase = (char*)j->y + (g * cv->cout_g + col0) * es;
    const size_t cstride = cv->cout * es;
    /* K blocking pays off only when a weight slice is reused by many row blocks (measured: it
     * loses ~10% at 7 row blocks, gains a few % at 25+ under cache contention) */
    const int blocked = cv->tap_block && nc > nr / 2 && mb1 - mb0 >= (cv->kblock_forced ? 1 : 8);
    if (blocked && !scratch) scratch = (int32_t*)malloc(sizeof(int32_t) * mr * nr * mblocks);
    if (blocked && scratch) {
      for (size_t t0 = 0; t0 < ks; t0 += cv->tap_block) {
        const size_t nt = ks - t0 < cv->tap_block ? ks - t0 : cv->tap_block;
        const int first = t0 == 0, last = t0 + nt >= ks;
        for (size_t mb = mb0; mb < mb1; mb++) {
          const size_t row0 = mb * mr;
          const size_t rows = j->m - row0 < mr ? j->m - row0 : mr;
          int32_t* acc = scratch + (mb - mb0) * mr * nr;
          gc->ukernel_acc(rows, nc, kc, t0, nt, cv->ind + (mb * ks + t0) * mr, xg, cv->zero, panel,
                          first ? NULL : acc, last ? NULL : acc, cbase + row0 * cstride, cstride,
                          &cv->rq);
        }
      }
    } else {
      const qt_igemm_ukernel uk = (gc->ukernel_half && nc <= nr / 2) ? gc->ukernel_half : gc->ukernel;
      for (size_t mb = mb0; mb < mb1; mb++) {
        const size_t row0 = mb * mr;
        const size_t rows = j->m - row0 < mr ? j->m - row0 : mr;
        uk(rows, nc, kc, ks, cv->ind + mb * ks * mr, xg, cv->zero, panel, cbase + row0 * cstride,
           cstride, &cv->rq);
      }
    }
    t += mb1 - mb0;
  }
  free(scratch);
}

/* Depthwise indirection, cached per input shape. Pointers point into the input seen when it was
 * built (dw_base); later calls pass x - dw_base as in_offset. Padding taps point at `zero`.
 * Without dilation, each output row stores its input columns once: column q (input x = q - pl)
 * holds KH pointers, pixel ox starts at column ox * sw, and its taps (kx major, ky minor) are
 * contiguous, so neighbouring pixels share columns (3x fewer pointers for 3x3 stride 1).
 * With dilation: [OW][KW][KH] pointers per row. */
static int build_dw_indirection(qt_conv* cv, const uint8_t* x, size_t n, size_t h, size_t w,
                                size_t oh, size_t ow) {
  if (cv->dw_ind && cv->ind_n == n && cv->ind_h == h && cv->ind_w == w && cv->ind_oh == oh &&
      cv->ind_ow == ow)
    return 0;
  free((void*)cv->dw_ind);
  const size_t kh = cv->kh, kw = cv->kw, c = cv->cout;
  const int shared = cv->dw == 1;
  const size_t cols = shared ? (ow - 1) * cv->sw + kw : ow * kw;
  cv->dw_row_ptrs = cols * kh;
  cv->dw_step = shared ? cv->sw * kh : kw * kh;
  const uint8_t** ind = (const uint8_t**)malloc(sizeof(uint8_t*) * (n * oh * cv->dw_row_ptrs + 1));
  cv->dw_ind = ind;
  if (!ind) return -1;
  for (size_t b = 0; b < n; b++)
    for (size_t oy = 0; oy < oh; oy++)
      for (size_t q = 0; q < cols; q++) {
        /* shared: column q is input x = q - pl; else q = ox * kw + kx */
        const ptrdiff_t ix = shared ? (ptrdiff_t)q - (ptrdiff_t)cv->pl
                                    : (ptrdiff_t)((q / kw) * cv->sw + (q % kw) * cv->dw) - (ptrdiff_t)cv->pl;
        for (size_t ky = 0; ky < kh; ky++) {
          const ptrdiff_t iy = (ptrdiff_t)(oy * cv->sh + ky * cv->dh) - (ptrdiff_t)cv->pt;
          const uint8_t* p = cv->zero;
          if (iy >= 0 && iy < (ptrdiff_t)h && ix >= 0 && ix < (ptrdiff_t)w)
            p = x + ((b * h + (size_t)iy) * w + (size_t)ix) * c;
          *ind++ = p;
        }
      }
  cv->dw_base = x;
  cv->ind_n = n; cv->ind_h = h; cv->ind_w = w; cv->ind_oh = oh; cv->ind_ow = ow;
  return 0;
}

static void dw_task(void* ctx, size_t begin, size_t end) {
  const conv_job* j = (const conv_job*)ctx;
  const qt_conv* cv = j->cv;
  const size_t ks = cv->kh * cv->kw, c = cv->cout;
  const ptrdiff_t off = (const char*)j->x - (const char*)cv->dw_base;
  for (size_t r = begin; r < end; r++)
    cv->dc->ukernel(c, j->ow, ks, cv->dw_ind + r * cv->dw_row_ptrs, cv->dw_step, off,
                          cv->zero, cv->w, (uint8_t*)j->y + r * j->ow * c, c, &cv->rq);
}

/* memcpy for the short runs of im2col: overlapping fixed-size moves instead of a libc call. */
static inline void small_copy(uint8_t* d, const uint8_t* s, size_t n) {
  if (n >= 16 && n <= 32) {
    memcpy(d, s, 16);
    memcpy(d + n - 16, s + n - 16, 16);
  } else if (n >= 8 && n < 16) {
    memcpy(d, s, 8);
    memcpy(d + n - 8, s + n - 8, 8);
  } else if (n >= 4 && n < 8) {
    memcpy(d, s, 4);
    memcpy(d + n - 4, s + n - 4, 4);
  } else if (n < 4) {
    for (size_t i = 0; i < n; i++) d[i] = s[i];
  } else {
    memcpy(d, s, n);
  }
}

/* output rows (b, oy) [begin, end) into col, whose first row is output row r0 */
static void im2col_rows(const conv_job* j, size_t begin, size_t end, uint8_t* const col, size_t r0) {
  const qt_conv* cv = j->cv;
  /* locals: stores through uint8_t* may alias the job/conv structs, so keep their fields here */
  const size_t c = cv->cin, kh = cv->kh, kw = cv->kw, sh = cv->sh, sw = cv->sw, dh = cv->dh,
               dw = cv->dw, oh = j->oh, ow = j->ow, h = j->h, w = j->w, K = cv->gemm_kc;
  const ptrdiff_t pt = (ptrdiff_t)cv->pt, pl = (ptrdiff_t)cv->pl;
  const int zp = (int)cv->x_zp;
  const uint8_t* x = j->x;
  /* interior pixels copy each kernel row (kw * c bytes, contiguous in NHWC) with one fixed
   * 16- or 32-byte move: the bytes past the run are overwritten by the next tap or pixel of the
   * same output row, filled later by the same thread (a row's last pixel takes the exact path,
   * so nothing spills into another task's row), and the source read stays inside x */
  const size_t run = kw * c, wide = run <= 16 ? 16 : 32;
  const uint8_t* const x_end = x + j->n * h * w * c;
  const size_t ox_lo = pl > 0 ? ((size_t)pl + sw - 1) / sw : 0;  /* first ox with ix0 >= 0 */
  for (size_t r = begin; r < end; r++) {  /* r = output row (b, oy) */
    const size_t b = r / oh, oy = r % oh;
    uint8_t* dst = col + (r - r0) * ow * K;
    int rows_in = 1;
    for (size_t ky = 0; ky < kh; ky++) {
      const ptrdiff_t iy = (ptrdiff_t)(oy * sh + ky * dh) - pt;
      rows_in &= iy >= 0 && iy < (ptrdiff_t)h;
    }
    if (dw == 1 && run <= 32 && rows_in) {
      size_t ox = 0;
      for (; ox < ow; ox++, dst += K) {
        const ptrdiff_t ix0 = (ptrdiff_t)(ox * sw) - pl;
        if (ox >= ox_lo && ox + 1 < ow && ix0 + (ptrdiff_t)kw <= (ptrdiff_t)w) {
          const uint8_t* src = x + ((b * h + (oy * sh - (size_t)pt)) * w + (size_t)ix0) * c;
          if (src + (kh - 1) * dh * w * c + wide <= x_end) {
            for (size_t ky = 0; ky < kh; ky++, src += dh * w * c) {
              if (wide == 16) memcpy(dst + ky * run, src, 16);
              else memcpy(dst + ky * run, src, 32);
            }
            continue;
          }
        }
        for (size_t ky = 0; ky < kh; ky++) {  /* left/right border (or the end of x) */
          const uint8_t* row = x + (b * h + (oy * sh + ky * dh - (size_t)pt)) * w * c;
          uint8_t* d = dst + ky * run;
          for (size_t kx = 0; kx < kw; kx++) {
            const ptrdiff_t ix = ix0 + (ptrdiff_t)kx;
            if (ix >= 0 && ix < (ptrdiff_t)w) small_copy(d + kx * c, row + (size_t)ix * c, c);
            else memset(d + kx * c, zp, c);
          }
        }
      }
      continue;
    }
    for (size_t ox = 0; ox < ow; ox++) {
      const ptrdiff_t ix0 = (ptrdiff_t)(ox * sw) - pl;
      for (size_t ky = 0; ky < kh; ky++) {
        const ptrdiff_t iy = (ptrdiff_t)(oy * sh + ky * dh) - pt;
        if (iy < 0 || iy >= (ptrdiff_t)h) {
          memset(dst, zp, kw * c);
          dst += kw * c;
          continue;
        }
        const uint8_t* row = x + (b * h + (size_t)iy) * w * c;
        if (dw == 1) {  /* the in-bounds taps of one kernel row are contiguous in NHWC */
          ptrdiff_t a = ix0 < 0 ? -ix0 : 0;
          ptrdiff_t e = (ptrdiff_t)w - ix0;
          if (e > (ptrdiff_t)kw) e = (ptrdiff_t)kw;
          if (e < a) e = a;
          if (a > 0) memset(dst, zp, (size_t)a * c);
          if (e > a) small_copy(dst + a * c, row + (size_t)(ix0 + a) * c, (size_t)(e - a) * c);
          if ((size_t)e < kw) memset(dst + e * c, zp, (kw - (size_t)e) * c);
          dst += kw * c;
          continue;
        }
        for (size_t kx = 0; kx < kw; kx++, dst += c) {
          const ptrdiff_t ix = ix0 + (ptrdiff_t)(kx * dw);
          if (ix >= 0 && ix < (ptrdiff_t)w)
            memcpy(dst, row + (size_t)ix * c, c);
          else
            memset(dst, zp, c);
        }
      }
    }
  }
}

static void im2col_task(void* ctx, size_t begin, size_t end) {
  const conv_job* j = (const conv_job*)ctx;
  im2col_rows(j, begin, end, j->cv->col, 0);
}

/* im2col'd convolutions (network stems) without the AMX tier: each task copies the patches of a
 * few output rows into its thread's buffer (L2-sized) and runs every panel over them at once,
 * instead of copying all of M first (ResNet-50's stem at batch 8: 14.7 MB of patches written to
 * memory and read back per panel). */
static __thread uint8_t* tl_col;
static __thread size_t tl_col_cap;

static void im2col_igemm_task(void* ctx, size_t begin, size_t end) {
  conv_job* j = (conv_job*)ctx;
  const qt_conv* cv = j->cv;
  const qt_igemm_config* gc = cv->gc;
  const size_t mr = gc->mr, nr = gc->nr, K = cv->gemm_kc, ow = j->ow, rows = j->n * j->oh;
  const size_t es = cv->rq.out_f32 ? 4 : 1, cstride = cv->cout * es, ppg = cv->panels_per_group;
  /* a tile's A rows are read once for all panels when the panels fit in L1 together */
  const int tiles_outer = ppg * cv->panel_bytes <= QT_L1_SLICE;
  intptr_t ind[16];
  for (size_t c = begin; c < end; c++) {
    const size_t r0 = c * j->rb, r1 = r0 + j->rb < rows ? r0 + j->rb : rows, npix = (r1 - r0) * ow;
    const size_t need = npix * K + 64;
    if (tl_col_cap < need) {
      free(tl_col);
      tl_col = (uint8_t*)qt_alloc(need);
      tl_col_cap = tl_col ? need : 0;
      if (!tl_col) {
        j->failed = 1;
        return;
      }
    }
    im2col_rows(j, r0, r1, tl_col, r0);
    char* y = (char*)j->y + r0 * ow * cstride;
    const size_t n_outer = tiles_outer ? (npix + mr - 1) / mr : ppg;
    const size_t n_inner = tiles_outer ? ppg : (npix + mr - 1) / mr;
    for (size_t a = 0; a < n_outer; a++)
      for (size_t b = 0; b < n_inner; b++) {
        const size_t q = (tiles_outer ? a : b) * mr, p = tiles_outer ? b : a;
        const size_t m = npix - q < mr ? npix - q : mr;
        for (size_t i = 0; i < mr; i++) ind[i] = (intptr_t)((q + (i < m ? i : m - 1)) * K);
        const size_t col0 = p * nr, nc = cv->cout_g - col0 < nr ? cv->cout_g - col0 : nr;
        const qt_igemm_ukernel uk = (gc->ukernel_half && nc <= nr / 2) ? gc->ukernel_half : gc->ukernel;
        uk(m, nc, K, 1, ind, tl_col, cv->zero, panel_at(cv, p), y + q * cstride + col0 * es, cstride,
           &cv->rq);
      }
  }
}

static int conv_run_locked(qt_conv* cv, const uint8_t* x, size_t n, size_t h, size_t w, void* y,
                           size_t oh, size_t ow) {
  conv_job j = {cv, x, y, n, h, w, oh, ow, n * oh * ow, 1, cv->rows_outer && qt_get_num_threads() > 1};
  if (j.m == 0) return 0;
  if (cv->small_m && j.m < QT_AMX_MIN_M)  /* under cv's lock, which covers its twin */
    return conv_run_locked(cv->small_m, x, n, h, w, y, oh, ow);
  if (cv->im2col && !cv->amx && cv->mr <= 16) {  /* (16: im2col_igemm_task's indirection block) */
    /* output rows per task: their patches and outputs within QT_ROW_CHUNK_BYTES, and at least
     * 4 tasks per thread */
    const size_t rows = n * oh, T = (size_t)qt_get_num_threads();
    size_t rb = QT_ROW_CHUNK_BYTES / (ow * (cv->gemm_kc + cv->cout * (cv->rq.out_f32 ? 4 : 1)) + 1);
    const size_t fair = (rows + 4 * T - 1) / (4 * T);
    if (rb > fair) rb = fair;
    j.rb = rb ? rb : 1;
    const double macs = (double)j.m * (double)(cv->cout * cv->gemm_kc);
    qt_parallel((rows + j.rb - 1) / j.rb, im2col_igemm_task, &j,
                macs / 150.0 + (double)(j.m * cv->cout) / 8.0 + (double)(j.m * cv->gemm_kc) / 4.0);
    return j.failed ? -1 : 0;
  }
  if (cv->im2col) {
    size_t need = j.m * cv->gemm_kc + (cv->amx ? cv->amx_kp : 0) + 64;
    if (cv->col_bytes < need) {
      free(cv->col);
      cv->col = (uint8_t*)qt_alloc(need);
      cv->col_bytes = cv->col ? need : 0;
      if (!cv->col) return -1;
    }
    qt_parallel(n * oh, im2col_task, &j, (double)(j.m * cv->gemm_kc) / 4.0);
    j.x = cv->col;
  }
  if (cv->kind == QT_CONV_DW) {
    if (build_dw_indirection(cv, x, n, h, w, oh, ow) != 0) return -1;
    qt_parallel(n * oh, dw_task, &j, (double)j.m * (double)(cv->cout * cv->kh * cv->kw) / 25.0);
    return 0;
  }
  if (build_indirection(cv, n, h, w, oh, ow) != 0) return -1;
  if (cv->amx) {
    /* enough tasks to balance two threads when there are few row blocks (batch 1, 7x7) */
    const size_t gm = cv->groups * cv->mblocks;
    j.nch = gm >= 8 ? 1 : (8 + gm - 1) / gm;
    if (j.nch > cv->panels_per_group) j.nch = cv->panels_per_group;
    const double macs = (double)j.m * (double)(cv->cout * cv->amx_kp);
    qt_parallel(gm * j.nch, amx_task, &j,
                macs / 500.0 + (double)(j.m * cv->cout) / 4.0 + (double)(j.m * cv->amx_kp) / 16.0);
    return 0;
  }
  j.rb = row_chunk(cv, j.m);
  const double macs = (double)j.m * (double)(cv->cout * cv->cin_g * cv->kh * cv->kw);
  qt_parallel(cv->groups * cv->panels_per_group * cv->mblocks, igemm_task, &j,
              macs / 150.0 + (double)(j.m * cv->cout) / 8.0);
  return 0;
}

int qt_conv_run(qt_conv* cv, const uint8_t* x, size_t n, size_t h, size_t w, void* y, size_t oh,
                size_t ow) {
  pthread_mutex_lock(&cv->lock);
  int rc = conv_run_locked(cv, x, n, h, w, y, oh, ow);
  pthread_mutex_unlock(&cv->lock);
  return rc;
}
