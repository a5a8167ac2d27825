/* The graph boundary: float32 NCHW <-> uint8 NHWC (QuantizeLinear / DequantizeLinear). */
#include <stdlib.h>
#include <string.h>

#include "operators.h"

typedef struct {
  const float* xf;
  const uint8_t* xq;
  float* yf;
  uint8_t* yq;
  size_t n, c, h, w;
  float scale, lo, hi;
  int32_t zp;
} boundary_job;

static void quantize_task(void* ctx, size_t begin, size_t end) {
  const boundary_job* j = (const boundary_job*)ctx;
  const qt_dispatch* d = qt_get_dispatch();
  const size_t c = j->c, w = j->w, h = j->h;
  uint8_t* tmp = c > 1 ? (uint8_t*)malloc(c * w + 1) : NULL;
  if (c > 1 && !tmp) return;
  for (size_t r = begin; r < end; r++) {  /* r = (b, y) */
    const size_t b = r / h, y = r % h;
    uint8_t* dst = j->yq + r * w * c;
    if (c == 1) {
      d->quant_row(w, j->xf + (b * h + y) * w, j->scale, j->zp, dst);
      continue;
    }
    for (size_t ch = 0; ch < c; ch++)  /* vectorized per channel row, then interleaved */
      d->quant_row(w, j->xf + ((b * c + ch) * h + y) * w, j->scale, j->zp, tmp + ch * w);
    if (c == 3) {
      d->interleave3(w, tmp, tmp + w, tmp + 2 * w, dst);
    } else {
      for (size_t x = 0; x < w; x++)
        for (size_t ch = 0; ch < c; ch++) dst[x * c + ch] = tmp[ch * w + x];
    }
  }
  free(tmp);
}

static void dequantize_task(void* ctx, size_t begin, size_t end) {
  const boundary_job* j = (const boundary_job*)ctx;
  for (size_t r = begin; r < end; r++) {
    const size_t b = r / j->h, y = r % j->h;
    const uint8_t* src = j->xq + r * j->w * j->c;
    for (size_t ch = 0; ch < j->c; ch++) {
      float* dst = j->yf + ((b * j->c + ch) * j->h + y) * j->w;
      for (size_t x = 0; x < j->w; x++) dst[x] = (float)((int32_t)src[x * j->c + ch] - j->zp) * j->scale;
    }
  }
}

void qt_quantize_nchw_to_nhwc(const float* x, uint8_t* y, size_t n, size_t c, size_t h, size_t w,
                              float scale, int32_t zp) {
  boundary_job j = {x, NULL, NULL, y, n, c, h, w, scale, (float)(0 - zp), (float)(255 - zp), zp};
  qt_parallel(n * h, quantize_task, &j, (double)(n * c * h * w) / 2.0);
}

void qt_dequantize_nhwc_to_nchw(const uint8_t* x, float* y, size_t n, size_t c, size_t h, size_t w,
                                float scale, int32_t zp) {
  boundary_job j = {NULL, x, y, NULL, n, c, h, w, scale, 0.0f, 0.0f, zp};
  qt_parallel(n * h, dequantize_task, &j, (double)(n * c * h * w) / 2.0);
}
