/* Max and average pooling over NHWC uint8: one task per output row. */
#include <stdlib.h>
#include <string.h>

#include "operators.h"

typedef struct {
  const qt_dispatch* d;
  const uint8_t* x;
  uint8_t* y;
  size_t n, h, w, c, oh, ow, kh, kw, sh, sw, pt, pl, pb, pr, dh, dw;
  int avg, count_include_pad;
  int32_t x_zp;
  float mult;
  qt_requant rq;
} pool_job;

static void pool_task(void* ctx, size_t begin, size_t end) {
  const pool_job* j = (const pool_job*)ctx;
  /* locals: with -fno-strict-aliasing every store would otherwise reload the job fields */
  const size_t c = j->c, kh = j->kh, kw = j->kw, sh = j->sh, sw = j->sw, dh = j->dh, dw = j->dw;
  const size_t oh = j->oh, ow = j->ow;
  const ptrdiff_t h = (ptrdiff_t)j->h, w = (ptrdiff_t)j->w, pt = (ptrdiff_t)j->pt,
                  pl = (ptrdiff_t)j->pl, pb = (ptrdiff_t)j->pb, pr = (ptrdiff_t)j->pr;
  const uint8_t* const x = j->x;
  uint8_t* const yb = j->y;
  const int avg = j->avg, cip = j->count_include_pad;
  const qt_maxpix_fn maxpix = j->d->maxpix;
  const qt_sumpix_fn sumpix = j->d->sumpix;
  const qt_avg_out_fn avg_out = j->d->avg_out;
  int32_t* acc = NULL;
  const uint8_t** taps = (const uint8_t**)malloc(sizeof(uint8_t*) * (kh * kw + 1));
  if (!taps) return;
  if (avg) {
    acc = (int32_t*)malloc(sizeof(int32_t) * (c ? c : 1));
    if (!acc) { free(taps); return; }
  }
  for (size_t r = begin; r < end; r++) {
    const size_t b = r / oh, oy = r % oh;
    for (size_t ox = 0; ox < ow; ox++) {
      uint8_t* out = yb + (r * ow + ox) * c;
      size_t valid = 0, ph = 0, pw = 0;
      for (size_t ky = 0; ky < kh; ky++) {
        const ptrdiff_t iy = (ptrdiff_t)(oy * sh + ky * dh) - pt;
        if (iy >= -pt && iy < h + pb) ph++;
        if (iy < 0 || iy >= h) continue;
        const uint8_t* row = x + (b * (size_t)h + (size_t)iy) * (size_t)w * c;
        for (size_t kx = 0; kx < kw; kx++) {
          const ptrdiff_t ix = (ptrdiff_t)(ox * sw + kx * dw) - pl;
          if (ix >= 0 && ix < w) taps[valid++] = row + (size_t)ix * c;
        }
      }
      if (avg) {
        for (size_t kx = 0; kx < kw; kx++) {
          const ptrdiff_t ix = (ptrdiff_t)(ox * sw + kx * dw) - pl;
          if (ix >= -pl && ix < w + pr) pw++;
        }
        sumpix(c, valid, taps, acc);
        const size_t count = cip ? ph * pw : valid;
        const float m = count ? j->mult / (float)count : 0.0f;
        avg_out(c, acc, -(int32_t)valid * j->x_zp, m, out, &j->rq);
      } else {
        maxpix(c, valid, taps, out);
      }
    }
  }
  free(acc);
  free(taps);
}

void qt_pool(const uint8_t* x, uint8_t* y, size_t n, size_t h, size_t w, size_t c, size_t oh,
             size_t ow, size_t kh, size_t kw, size_t sh, size_t sw, size_t pt, size_t pl, size_t pb,
             size_t pr, size_t dh, size_t dw, int avg, int count_include_pad, int32_t x_zp, float mult,
             int32_t y_zp, int32_t lo, int32_t hi) {
  pool_job j = {qt_get_dispatch(), x, y, n, h, w, c, oh, ow, kh, kw, sh, sw, pt, pl, pb, pr, dh, dw,
                avg, count_include_pad, x_zp, mult, {0}};
  qt_fill_requant(&j.rq, y_zp, lo, hi, 0);
  qt_parallel(n * oh, pool_task, &j, (double)(n * oh * ow) * (double)(kh * kw * c) / 16.0);
}
