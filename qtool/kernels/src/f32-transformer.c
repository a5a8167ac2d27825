/* float32 row kernels of transformer graphs (LayerNorm, Softmax, erf GELU, the run-time quantize's
 * range, the dynamic GEMM's epilogue). One C body per kernel, compiled for each ISA by inlining it
 * into a function with that ISA's target attribute, as qu8-elementwise.c does. Float math is plain
 * mul/add/div without contraction (-ffp-contract=off); reductions run in 16 fixed lanes combined in
 * a fixed order, so every ISA gives the same bits. Numpy twins: qtool/kernels/reference.py. */
#include "qtool_kernels.h"

#define LANES 16

/* 16 float lanes as a GCC vector (lowered to what the target has: the same lanes, the same bits) */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

QT_INLINE v16f load16(const float* p) {
  v16f v;
  memcpy(&v, p, sizeof v);
  return v;
}

/* erf(x) = x P(x^2) / Q(x^2) on [-4, 4], the coefficients and the operation order of
 * qtool.runtime.fp32_ops_transformer.erf32 (bit for bit with it). */
QT_INLINE float erf_body(float x) {
  x = x > -4.0f ? x : -4.0f;
  x = x < 4.0f ? x : 4.0f;
  const float x2 = x * x;
  float p = (float)-2.72614225801306e-10;
  p = p * x2 + (float)2.77068142495902e-08;
  p = p * x2 + (float)-2.10102402082508e-06;
  p = p * x2 + (float)-5.69250639462346e-05;
  p = p * x2 + (float)-7.34990630326855e-04;
  p = p * x2 + (float)-2.95459980854025e-03;
  p = p * x2 + (float)-1.60960333262415e-02;
  p = p * x;
  float q = (float)-1.45660718464996e-05;
  q = q * x2 + (float)-2.13374055278905e-04;
  q = q * x2 + (float)-1.68282697438203e-03;
  q = q * x2 + (float)-7.37332916720468e-03;
  q = q * x2 + (float)-1.42647390514189e-02;
  return p / q;
}

QT_INLINE v16f vmin16(v16f a, v16f b) {
  const v16i m = a < b;
  return (v16f)((m & (v16i)a) | (~m & (v16i)b));
}

QT_INLINE v16f vmax16(v16f a, v16f b) {
  const v16i m = a > b;
  return (v16f)((m & (v16i)a) | (~m & (v16i)b));
}

/* exp(x) on 16 lanes for the softmax (x <= 0 once the row maximum is taken off, or NaN): Cephes' expf, 2^n
 * by the exponent bits; within 2 ulp of expf; 0 below -87.3 (where expf is subnormal or 0) and for NaN. No
 * upper clamp (x <= 0), the lower bound a constant: a sixth less time, the same bits for every such x
 * (4M inputs, every negative pattern, -inf and NaN included). */
QT_INLINE v16f exp16(v16f x0) {
  const v16f lo = (v16f){0} - 87.3f;
  v16f x = vmax16(x0, lo);
  v16f n = x * 1.44269504088896341f;
  n = (n + 12582912.0f) - 12582912.0f;
  v16f r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r;
  p = p + 1.0f;
  const v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
  const v16f y = p * (v16f)bits;
  const v16i keep = x0 > lo;
  return (v16f)(keep & (v16i)y);
}

/* lanes folded in halves (8 + 8, 4 + 4, 2 + 2, 1 + 1): 4 dependent steps, not 15 */
QT_INLINE float hsum16(v16f v) {
  float t[8];
  for (size_t j = 0; j < 8; j++) t[j] = v[j] + v[j + 8];
  for (size_t j = 0; j < 4; j++) t[j] = t[j] + t[j + 4];
  for (size_t j = 0; j < 2; j++) t[j] = t[j] + t[j + 2];
  return t[0] + t[1];
}

QT_INLINE float hmax16(v16f v) {
  float t[8];
  for (size_t j = 0; j < 8; j++) t[j] = v[j] > v[j + 8] ? v[j] : v[j + 8];
  for (size_t j = 0; j < 4; j++) t[j] = t[j] > t[j + 4] ? t[j] : t[j + 4];
  for (size_t j = 0; j < 2; j++) t[j] = t[j] > t[j + 2] ? t[j] : t[j + 2];
  return t[0] > t[1] ? t[0] : t[1];
}

QT_INLINE float hmin16(v16f v) {
  float t[8];
  for (size_t j = 0; j < 8; j++) t[j] = v[j] < v[j + 8] ? v[j] : v[j + 8];
  for (size_t j = 0; j < 4; j++) t[j] = t[j] < t[j + 4] ? t[j] : t[j + 4];
  for (size_t j = 0; j < 2; j++) t[j] = t[j] < t[j + 2] ? t[j] : t[j + 2];
  return t[0] < t[1] ? t[0] : t[1];
}

/* the maximum of n floats (n >= 1) */
QT_INLINE float lane_max(size_t n, const float* x) {
  float b = x[0];
  size_t i = 0;
  if (n >= LANES) {
    v16f mx = load16(x);
    for (i = LANES; i + LANES <= n; i += LANES) mx = vmax16(load16(x + i), mx);
    b = hmax16(mx);
  }
  for (; i < n; i++) b = x[i] > b ? x[i] : b;
  return b;
}

/* the sum of n floats in LANES fixed lanes (the tail into lanes 0, 1, ...), the lanes added in order */
QT_INLINE float lane_sum(size_t n, const float* x) {
  v16f acc = {0};
  size_t i = 0;
  for (; i + LANES <= n; i += LANES) acc += load16(x + i);
  for (size_t j = 0; i < n; i++, j++) acc[j] += x[i];
  return hsum16(acc);
}

QT_INLINE void lane_minmax(size_t n, const float* x, float* mn_out, float* mx_out) {
  const float x0 = n ? x[0] : 0.0f;
  v16f mn = {x0, x0, x0, x0, x0, x0, x0, x0, x0, x0, x0, x0, x0, x0, x0, x0};
  v16f mx = mn;
  size_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    const v16f v = load16(x + i);
    mn = vmin16(v, mn);
    mx = vmax16(v, mx);
  }
  float a = hmin16(mn), b = hmax16(mx);
  for (; i < n; i++) {
    a = x[i] < a ? x[i] : a;
    b = x[i] > b ? x[i] : b;
  }
  *mn_out = a;
  *mx_out = b;
}

/* One row of LayerNormalization: mean, then the mean of the squared deviations (two passes),
 * y = (x - mean) / sqrt(var + eps) * gamma + beta (gamma/beta NULL: 1/0). */
QT_INLINE void layernorm_body(size_t n, const float* x, const float* g, const float* b, float eps,
                              float* y) {
  const float mean = lane_sum(n, x) / (float)n;
  v16f acc = {0};
  size_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    const v16f d = load16(x + i) - mean;
    acc += d * d;
  }
  for (size_t j = 0; i < n; i++, j++) {
    const float d = x[i] - mean;
    acc[j] += d * d;
  }
  const float ss = hsum16(acc);
  const float sd = __builtin_sqrtf(ss / (float)n + eps);
  for (i = 0; i < n; i++) {
    float v = (x[i] - mean) / sd;
    if (g) v = v * g[i];
    if (b) v = v + b[i];
    y[i] = v;
  }
}

/* One row of Softmax: e = exp(x - max), y = e * (1 / sum(e)); the sum kept in LANES fixed lanes as the
 * exponentials are made (the tail's into lanes 0, 1, ..., the others adding 0), the lanes added in order. */
QT_INLINE void softmax_body(size_t n, const float* x, float* y) {
  const float mx = lane_max(n, x);
  v16f acc = {0};
  size_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    const v16f e = exp16(load16(x + i) - mx);
    acc += e;
    memcpy(y + i, &e, sizeof e);
  }
  if (i < n) {  /* the tail through the same 16 lanes (padding lanes computed and dropped) */
    float t[LANES] = {0};
    for (size_t j = 0; i + j < n; j++) t[j] = x[i + j] - mx;
    v16f e = exp16(load16(t));
    for (size_t j = n - i; j < LANES; j++) e[j] = 0.0f;
    acc += e;
    memcpy(y + i, &e, (n - i) * sizeof(float));
  }
  const float inv = 1.0f / hsum16(acc);
  for (i = 0; i < n; i++) y[i] = y[i] * inv;
}

/* The scores before a Softmax: y = (x / k or x * k) + m (m NULL: no mask), the nodes' order; x / k taken
 * as x * (1 / k), one rounding more (a relative 1e-7 in the scores, within the Softmax's float32 error), as
 * a division per score took a quarter of the whole (the zoo MiniLM at 128 tokens). */
QT_INLINE void scale_add_body(size_t n, const float* x, float k, int div, const float* m, float* y) {
  if (div) k = 1.0f / k;
  if (m) {
    for (size_t i = 0; i < n; i++) y[i] = x[i] * k + m[i];
  } else {
    for (size_t i = 0; i < n; i++) y[i] = x[i] * k;
  }
}

/* GELU as exporters write it: y = (x * (erf(x op k_in) + k_add)) * k_out, op = / (div) or *;
 * the same float32 operations in the same order as the ONNX nodes (bit for bit with numpy's). */
QT_INLINE void gelu_body(size_t n, const float* x, float* y, float k_in, int div, float k_add,
                         float k_out) {
  if (div) {
    for (size_t i = 0; i < n; i++) y[i] = (x[i] * (erf_body(x[i] / k_in) + k_add)) * k_out;
  } else {
    for (size_t i = 0; i < n; i++) y[i] = (x[i] * (erf_body(x[i] * k_in) + k_add)) * k_out;
  }
}

QT_INLINE void erf_row_body(size_t n, const float* x, float* y) {
  for (size_t i = 0; i < n; i++) y[i] = erf_body(x[i]);
}

/* The dynamic MatMul's epilogue on one row of float32(sum(x_u8 * w)):
 * y = (y - zpcs[j]) * m[j] (+ bias[j]); exact to ONNX Runtime's float32(acc) * m (dynamic_quant.py). */
QT_INLINE void dyn_epilogue_body(size_t n, float* y, const float* zpcs, const float* m,
                                 const float* bias) {
  if (bias) {
    for (size_t j = 0; j < n; j++) y[j] = (y[j] - zpcs[j]) * m[j] + bias[j];
  } else {
    for (size_t j = 0; j < n; j++) y[j] = (y[j] - zpcs[j]) * m[j];
  }
}

#define QT_DEFINE_F32(SUFFIX, ATTR)                                                              \
  ATTR void f32_layernorm_ukernel__##SUFFIX(size_t n, const float* x, const float* g,            \
                                            const float* b, float eps, float* y) {               \
    layernorm_body(n, x, g, b, eps, y);                                                          \
  }                                                                                              \
  ATTR void f32_softmax_ukernel__##SUFFIX(size_t n, const float* x, float* y) {                  \
    softmax_body(n, x, y);                                                                       \
  }                                                                                              \
  ATTR void f32_vscaleadd_ukernel__##SUFFIX(size_t n, const float* x, float k, int div,           \
                                            const float* m, float* y) {                          \
    scale_add_body(n, x, k, div, m, y);                                                          \
  }                                                                                              \
  ATTR void f32_gelu_erf_ukernel__##SUFFIX(size_t n, const float* x, float* y, float k_in,       \
                                           int div, float k_add, float k_out) {                  \
    gelu_body(n, x, y, k_in, div, k_add, k_out);                                                 \
  }                                                                                              \
  ATTR void f32_verf_ukernel__##SUFFIX(size_t n, const float* x, float* y) {                     \
    erf_row_body(n, x, y);                                                                       \
  }                                                                                              \
  ATTR void f32_rminmax_ukernel__##SUFFIX(size_t n, const float* x, float* mn, float* mx) {      \
    lane_minmax(n, x, mn, mx);                                                                   \
  }                                                                                              \
  ATTR void f32_dyn_epilogue_ukernel__##SUFFIX(size_t n, float* y, const float* zpcs,            \
                                               const float* m, const float* bias) {              \
    dyn_epilogue_body(n, y, zpcs, m, bias);                                                      \
  }

QT_DEFINE_F32(scalar, )
#if QT_X86
QT_DEFINE_F32(avx2, QT_TARGET_AVX2)
QT_DEFINE_F32(avx512vnni, QT_TARGET_AVX512VNNI)
#endif

void qt_fill_sgemm(qt_dispatch* d, int isa);  /* below, with the GEMM */

void qt_fill_transformer(qt_dispatch* d, int isa) {
  qt_fill_sgemm(d, isa);
#define QT_FILL(SUFFIX)                                     \
  d->f32_layernorm = f32_layernorm_ukernel__##SUFFIX;       \
  d->f32_softmax = f32_softmax_ukernel__##SUFFIX;           \
  d->f32_gelu = f32_gelu_erf_ukernel__##SUFFIX;             \
  d->f32_scale_add = f32_vscaleadd_ukernel__##SUFFIX;       \
  d->f32_erf = f32_verf_ukernel__##SUFFIX;                  \
  d->f32_minmax = f32_rminmax_ukernel__##SUFFIX;            \
  d->f32_dyn_epilogue = f32_dyn_epilogue_ukernel__##SUFFIX;
#if QT_X86
  if (isa == QT_ISA_AVX512VNNI) { QT_FILL(avx512vnni) return; }
  if (isa == QT_ISA_AVX2) { QT_FILL(avx2) return; }
#endif
  (void)isa;
  QT_FILL(scalar)
#undef QT_FILL
}

/* ---- float32 GEMM of attention (scores = Q K^T, context = P V): C[MR x 32] += A[MR x K] B[K x 32],
 * B rows contiguous (ldb floats apart), A read with any strides; FMA where the ISA has it (sums in k
 * order per element; not bit for bit with a BLAS: within float32 rounding of the exact products). */
#define GEMM_MR 8
#define GEMM_NR 32

#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
QT_INLINE void sgemm_tile_body(size_t mr, size_t kc, const float* a, ptrdiff_t a_rs, ptrdiff_t a_cs,
                               const float* b, size_t ldb, float* c, size_t ldc) {
  v16f acc[GEMM_MR][2];
  for (size_t r = 0; r < GEMM_MR; r++) acc[r][0] = acc[r][1] = (v16f){0};
  if (mr == GEMM_MR) {  /* (no per-row test: the broadcasts fold into the multiply-adds) */
    for (size_t k = 0; k < kc; k++) {
      const v16f b0 = load16(b + k * ldb), b1 = load16(b + k * ldb + 16);
      for (size_t r = 0; r < GEMM_MR; r++) {
        const float av = a[(ptrdiff_t)r * a_rs + (ptrdiff_t)k * a_cs];
        acc[r][0] += av * b0;
        acc[r][1] += av * b1;
      }
    }
  } else {
    for (size_t k = 0; k < kc; k++) {
      const v16f b0 = load16(b + k * ldb), b1 = load16(b + k * ldb + 16);
      for (size_t r = 0; r < mr; r++) {
        const float av = a[(ptrdiff_t)r * a_rs + (ptrdiff_t)k * a_cs];
        acc[r][0] += av * b0;
        acc[r][1] += av * b1;
      }
    }
  }
  for (size_t r = 0; r < mr; r++) {
    memcpy(c + r * ldc, &acc[r][0], sizeof(v16f));
    memcpy(c + r * ldc + 16, &acc[r][1], sizeof(v16f));
  }
}

/* the columns past the last full tile: plain sums in k order */
QT_INLINE void sgemm_edge_body(size_t mr, size_t nc, size_t kc, const float* a, ptrdiff_t a_rs, ptrdiff_t a_cs,
                               const float* b, size_t ldb, float* c, size_t ldc) {
  for (size_t r = 0; r < mr; r++)
    for (size_t j = 0; j < nc; j++) {
      float s = 0.0f;
      for (size_t k = 0; k < kc; k++) s += a[(ptrdiff_t)r * a_rs + (ptrdiff_t)k * a_cs] * b[k * ldb + j];
      c[r * ldc + j] = s;
    }
}

#define QT_DEFINE_SGEMM(SUFFIX, ATTR)                                                            \
  ATTR void f32_gemm_ukernel_8x32__##SUFFIX(size_t mr, size_t nc, size_t kc, const float* a,      \
                                            ptrdiff_t a_rs, ptrdiff_t a_cs, const float* b,       \
                                            size_t ldb, float* c, size_t ldc) {                   \
    size_t j = 0;                                                                                \
    for (; j + GEMM_NR <= nc; j += GEMM_NR) sgemm_tile_body(mr, kc, a, a_rs, a_cs, b + j, ldb, c + j, ldc); \
    if (j < nc) sgemm_edge_body(mr, nc - j, kc, a, a_rs, a_cs, b + j, ldb, c + j, ldc);         \
  }
QT_DEFINE_SGEMM(scalar, )
#if QT_X86
QT_DEFINE_SGEMM(avx2, QT_TARGET_AVX2)
QT_DEFINE_SGEMM(avx512vnni, QT_TARGET_AVX512VNNI)
#endif
#pragma GCC pop_options

void qt_fill_sgemm(qt_dispatch* d, int isa) {
#if QT_X86
  if (isa == QT_ISA_AVX512VNNI) { d->f32_gemm = f32_gemm_ukernel_8x32__avx512vnni; return; }
  if (isa == QT_ISA_AVX2) { d->f32_gemm = f32_gemm_ukernel_8x32__avx2; return; }
#endif
  (void)isa;
  d->f32_gemm = f32_gemm_ukernel_8x32__scalar;
}
