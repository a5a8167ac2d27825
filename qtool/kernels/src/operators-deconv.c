/* ConvTranspose (uint8 NHWC) on the convolution kernels: split by output phase.
 *
 * Output pixel o = i * s - pad + k receives input pixel i through tap k, so the outputs of one
 * phase p = o mod s (per axis) see only the taps k = (p + pad) mod s + s * t: each phase is an
 * ordinary stride-1 convolution of the input with that slice of the kernel (flipped), whose
 * outputs land s apart. The packer (qtool/kernels/deconv.py) makes one qt_conv per phase; here each
 * runs into a scratch buffer and its pixels are scattered to their places. Padding reads the input
 * zero point, so the sums are the exact int32 sums of the transposed convolution, requantized by
 * the convolution's epilogue. */
#include <stdlib.h>
#include <string.h>

#include "operators.h"

typedef struct {
  const uint8_t* src;
  uint8_t* y;
  size_t oh, ow, ohp, owp, py, px, sh, sw, cout;
} scatter_job;

/* rows [b, e) of the phase's n * ohp output rows */
static void scatter_task(void* ctx, size_t b, size_t e) {
  const scatter_job* j = (const scatter_job*)ctx;
  for (size_t r = b; r < e; r++) {
    const size_t img = r / j->ohp, jy = r % j->ohp;
    const uint8_t* s = j->src + r * j->owp * j->cout;
    uint8_t* d = j->y + ((img * j->oh + j->py + j->sh * jy) * j->ow + j->px) * j->cout;
    for (size_t i = 0; i < j->owp; i++) memcpy(d + i * j->sw * j->cout, s + i * j->cout, j->cout);
  }
}

int qt_deconv_run(const qt_deconv_phase* ph, size_t nph, const uint8_t* x, size_t n, size_t h,
                  size_t w, uint8_t* y, size_t oh, size_t ow, size_t sh, size_t sw, uint8_t* tmp) {
  for (size_t k = 0; k < nph; k++) {
    const size_t py = ph[k].py, px = ph[k].px;
    const size_t ohp = oh > py ? (oh - py + sh - 1) / sh : 0, owp = ow > px ? (ow - px + sw - 1) / sw : 0;
    if (n == 0 || ohp == 0 || owp == 0) continue;
    qt_conv* cv = ph[k].cv;
    const int dense = sh == 1 && sw == 1;  /* one phase: the convolution writes y itself */
    if (qt_conv_run(cv, x, n, h, w, dense ? y : tmp, ohp, owp) != 0) return -1;
    if (dense) continue;
    scatter_job j = {tmp, y, oh, ow, ohp, owp, py, px, sh, sw, cv->cout};
    qt_parallel(n * ohp, scatter_task, &j, (double)(n * ohp * owp * cv->cout) / 8.0);
  }
  return 0;
}

/* ---- float32 ConvTranspose, NCHW (the layout the runtime keeps float tensors in) -------------
 * Per image and group, cols = W_g^T x_g on the float32 GEMM (qt_f32_matmul: [Cout/g * KH * KW] x
 * [H * W], K = Cin/g), as ONNX Runtime's MLAS path does; then each output plane is its bias plus its
 * taps' columns added in (ky, kx) order (col2im), one plane per task, so no two tasks write the same
 * value. The sums are float32 in another order than numpy's (within float32 rounding of float64). */
typedef struct {
  const float *cols, *bias;
  float* y;
  size_t groups, og, kh, kw, h, w, sh, sw, pt, pl, oh, ow;
} col2im_job;

static void col2im_task(void* ctx, size_t begin, size_t end) {
  const col2im_job* j = (const col2im_job*)ctx;
  const size_t cout = j->groups * j->og, hw = j->h * j->w;
  for (size_t pidx = begin; pidx < end; pidx++) {
    const size_t img = pidx / cout, co = pidx % cout, g = co / j->og, o = co % j->og;
    float* y = j->y + pidx * j->oh * j->ow;
    const float b = j->bias ? j->bias[co] : 0.0f;
    for (size_t i = 0; i < j->oh * j->ow; i++) y[i] = b;
    const float* c0 = j->cols + ((img * j->groups + g) * j->og + o) * j->kh * j->kw * hw;
    for (size_t ky = 0; ky < j->kh; ky++)
      for (size_t kx = 0; kx < j->kw; kx++) {
        const float* c = c0 + (ky * j->kw + kx) * hw;
        for (size_t iy = 0; iy < j->h; iy++) {
          const ptrdiff_t oy = (ptrdiff_t)(iy * j->sh + ky) - (ptrdiff_t)j->pt;
          if (oy < 0 || oy >= (ptrdiff_t)j->oh) continue;
          float* yr = y + (size_t)oy * j->ow;
          const float* cr = c + iy * j->w;
          for (size_t ix = 0; ix < j->w; ix++) {
            const ptrdiff_t ox = (ptrdiff_t)(ix * j->sw + kx) - (ptrdiff_t)j->pl;
            if (ox >= 0 && ox < (ptrdiff_t)j->ow) yr[ox] += cr[ix];
          }
        }
      }
  }
}

int qt_f32_deconv(const float* x, const float* wt, const float* bias, float* y, float* cols,
                  const qt_f32_deconv_shape* s) {
  const size_t batch = s->n * s->groups, cg = s->cin / s->groups, m = s->og * s->kh * s->kw, hw = s->h * s->w;
  if (batch == 0 || s->oh == 0 || s->ow == 0) return 0;
  ptrdiff_t* off = (ptrdiff_t*)malloc(2 * batch * sizeof(ptrdiff_t));
  if (!off) return -1;
  for (size_t b = 0; b < batch; b++) {
    const size_t img = b / s->groups, g = b % s->groups;
    off[b] = (ptrdiff_t)(g * m * cg);
    off[batch + b] = (ptrdiff_t)((img * s->cin + g * cg) * hw);
  }
  int rc = 0;
  if (cg == 0) memset(cols, 0, batch * m * hw * sizeof(float));
  else rc = qt_f32_matmul(wt, x, cols, batch, off, off + batch, m, hw, cg, (ptrdiff_t)cg, 1, (ptrdiff_t)hw, 1);
  free(off);
  if (rc != 0) return rc;
  col2im_job j = {cols, bias, y, s->groups, s->og, s->kh, s->kw, s->h, s->w, s->sh, s->sw, s->pt, s->pl, s->oh, s->ow};
  qt_parallel(s->n * s->groups * s->og, col2im_task, &j, (double)(batch * m * hw) * 0.5);
  return 0;
}
