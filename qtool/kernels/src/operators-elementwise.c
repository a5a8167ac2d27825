/* Elementwise uint8 operators: add (QLinearAdd), mul (QLinearMul) and table lookup. */
#include <stdlib.h>
#include <string.h>

#include "operators.h"

/* ---- add ---- */
typedef struct {
  const qt_dispatch* d;
  const uint8_t *a, *b;
  uint8_t* y;
  size_t n;
  float ma, mb;
  int32_t za, zb;
  qt_requant rq;
} add_job;

#define QT_CHUNK 16384

static void add_task(void* ctx, size_t begin, size_t end) {
  const add_job* j = (const add_job*)ctx;
  size_t s = begin * QT_CHUNK, e = end * QT_CHUNK;
  if (e > j->n) e = j->n;
  if (s < e) j->d->add(e - s, j->a + s, j->b + s, j->y + s, j->ma, j->za, j->mb, j->zb, &j->rq);
}

void qt_add(const uint8_t* a, const uint8_t* b, uint8_t* y, size_t n, float ma, int32_t za, float mb,
            int32_t zb, int32_t y_zp, int32_t lo, int32_t hi) {
  add_job j = {qt_get_dispatch(), a, b, y, n, ma, mb, za, zb, {0}};
  qt_fill_requant(&j.rq, y_zp, lo, hi, 0);
  j.rq.lo_f = (float)lo;  /* the add kernel clamps after adding the output zero point */
  j.rq.hi_f = (float)hi;
  qt_parallel((n + QT_CHUNK - 1) / QT_CHUNK, add_task, &j, (double)n / 8.0);
}

/* ---- mul (ORT QLinearMul rounding), b same shape or broadcast over the pixels ---- */
typedef struct {
  const qt_dispatch* d;
  const uint8_t *a, *b;
  uint8_t* y;
  size_t rows, inner, b_rows_per;  /* a: rows x inner; b row = row / b_rows_per (0 = same shape) */
  float ratio;
  int32_t za, zb;
  qt_requant rq;
} mul_job;

static void mul_task(void* ctx, size_t begin, size_t end) {
  const mul_job* j = (const mul_job*)ctx;
  for (size_t r = begin; r < end; r++) {
    const uint8_t* b = j->b_rows_per ? j->b + (r / j->b_rows_per) * j->inner : j->b + r * j->inner;
    j->d->mul(j->inner, j->a + r * j->inner, b, j->y + r * j->inner, j->ratio, j->za, j->zb, &j->rq);
  }
}

void qt_mul(const uint8_t* a, const uint8_t* b, uint8_t* y, size_t rows, size_t inner,
            size_t b_rows_per, float ratio, int32_t za, int32_t zb, int32_t y_zp, int32_t lo,
            int32_t hi) {
  mul_job j = {qt_get_dispatch(), a, b, y, rows, inner, b_rows_per, ratio, za, zb, {0}};
  qt_fill_requant(&j.rq, y_zp, lo, hi, 0);
  j.rq.lo_f = (float)lo;  /* the mul kernel clamps after adding the output zero point */
  j.rq.hi_f = (float)hi;
  qt_parallel(rows, mul_task, &j, (double)(rows * inner) / 8.0);
}

/* ---- table lookup: one table, or one per channel (NHWC, channel minor) ---- */
typedef struct {
  const qt_dispatch* d;
  const uint8_t* x;
  const uint8_t* t;
  uint8_t* y;
  size_t n, c;  /* c = 0: one table */
} lut_job;

#define QT_LUT_CHUNK 65536

static void lut_task(void* ctx, size_t begin, size_t end) {
  const lut_job* j = (const lut_job*)ctx;
  if (j->c == 0) {
    size_t s = begin * QT_LUT_CHUNK, e = end * QT_LUT_CHUNK;
    if (e > j->n) e = j->n;
    if (s < e) j->d->lut(e - s, j->x + s, j->t, j->y + s);
    return;
  }
  for (size_t p = begin; p < end; p++) {  /* p = pixel */
    const uint8_t* x = j->x + p * j->c;
    uint8_t* y = j->y + p * j->c;
    for (size_t ch = 0; ch < j->c; ch++) y[ch] = j->t[ch * 256 + x[ch]];
  }
}

void qt_lut(const uint8_t* x, const uint8_t* table, uint8_t* y, size_t n, size_t c) {
  lut_job j = {qt_get_dispatch(), x, table, y, n, c};
  if (c == 0) qt_parallel((n + QT_LUT_CHUNK - 1) / QT_LUT_CHUNK, lut_task, &j, (double)n / 8.0);
  else qt_parallel(n / c, lut_task, &j, (double)n);
}
