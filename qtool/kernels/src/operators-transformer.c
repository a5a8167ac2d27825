/* float32 transformer operators over rows (LayerNorm, Softmax, GELU / erf), the run-time uint8
 * quantize (DynamicQuantizeLinear) and the dynamic MatMul's epilogue, split over the pool by rows. */
#include <stdlib.h>

#include "operators.h"

typedef struct {
  const float* x;
  float* y;
  const float *g, *b;
  const float* x2;  /* layernorm: a second addend (the residual), NULL: none */
  float* s;         /* layernorm: where x + x2 is kept (NULL: only in y, then normalized in place) */
  size_t n;       /* row length (elementwise ops: a chunk's length) */
  size_t count;   /* elementwise ops: all elements */
  float eps, k_in, k_add, k_out;
  int div;
  const qt_dispatch* d;
  const float* mask;  /* softmax: added to row r: mask + (r / mask_every) * n (NULL: none) */
  size_t mask_every;
} f32_job;

static void layernorm_task(void* ctx, size_t begin, size_t end) {
  const f32_job* j = (const f32_job*)ctx;
  const size_t n = j->n;
  for (size_t r = begin; r < end; r++) {
    const float* x = j->x + r * n;
    float* y = j->y + r * n;
    if (j->x2) {  /* the residual sum first (float32, as the Add node), kept in s or in y */
      float* dst = j->s ? j->s + r * n : y;
      const float* x2 = j->x2 + r * n;
      for (size_t i = 0; i < n; i++) dst[i] = x[i] + x2[i];
      x = dst;
    }
    j->d->f32_layernorm(n, x, j->g, j->b, j->eps, y);
  }
}

static void softmax_task(void* ctx, size_t begin, size_t end) {
  const f32_job* j = (const f32_job*)ctx;
  /* the mask row and how far into its run of rows r is, kept as r goes (not a division per row) */
  size_t mrow = begin / j->mask_every, into = begin % j->mask_every;
  for (size_t r = begin; r < end; r++) {
    const float* x = j->x + r * j->n;
    float* y = j->y + r * j->n;
    if (j->div >= 0) {  /* scaled (and masked) scores first, then the softmax in place */
      j->d->f32_scale_add(j->n, x, j->k_in, j->div, j->mask ? j->mask + mrow * j->n : NULL, y);
      x = y;
    }
    j->d->f32_softmax(j->n, x, y);
    if (++into == j->mask_every) {
      into = 0;
      mrow++;
    }
  }
}

#define CHUNK 4096
static size_t chunk_len(const f32_job* j, size_t c) {
  const size_t start = c * CHUNK;
  return j->count - start < CHUNK ? j->count - start : CHUNK;
}

static void gelu_task(void* ctx, size_t begin, size_t end) {
  const f32_job* j = (const f32_job*)ctx;
  for (size_t c = begin; c < end; c++)
    j->d->f32_gelu(chunk_len(j, c), j->x + c * CHUNK, j->y + c * CHUNK, j->k_in, j->div, j->k_add, j->k_out);
}

static void erf_task(void* ctx, size_t begin, size_t end) {
  const f32_job* j = (const f32_job*)ctx;
  for (size_t c = begin; c < end; c++) j->d->f32_erf(chunk_len(j, c), j->x + c * CHUNK, j->y + c * CHUNK);
}

void qt_f32_layernorm(const float* x, const float* x2, float* s, const float* g, const float* b, float* y, size_t rows,
                      size_t n, float eps) {
  f32_job j = {x, y, g, b, x2, s, n, rows * n, eps, 0, 0, 0, 0, qt_get_dispatch(), NULL, 1};
  qt_parallel(rows, layernorm_task, &j, (double)(rows * n) * 1.0);
}

void qt_f32_softmax(const float* x, float* y, size_t rows, size_t n, float k, int div, const float* mask,
                    size_t mask_every) {
  f32_job j = {x, y, NULL, NULL, NULL, NULL, n, rows * n, 0, k, 0, 0, div, qt_get_dispatch(), mask, mask_every ? mask_every : 1};
  qt_parallel(rows, softmax_task, &j, (double)(rows * n) * 1.5);
}

void qt_f32_gelu(const float* x, float* y, size_t count, float k_in, int div, float k_add, float k_out) {
  f32_job j = {x, y, NULL, NULL, NULL, NULL, CHUNK, count, 0, k_in, k_add, k_out, div, qt_get_dispatch(), NULL, 1};
  qt_parallel((count + CHUNK - 1) / CHUNK, gelu_task, &j, (double)count * 1.5);
}

void qt_f32_erf(const float* x, float* y, size_t count) {
  f32_job j = {x, y, NULL, NULL, NULL, NULL, CHUNK, count, 0, 0, 0, 0, 0, qt_get_dispatch(), NULL, 1};
  qt_parallel((count + CHUNK - 1) / CHUNK, erf_task, &j, (double)count * 1.5);
}

/* ---- DynamicQuantizeLinear: the range, then ONNX Runtime's parameters (all float32):
 * lo = min(min(x), 0), hi = max(max(x), 0); scale = (hi - lo) / 255 (1 when hi == lo);
 * zp = rint(clamp(0 - lo / scale, 0, 255)); y = sat(rint(x / scale) + zp) (dynamic_quant.py). */
typedef struct {
  const float* x;
  uint8_t* y;
  size_t count;
  float mn[64], mx[64];
  float scale;
  int32_t zp;
  const qt_dispatch* d;
} dq_job;

static size_t dq_len(const dq_job* j, size_t c) {
  const size_t start = c * CHUNK;
  return j->count - start < CHUNK ? j->count - start : CHUNK;
}

/* a slot's range so far (a, b; `any` once it has one) taking in a chunk's minimum and maximum */
static inline void fold_range(float mn, float mx, float* a, float* b, int* any) {
  *a = !*any || mn < *a ? mn : *a;
  *b = !*any || mx > *b ? mx : *b;
  *any = 1;
}

static void range_task(void* ctx, size_t begin, size_t end) {
  dq_job* j = (dq_job*)ctx;
  /* chunks are grouped into at most 64 slots, each slot's chunks reduced in order */
  const size_t chunks = (j->count + CHUNK - 1) / CHUNK;
  for (size_t s = begin; s < end; s++) {
    const size_t c0 = s * chunks / 64, c1 = (s + 1) * chunks / 64;
    float a = 0.0f, b = 0.0f;
    int any = 0;
    for (size_t c = c0; c < c1; c++) {
      float mn, mx;
      j->d->f32_minmax(dq_len(j, c), j->x + c * CHUNK, &mn, &mx);
      fold_range(mn, mx, &a, &b, &any);
    }
    j->mn[s] = any ? a : 0.0f;
    j->mx[s] = any ? b : 0.0f;
  }
}

static void quant_task(void* ctx, size_t begin, size_t end) {
  const dq_job* j = (const dq_job*)ctx;
  for (size_t c = begin; c < end; c++)
    j->d->quant_row(dq_len(j, c), j->x + c * CHUNK, j->scale, j->zp, j->y + c * CHUNK);
}

/* ONNX Runtime's parameters from the 64 slots' minima and maxima (a slot with no values holds 0, 0). */
static void dq_params(const float* mn, const float* mx, float* scale_out, int32_t* zp_out) {
  float lo = 0.0f, hi = 0.0f;  /* the range always holds 0 */
  for (int s = 0; s < 64; s++) {
    lo = mn[s] < lo ? mn[s] : lo;
    hi = mx[s] > hi ? mx[s] : hi;
  }
  float scale = 1.0f;
  int32_t zp = 0;
  if (hi != lo) {
    scale = (hi - lo) / 255.0f;
    float z = 0.0f - lo / scale;
    z = z < 0.0f ? 0.0f : z;
    z = z > 255.0f ? 255.0f : z;
    zp = (int32_t)qt_rint_small(z);
  }
  *scale_out = scale;
  *zp_out = zp;
}

void qt_dynamic_quantize(const float* x, uint8_t* y, size_t count, float* scale_out, uint8_t* zp_out) {
  dq_job j;
  j.x = x;
  j.y = y;
  j.count = count;
  j.d = qt_get_dispatch();
  for (int s = 0; s < 64; s++) j.mn[s] = j.mx[s] = 0.0f;
  qt_parallel(64, range_task, &j, (double)count * 0.25);
  dq_params(j.mn, j.mx, &j.scale, &j.zp);
  qt_parallel((count + CHUNK - 1) / CHUNK, quant_task, &j, (double)count * 0.5);
  *scale_out = j.scale;
  *zp_out = (uint8_t)j.zp;
}

/* ---- the same of x * m, m a float32 row [n] over x [rows, n]'s last axis: what a Mul by a per-channel
 * constant before the DynamicQuantizeLinear gives (the float32 products, bit for bit), without writing
 * them: each row's products are made again for the range and for the quantize, SEG columns at a time. */
#define SEG 512
typedef struct {
  const float *x, *m;
  uint8_t* y;
  size_t rows, n;
  float mn[64], mx[64];
  float scale;
  int32_t zp;
  const qt_dispatch* d;
} dqs_job;

static void scaled_seg(const float* x, const float* m, size_t n, float* z) {
  for (size_t i = 0; i < n; i++) z[i] = x[i] * m[i];
}

static void range_scaled_task(void* ctx, size_t begin, size_t end) {
  dqs_job* j = (dqs_job*)ctx;
  float z[SEG];
  for (size_t s = begin; s < end; s++) {
    const size_t r0 = s * j->rows / 64, r1 = (s + 1) * j->rows / 64;
    float a = 0.0f, b = 0.0f;
    int any = 0;
    for (size_t r = r0; r < r1; r++)
      for (size_t c0 = 0; c0 < j->n; c0 += SEG) {
        const size_t len = j->n - c0 < SEG ? j->n - c0 : SEG;
        float mn, mx;
        scaled_seg(j->x + r * j->n + c0, j->m + c0, len, z);
        j->d->f32_minmax(len, z, &mn, &mx);
        fold_range(mn, mx, &a, &b, &any);
      }
    j->mn[s] = any ? a : 0.0f;
    j->mx[s] = any ? b : 0.0f;
  }
}

static void quant_scaled_task(void* ctx, size_t begin, size_t end) {
  const dqs_job* j = (const dqs_job*)ctx;
  float z[SEG];
  for (size_t r = begin; r < end; r++)
    for (size_t c0 = 0; c0 < j->n; c0 += SEG) {
      const size_t len = j->n - c0 < SEG ? j->n - c0 : SEG;
      scaled_seg(j->x + r * j->n + c0, j->m + c0, len, z);
      j->d->quant_row(len, z, j->scale, j->zp, j->y + r * j->n + c0);
    }
}

void qt_dynamic_quantize_scaled(const float* x, const float* m, size_t rows, size_t n, uint8_t* y,
                                float* scale_out, uint8_t* zp_out) {
  dqs_job j;
  j.x = x;
  j.m = m;
  j.y = y;
  j.rows = rows;
  j.n = n;
  j.d = qt_get_dispatch();
  for (int s = 0; s < 64; s++) j.mn[s] = j.mx[s] = 0.0f;
  qt_parallel(64, range_scaled_task, &j, (double)(rows * n) * 0.4);
  dq_params(j.mn, j.mx, &j.scale, &j.zp);
  qt_parallel(rows, quant_scaled_task, &j, (double)(rows * n) * 0.6);
  *scale_out = j.scale;
  *zp_out = (uint8_t)j.zp;
}

/* ---- the dynamic MatMul's epilogue over [rows, n] */
typedef struct {
  float* y;
  size_t n;
  const float *zpcs, *m, *bias;
  const qt_dispatch* d;
} epi_job;

static void epilogue_task(void* ctx, size_t begin, size_t end) {
  const epi_job* j = (const epi_job*)ctx;
  for (size_t r = begin; r < end; r++) j->d->f32_dyn_epilogue(j->n, j->y + r * j->n, j->zpcs, j->m, j->bias);
}

int qt_dynamic_epilogue(float* y, size_t rows, size_t n, float scale, int32_t zp, const float* colsum,
                        const float* w_scale, const float* bias) {
  float* t = (float*)malloc(2 * n * sizeof(float) + 1);
  if (!t) return -1;
  const float zpf = (float)zp;
  for (size_t c = 0; c < n; c++) {
    t[c] = zpf * colsum[c];
    t[n + c] = scale * w_scale[c];
  }
  epi_job j = {y, n, t, t + n, bias, qt_get_dispatch()};
  qt_parallel(rows, epilogue_task, &j, (double)(rows * n) * 0.3);
  free(t);
  return 0;
}

/* ---- float32 batched MatMul (attention): C[i] = A[i] @ B[i] over `batch` matrices, A and B read at
 * per-batch offsets with any row/column strides (floats), C contiguous. Tasks: one matrix (a head), or
 * a block of its rows when there are fewer matrices than threads x 4; a B whose rows are not contiguous
 * is packed once per task into [K][N]. */
typedef struct {
  const float *a, *b;
  float* c;
  const ptrdiff_t *a_off, *b_off;
  size_t m, n, k, mtasks;
  ptrdiff_t a_rs, a_cs, b_rs, b_cs;
  const qt_dispatch* d;
  int failed;
} mm_job;

static void matmul_task(void* ctx, size_t begin, size_t end) {
  mm_job* j = (mm_job*)ctx;
  const size_t n = j->n, k = j->k;
  float* pack = j->b_cs != 1 ? (float*)malloc(k * n * sizeof(float) + 64) : NULL;
  if (j->b_cs != 1 && !pack) {
    j->failed = 1;
    return;
  }
  const size_t rows = ((j->m + j->mtasks - 1) / j->mtasks + 7) / 8 * 8;
  for (size_t t = begin; t < end; t++) {
    const size_t bi = t / j->mtasks, r0 = (t % j->mtasks) * rows;
    const size_t r1 = r0 + rows < j->m ? r0 + rows : j->m;
    const float* bp = j->b + j->b_off[bi];
    size_t ldb = (size_t)j->b_rs;
    if (pack) {  /* column by column: a transposed B's columns are its contiguous rows */
      for (size_t c = 0; c < n; c++)
        for (size_t kk = 0; kk < k; kk++) pack[kk * n + c] = bp[(ptrdiff_t)kk * j->b_rs + (ptrdiff_t)c * j->b_cs];
      bp = pack;
      ldb = n;
    }
    const float* a = j->a + j->a_off[bi];
    float* cbase = j->c + bi * j->m * n;
    for (size_t r = r0; r < r1; r += 8)
      j->d->f32_gemm(r1 - r < 8 ? r1 - r : 8, n, k, a + (ptrdiff_t)r * j->a_rs, j->a_rs, j->a_cs, bp, ldb,
                     cbase + r * n, n);
  }
  free(pack);
}

int qt_f32_matmul(const float* a, const float* b, float* c, size_t batch, const ptrdiff_t* a_off,
                  const ptrdiff_t* b_off, size_t m, size_t n, size_t k, ptrdiff_t a_rs, ptrdiff_t a_cs,
                  ptrdiff_t b_rs, ptrdiff_t b_cs) {
  /* row blocks of a multiple of 8 rows only when the matrices alone are too few to share */
  const size_t want = (size_t)qt_get_num_threads() * 4, blocks8 = (m + 7) / 8;
  size_t split = batch >= want ? 1 : (want + batch - 1) / batch;
  split = split < blocks8 ? split : blocks8;
  mm_job j = {a, b, c, a_off, b_off, m, n, k, split, a_rs, a_cs, b_rs, b_cs, qt_get_dispatch(), 0};
  if (m == 0 || n == 0 || batch == 0) return 0;
  if (k == 0) {
    memset(c, 0, batch * m * n * sizeof(float));
    return 0;
  }
  qt_parallel(batch * j.mtasks, matmul_task, &j, (double)(batch * m * n * k) / 16.0);
  return j.failed ? -1 : 0;
}
