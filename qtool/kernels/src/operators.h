#ifndef QTOOL_OPERATORS_H
#define QTOOL_OPERATORS_H
#include <pthread.h>

#include "qtool_kernels.h"

enum { QT_CONV_IGEMM = 0, QT_CONV_DW = 1 };
/* qt_conv_create's `kind`: a convolution, a depthwise one, or a fully connected layer (Gemm) */
enum { QT_KIND_CONV = 0, QT_KIND_DEPTHWISE = 1, QT_KIND_FC = 2 };

typedef struct qt_conv_s {
  int kind;
  const qt_dispatch* d;          /* table active at pack time */
  const qt_igemm_config* gc;     /* the igemm / depthwise kernels chosen at pack time */
  const qt_dwconv_config* dc;
  size_t* panel_off;             /* kernels that pack their own panels: byte offset of each */
  qt_pair_stats pairs;           /* vpmaddubsw kernels: how the weights were paired */
  const char* kernel_name;
  size_t groups, cin, cout, cin_g, cout_g, kh, kw, sh, sw, pt, pl, dh, dw;
  int32_t x_zp;
  qt_requant rq;
  void* w;
  size_t w_bytes, panel_bytes, panels_per_group;
  uint8_t* zero;
  size_t zero_len;
  intptr_t* ind;                 /* igemm: cached indirection (byte offsets, -1 = padding) */
  const uint8_t** dw_ind;        /* dwconv: cached [N*OH][OW][ks] pointers into dw_base */
  const uint8_t* dw_base;
  size_t dw_row_ptrs, dw_step;   /* pointers per output row, pointer advance per output pixel */
  size_t gemm_ks, gemm_kc;       /* taps and bytes per tap the igemm microkernel sees */
  size_t ksplit;                 /* 1x1 with long K: K split into this many virtual taps */
  size_t tap_block;
  int kblock_forced;              /* > 0: K-blocked over taps so a panel slice stays in L1 */
  pthread_mutex_t lock;          /* the caches below belong to one call at a time */
  int im2col;                    /* small Cin: patches copied to a [M][KH*KW*Cin] buffer first */
  uint8_t* col;
  size_t col_bytes;
  size_t ind_n, ind_h, ind_w, ind_oh, ind_ow, mblocks;
  size_t mr;                     /* rows per indirection block (the microkernel's MR) */
  int rows_outer;                /* a group's panels fit in L1: row block outer, panels inner */
  int amx;                       /* AMX tier: A row blocks packed, K padded to amx_kp */
  size_t amx_kp;
  struct qt_conv_s* small_m;     /* AMX fully connected: VNNI-packed twin for a few rows */
} qt_conv;

/* The requantization epilogue's parameters for output zero point `zp` and clamp [lo, hi]
 * (float bounds relative to the zero point, as the kernels add it last). */
static inline void qt_fill_requant(qt_requant* rq, int32_t zp, int32_t lo, int32_t hi, int out_f32) {
  rq->zp = zp;
  rq->lo = lo;
  rq->hi = hi;
  rq->lo_f = (float)(lo - zp);
  rq->hi_f = (float)(hi - zp);
  rq->out_f32 = out_f32;
}

/* operators-conv.c */
qt_conv* qt_conv_create(const int8_t* w, const int32_t* bias, const float* mult, size_t groups,
                        size_t cin_g, size_t cout_g, size_t kh, size_t kw, size_t sh, size_t sw,
                        size_t pt, size_t pl, size_t dh, size_t dw, int32_t x_zp, int32_t y_zp,
                        int32_t lo, int32_t hi, int out_f32, int kind);
void qt_conv_free(qt_conv* cv);
void qt_set_kblock(int on);
int qt_conv_run(qt_conv* cv, const uint8_t* x, size_t n, size_t h, size_t w, void* y, size_t oh,
                size_t ow);
/* operators-deconv.c: one phase of a ConvTranspose, the convolution writing outputs (py, px)
 * modulo the strides */
typedef struct {
  qt_conv* cv;
  size_t py, px;
} qt_deconv_phase;
/* tmp: n * ceil(oh / sh) * ceil(ow / sw) * cout bytes of scratch; -1 when out of memory */
int qt_deconv_run(const qt_deconv_phase* ph, size_t nph, const uint8_t* x, size_t n, size_t h,
                  size_t w, uint8_t* y, size_t oh, size_t ow, size_t sh, size_t sw, uint8_t* tmp);
/* float32 ConvTranspose (NCHW): x [n][cin][h][w], wt [groups][og * kh * kw][cin / groups] (W's
 * per-group transpose, packed once), y [n][groups * og][oh][ow], cols scratch of n * groups * og * kh
 * * kw * h * w floats; -1 when out of memory */
typedef struct {
  size_t n, cin, h, w, groups, og, kh, kw, sh, sw, pt, pl, oh, ow;
} qt_f32_deconv_shape;
int qt_f32_deconv(const float* x, const float* wt, const float* bias, float* y, float* cols,
                  const qt_f32_deconv_shape* s);
/* operators-pool.c */
void qt_pool(const uint8_t* x, uint8_t* y, size_t n, size_t h, size_t w, size_t c, size_t oh,
             size_t ow, size_t kh, size_t kw, size_t sh, size_t sw, size_t pt, size_t pl, size_t pb,
             size_t pr, size_t dh, size_t dw, int avg, int count_include_pad, int32_t x_zp, float mult,
             int32_t y_zp, int32_t lo, int32_t hi);
/* operators-elementwise.c */
void qt_add(const uint8_t* a, const uint8_t* b, uint8_t* y, size_t n, float ma, int32_t za, float mb,
            int32_t zb, int32_t y_zp, int32_t lo, int32_t hi);
void qt_mul(const uint8_t* a, const uint8_t* b, uint8_t* y, size_t rows, size_t inner,
            size_t b_rows_per, float ratio, int32_t za, int32_t zb, int32_t y_zp, int32_t lo,
            int32_t hi);
void qt_lut(const uint8_t* x, const uint8_t* table, uint8_t* y, size_t n, size_t c);
/* operators-concat.c */
typedef struct {
  const uint8_t* x;
  size_t inner;
  int copy;
  int32_t zp;
  float mult;
} qt_concat_input;
void qt_concat(const qt_concat_input* in, size_t nin, size_t outer, uint8_t* y, int32_t y_zp);

/* operators-convert.c */
void qt_quantize_nchw_to_nhwc(const float* x, uint8_t* y, size_t n, size_t c, size_t h, size_t w,
                              float scale, int32_t zp);
void qt_dequantize_nhwc_to_nchw(const uint8_t* x, float* y, size_t n, size_t c, size_t h, size_t w,
                                float scale, int32_t zp);
/* operators-transformer.c */
/* layernorm of x (+ x2 when given, the sum kept in s when given) over rows of n */
void qt_f32_layernorm(const float* x, const float* x2, float* s, const float* g, const float* b, float* y, size_t rows,
                      size_t n, float eps);
/* softmax over rows of n; div >= 0: of (x / k or x * k) + mask row r / mask_every (mask may be NULL) */
void qt_f32_softmax(const float* x, float* y, size_t rows, size_t n, float k, int div, const float* mask,
                    size_t mask_every);
void qt_f32_gelu(const float* x, float* y, size_t count, float k_in, int div, float k_add, float k_out);
void qt_f32_erf(const float* x, float* y, size_t count);
void qt_dynamic_quantize(const float* x, uint8_t* y, size_t count, float* scale_out, uint8_t* zp_out);
void qt_dynamic_quantize_scaled(const float* x, const float* m, size_t rows, size_t n, uint8_t* y,
                                float* scale_out, uint8_t* zp_out);
/* float32 batched MatMul (operators-transformer.c): -1 when out of memory */
int qt_f32_matmul(const float* a, const float* b, float* c, size_t batch, const ptrdiff_t* a_off,
                  const ptrdiff_t* b_off, size_t m, size_t n, size_t k, ptrdiff_t a_rs, ptrdiff_t a_cs,
                  ptrdiff_t b_rs, ptrdiff_t b_cs);
int qt_dynamic_epilogue(float* y, size_t rows, size_t n, float scale, int32_t zp, const float* colsum,
                        const float* w_scale, const float* bias);
#endif
