/* Calibration statistics kernels: one pass over each observed tensor for its min, max and
 * per-channel sums (scan), and the bin update of its sampled blocks (accumulate).
 *
 * accumulate: counts[clamp(floor(x * 2^-e) - k0, 0, nbins-1)] += 1 for every finite x of every
 * step-th block of 16 values. The numpy reference is
 * qtool.calibrate.histogram.accumulate_reference. Scaling by a power of two is exact in
 * float32 (for the exponents a histogram uses), so floor() puts every value in exactly the
 * bin the reference does, on every ISA.
 *
 * scan: min and max of all values (exact: they are comparisons), whether any value is NaN,
 * and, when asked, the sum of each run of `inner` contiguous values added to its channel
 * (run index mod channels), which is an NCHW tensor's per-channel sum. Calibration reads tens
 * of megabytes of activations per image, so min, max and the channel sums share one read.
 *
 * ReLU outputs are often half exact zeros: incrementing one bin over and over is a serial
 * chain of store-to-load dependencies, so four sub-histograms take turns and are summed at
 * the end. Paths: AVX-512F, AVX2, portable C, chosen once from the CPU's features (capped by
 * QTOOL_ISA like the int8 kernels; set_isa() lets tests run each). The GIL is released
 * throughout. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "isa_choice.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef QT_X86
#include <immintrin.h>
#endif

#define NSUB 4
#define BLOCK 16


/* floor() of a float that fits int64, without a libm call (baseline x86-64 has no roundps) */
static inline int64_t floor_i64(float t) {
    int64_t k = (int64_t)t;
    return k - (t < (float)k);
}

/* ---- accumulate ------------------------------------------------------------------------- */

typedef struct {
    const float *x;
    Py_ssize_t total, offset, step;
    int64_t *sub, nb, k0;
    int exact_f32;
    float sf;
    double sd;
} acc_args;

static inline void bin_one(const acc_args *a, Py_ssize_t i) {
    float v = a->x[i];
    if (!(v - v == 0.0f)) return; /* NaN or inf */
    int64_t k = a->exact_f32 ? floor_i64(v * a->sf) : (int64_t)floor((double)v * a->sd);
    k -= a->k0;
    k = k < 0 ? 0 : (k >= a->nb ? a->nb - 1 : k);
    a->sub[(i & (NSUB - 1)) * (a->nb + BLOCK) + k]++;
}

static void accumulate_scalar(const acc_args *a) {
    Py_ssize_t nblocks = (a->total + BLOCK - 1) / BLOCK;
    for (Py_ssize_t blk = a->offset; blk < nblocks; blk += a->step) {
        Py_ssize_t i0 = blk * BLOCK, i1 = i0 + BLOCK < a->total ? i0 + BLOCK : a->total;
        for (Py_ssize_t i = i0; i < i1; i++) bin_one(a, i);
    }
}

#ifdef QT_X86
/* Sampled blocks are step * 64 bytes apart, too far for the hardware prefetchers: without asking
 * for them this many blocks ahead, every block is a full memory (or L3) latency. */
#define PREFETCH 8

/* The bin of 0.0 (clamped into the window): after a ReLU, often half of all values. */
static int32_t hot_bin_of(const acc_args *a) {
    int64_t k = -a->k0;
    return (int32_t)(k < 0 ? 0 : (k >= a->nb ? a->nb - 1 : k));
}

/* A sampled block is one 512-bit vector: bin indices for all 16 values at once, then 16
 * increments. Float arithmetic stays exact because the caller only takes this path when the
 * window's bin numbers are integers below 2^24 in magnitude. */
__attribute__((target("avx512f"))) static void accumulate_avx512(const acc_args *a) {
    Py_ssize_t nblocks = (a->total + BLOCK - 1) / BLOCK, full = a->total / BLOCK;
    const __m512 sf = _mm512_set1_ps(a->sf), k0 = _mm512_set1_ps((float)a->k0);
    const __m512 zero = _mm512_setzero_ps(), top = _mm512_set1_ps((float)(a->nb - 1));
    int32_t idx[BLOCK];
    const int32_t hot_bin = hot_bin_of(a);
    const __m512i hotv = _mm512_set1_epi32(hot_bin);
    const int64_t stride = a->nb + BLOCK;
    const __m512i junk = _mm512_add_epi32(_mm512_set1_epi32((int32_t)a->nb),
                                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    int64_t nhot = 0;
    for (Py_ssize_t blk = a->offset; blk < nblocks; blk += a->step) {
        if (blk >= full) { /* the partial last block */
            for (Py_ssize_t i = blk * BLOCK; i < a->total; i++) bin_one(a, i);
            continue;
        }
        if (blk + PREFETCH * a->step < full) _mm_prefetch((const char *)(a->x + (blk + PREFETCH * a->step) * BLOCK), _MM_HINT_T0);
        __m512 v = _mm512_loadu_ps(a->x + blk * BLOCK);
        __mmask16 finite = _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), zero, _CMP_EQ_OQ);
        __m512 t = _mm512_roundscale_ps(_mm512_mul_ps(v, sf), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        t = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(t, k0), zero), top);
        __m512i k = _mm512_cvttps_epi32(t);
        /* the hot bin is counted with a popcount; the rest one by one */
        __mmask16 hot = _mm512_mask_cmpeq_epi32_mask(finite, k, hotv);
        nhot += __builtin_popcount(hot);
        /* hot and non-finite lanes count into a junk slot of their own: no branch to mispredict */
        _mm512_storeu_si512(idx, _mm512_mask_blend_epi32(finite & ~hot, junk, k));
        for (int j = 0; j < BLOCK; j++) a->sub[(j & (NSUB - 1)) * stride + idx[j]]++;
    }
    a->sub[hot_bin] += nhot; /* sub-histogram 0 */
}

__attribute__((target("avx2"))) static void accumulate_avx2(const acc_args *a) {
    Py_ssize_t nblocks = (a->total + BLOCK - 1) / BLOCK, full = a->total / BLOCK;
    const __m256 sf = _mm256_set1_ps(a->sf), k0 = _mm256_set1_ps((float)a->k0);
    const __m256 zero = _mm256_setzero_ps(), top = _mm256_set1_ps((float)(a->nb - 1));
    int32_t idx[BLOCK];
    const int32_t hot_bin = hot_bin_of(a);
    const __m256i hotv = _mm256_set1_epi32(hot_bin);
    const int64_t stride = a->nb + BLOCK;
    const __m256i junk[2] = {_mm256_add_epi32(_mm256_set1_epi32((int32_t)a->nb), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                             _mm256_add_epi32(_mm256_set1_epi32((int32_t)a->nb), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15))};
    int64_t nhot = 0;
    for (Py_ssize_t blk = a->offset; blk < nblocks; blk += a->step) {
        if (blk >= full) {
            for (Py_ssize_t i = blk * BLOCK; i < a->total; i++) bin_one(a, i);
            continue;
        }
        if (blk + PREFETCH * a->step < full) _mm_prefetch((const char *)(a->x + (blk + PREFETCH * a->step) * BLOCK), _MM_HINT_T0);
        unsigned hot = 0;
        for (int h = 0; h < 2; h++) {
            __m256 v = _mm256_loadu_ps(a->x + blk * BLOCK + 8 * h);
            __m256 t = _mm256_floor_ps(_mm256_mul_ps(v, sf));
            t = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(t, k0), zero), top);
            __m256i k = _mm256_cvttps_epi32(t);
            __m256 isfin = _mm256_cmp_ps(_mm256_sub_ps(v, v), zero, _CMP_EQ_OQ);
            __m256i ishot = _mm256_and_si256(_mm256_cmpeq_epi32(k, hotv), _mm256_castps_si256(isfin));
            hot |= (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(ishot)) << (8 * h);
            /* hot and non-finite lanes count into a junk slot of their own: no branch to mispredict */
            __m256i keep = _mm256_andnot_si256(ishot, _mm256_castps_si256(isfin));
            _mm256_storeu_si256((__m256i *)(idx + 8 * h), _mm256_blendv_epi8(junk[h], k, keep));
        }
        nhot += __builtin_popcount(hot);
        for (int j = 0; j < BLOCK; j++) a->sub[(j & (NSUB - 1)) * stride + idx[j]]++;
    }
    a->sub[hot_bin] += nhot; /* sub-histogram 0 */
}
#endif

static int get_buffers(PyObject *args, Py_buffer *xb, Py_buffer *cb, int *e, long long *k0, Py_ssize_t *offset,
                       Py_ssize_t *step) {
    if (!PyArg_ParseTuple(args, "y*w*iL|nn", xb, cb, e, k0, offset, step)) return 0;
    if (xb->len % sizeof(float) || cb->len % sizeof(int64_t) || cb->len == 0) {
        PyBuffer_Release(xb);
        PyBuffer_Release(cb);
        PyErr_SetString(PyExc_ValueError, "accumulate: need float32 data and int64 counts");
        return 0;
    }
    return 1;
}

static PyObject *accumulate(PyObject *self, PyObject *args) {
    Py_buffer xb, cb;
    int e;
    long long k0;
    Py_ssize_t offset = 0, step = 1;
    if (!get_buffers(args, &xb, &cb, &e, &k0, &offset, &step)) return NULL;
    if (step < 1 || offset < 0) {
        PyBuffer_Release(&xb);
        PyBuffer_Release(&cb);
        PyErr_SetString(PyExc_ValueError, "accumulate: need offset >= 0 and step >= 1");
        return NULL;
    }
    acc_args a;
    a.x = (const float *)xb.buf;
    a.total = xb.len / (Py_ssize_t)sizeof(float);
    a.offset = offset;
    a.step = step;
    a.nb = cb.len / (Py_ssize_t)sizeof(int64_t);
    a.k0 = k0;
    /* 2^-e as float when representable, else fall back to double arithmetic */
    a.exact_f32 = (e > -120 && e < 120);
    a.sf = a.exact_f32 ? ldexpf(1.0f, -e) : 0.0f;
    a.sd = ldexp(1.0, -e);
    int64_t *counts = (int64_t *)cb.buf;
    a.sub = (int64_t *)calloc((size_t)(NSUB * (a.nb + BLOCK)), sizeof(int64_t)); /* + junk slots */
    if (!a.sub) {
        PyBuffer_Release(&xb);
        PyBuffer_Release(&cb);
        return PyErr_NoMemory();
    }
    /* vector bins are float integers: exact only while the window's bin numbers stay below 2^24 */
    int vec_ok = a.exact_f32 && k0 > -(1LL << 24) && k0 + a.nb < (1LL << 24);
    Py_BEGIN_ALLOW_THREADS
#ifdef QT_X86
    if (vec_ok && g_isa == ISA_AVX512)
        accumulate_avx512(&a);
    else if (vec_ok && g_isa == ISA_AVX2)
        accumulate_avx2(&a);
    else
#endif
        accumulate_scalar(&a);
    for (int j = 0; j < NSUB; j++)
        for (int64_t b = 0; b < a.nb; b++) counts[b] += a.sub[j * (a.nb + BLOCK) + b];
    Py_END_ALLOW_THREADS
    (void)vec_ok;
    free(a.sub);
    PyBuffer_Release(&xb);
    PyBuffer_Release(&cb);
    Py_RETURN_NONE;
}

/* ---- scan ------------------------------------------------------------------------------- */

typedef struct {
    float mn, mx;
    int nan;
} scan_out;

/* one run of n values: min, max, NaN seen, and (when want_sum) their sum */
static void run_scalar(const float *x, Py_ssize_t n, scan_out *o, int want_sum, double *sum) {
    float mn = o->mn, mx = o->mx;
    double s = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        float v = x[i];
        if (v != v) {
            o->nan = 1;
            continue;
        }
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
        if (want_sum) s += v;
    }
    o->mn = mn;
    o->mx = mx;
    if (want_sum) *sum += s;
}

#ifdef QT_X86
__attribute__((target("avx512f"))) static inline __m256 hi256(__m512 a) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
}

/* min/max ignore NaN lanes here (vminps keeps its second operand when either is NaN, and the
 * running value is that operand); NaN is tracked separately, so the caller can refuse the
 * tensor. Sums run in double lanes, like the numpy reference. */
__attribute__((target("avx512f"))) static void run_avx512(const float *x, Py_ssize_t n, scan_out *o, int want_sum,
                                                          double *sum) {
    __m512 mn0 = _mm512_set1_ps(o->mn), mx0 = _mm512_set1_ps(o->mx), mn1 = mn0, mx1 = mx0;
    __m512d s0 = _mm512_setzero_pd(), s1 = s0;
    __mmask16 nan = 0;
    Py_ssize_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
        nan |= _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
        mn0 = _mm512_min_ps(a, mn0);
        mx0 = _mm512_max_ps(a, mx0);
        mn1 = _mm512_min_ps(b, mn1);
        mx1 = _mm512_max_ps(b, mx1);
        if (want_sum) {
            s0 = _mm512_add_pd(s0, _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(a)),
                                                 _mm512_cvtps_pd(_mm512_castps512_ps256(b))));
            s1 = _mm512_add_pd(s1, _mm512_add_pd(_mm512_cvtps_pd(hi256(a)), _mm512_cvtps_pd(hi256(b))));
        }
    }
    for (; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        __m512 a = _mm512_maskz_loadu_ps(m, x + i);
        nan |= _mm512_mask_cmp_ps_mask(m, a, a, _CMP_UNORD_Q);
        mn0 = _mm512_mask_min_ps(mn0, m, a, mn0);
        mx0 = _mm512_mask_max_ps(mx0, m, a, mx0);
        if (want_sum) { /* masked-off lanes loaded as 0 */
            s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm512_castps512_ps256(a)));
            s1 = _mm512_add_pd(s1, _mm512_cvtps_pd(hi256(a)));
        }
    }
    o->mn = _mm512_reduce_min_ps(_mm512_min_ps(mn0, mn1));
    o->mx = _mm512_reduce_max_ps(_mm512_max_ps(mx0, mx1));
    o->nan |= nan != 0;
    if (want_sum) *sum += _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
}

__attribute__((target("avx2"))) static void run_avx2(const float *x, Py_ssize_t n, scan_out *o, int want_sum,
                                                    double *sum) {
    __m256 mn0 = _mm256_set1_ps(o->mn), mx0 = _mm256_set1_ps(o->mx), mn1 = mn0, mx1 = mx0;
    __m256d s0 = _mm256_setzero_pd(), s1 = s0;
    __m256 nan = _mm256_setzero_ps();
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
        mn0 = _mm256_min_ps(a, mn0);
        mx0 = _mm256_max_ps(a, mx0);
        mn1 = _mm256_min_ps(b, mn1);
        mx1 = _mm256_max_ps(b, mx1);
        if (want_sum) {
            s0 = _mm256_add_pd(s0, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(a)),
                                                 _mm256_cvtps_pd(_mm256_castps256_ps128(b))));
            s1 = _mm256_add_pd(s1, _mm256_add_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)),
                                                 _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1))));
        }
    }
    float lmn[8], lmx[8];
    double ls[4];
    _mm256_storeu_ps(lmn, _mm256_min_ps(mn0, mn1));
    _mm256_storeu_ps(lmx, _mm256_max_ps(mx0, mx1));
    _mm256_storeu_pd(ls, _mm256_add_pd(s0, s1));
    o->nan |= _mm256_movemask_ps(nan) != 0;
    double s = ls[0] + ls[1] + ls[2] + ls[3];
    for (int j = 0; j < 8; j++) {
        o->mn = lmn[j] < o->mn ? lmn[j] : o->mn;
        o->mx = lmx[j] > o->mx ? lmx[j] : o->mx;
    }
    if (want_sum) *sum += s;
    run_scalar(x + i, n - i, o, want_sum, sum);
}
#endif

static PyObject *scan(PyObject *self, PyObject *args) {
    Py_buffer xb, sb = {0};
    Py_ssize_t inner = 0;
    PyObject *sums = Py_None;
    if (!PyArg_ParseTuple(args, "y*|nO", &xb, &inner, &sums)) return NULL;
    Py_ssize_t total = xb.len / (Py_ssize_t)sizeof(float), channels = 0;
    if (xb.len % sizeof(float)) {
        PyBuffer_Release(&xb);
        PyErr_SetString(PyExc_ValueError, "scan: need float32 data");
        return NULL;
    }
    if (sums != Py_None) {
        if (PyObject_GetBuffer(sums, &sb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(&xb);
            return NULL;
        }
        channels = sb.len / (Py_ssize_t)sizeof(double);
        if (sb.len % sizeof(double) || channels == 0 || inner < 1 || total % (inner * channels)) {
            PyBuffer_Release(&xb);
            PyBuffer_Release(&sb);
            PyErr_SetString(PyExc_ValueError, "scan: sums need float64 [C] and data of n x C runs of `inner` values");
            return NULL;
        }
    }
    const float *x = (const float *)xb.buf;
    double *csum = channels ? (double *)sb.buf : NULL;
    scan_out o = {INFINITY, -INFINITY, 0};
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t run = channels ? inner : total, nruns = run ? total / run : 0;
    double dummy = 0.0;
    for (Py_ssize_t r = 0; r < nruns; r++) {
        double *s = channels ? &csum[r % channels] : &dummy;
#ifdef QT_X86
        if (g_isa == ISA_AVX512)
            run_avx512(x + r * run, run, &o, channels != 0, s);
        else if (g_isa == ISA_AVX2)
            run_avx2(x + r * run, run, &o, channels != 0, s);
        else
#endif
            run_scalar(x + r * run, run, &o, channels != 0, s);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&xb);
    if (channels) PyBuffer_Release(&sb);
    return Py_BuildValue("ddO", (double)o.mn, (double)o.mx, o.nan ? Py_True : Py_False);
}

/* ---- distinct values --------------------------------------------------------------------- */

/* distinct(x_f32, table_u32): adds the bit patterns of x's values to an open-addressing set (table: a
 * power-of-two number of slots, empty slots DISTINCT_EMPTY, a NaN's pattern: NaN ends the call first).
 * Returns the number of patterns in the set, or -1 as soon as a value is NaN or infinite, or -2 as soon
 * as the set would pass `limit` (the set is then incomplete). One hashed probe per value, the table in
 * L1: the calibration's main thread reads each batch of images once (numpy's sort of it cost 4-9 ms a
 * batch of four ImageNet images). qtool.lattice.DistinctValues is the reference. */
#define DISTINCT_EMPTY 0xFFFFFFFFu

static PyObject *distinct(PyObject *self, PyObject *args) {
    PyObject *ox, *ot;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "OOn", &ox, &ot, &limit)) return NULL;
    Py_buffer xb, tb;
    if (PyObject_GetBuffer(ox, &xb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    if (PyObject_GetBuffer(ot, &tb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&xb);
        return NULL;
    }
    const Py_ssize_t slots = tb.len / 4;
    if (xb.itemsize != 4 || strcmp(xb.format, "f") || tb.itemsize != 4 || strcmp(tb.format, "I") || slots < 2 ||
        (slots & (slots - 1)) || limit < 0 || limit >= slots / 2) {
        PyBuffer_Release(&xb);
        PyBuffer_Release(&tb);
        PyErr_SetString(PyExc_ValueError, "distinct: x float32, table uint32 of 2^k slots, 0 <= limit < slots / 2");
        return NULL;
    }
    const uint32_t *x = (const uint32_t *)xb.buf;
    uint32_t *table = (uint32_t *)tb.buf;
    const Py_ssize_t n = xb.len / 4;
    const uint32_t mask = (uint32_t)(slots - 1);
    int shift = 32;
    for (Py_ssize_t k = slots; k > 1; k >>= 1) shift--;
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < slots; i++) count += table[i] != DISTINCT_EMPTY;
    Py_ssize_t result;
    Py_BEGIN_ALLOW_THREADS
    uint32_t last = DISTINCT_EMPTY; /* images repeat values: a run of one value costs one comparison */
    result = count;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint32_t b = x[i];
        if (b == last) continue;
        if ((b & 0x7F800000u) == 0x7F800000u) { /* NaN or infinite */
            result = -1;
            break;
        }
        last = b;
        uint32_t h = (uint32_t)(b * 2654435761u) >> shift;
        while (table[h] != b && table[h] != DISTINCT_EMPTY) h = (h + 1) & mask;
        if (table[h] == b) continue;
        if (result == limit) {
            result = -2;
            break;
        }
        table[h] = b;
        result++;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&xb);
    PyBuffer_Release(&tb);
    return PyLong_FromSsize_t(result);
}

static PyMethodDef methods[] = {
    {"accumulate", accumulate, METH_VARARGS,
     "accumulate(x_f32, counts_i64, e, k0[, offset, step]): add every step-th block of 16 values, from block "
     "offset, to the histogram"},
    {"scan", scan, METH_VARARGS,
     "scan(x_f32[, inner, sums_f64]) -> (min, max, has_nan): min and max ignore NaN; with sums, the sum of each "
     "run of `inner` values is added to sums[run % len(sums)]"},
    {"distinct", distinct, METH_VARARGS,
     "distinct(x_f32, table_u32, limit) -> patterns in the set after adding x's, -1 at a NaN/inf, -2 past limit"},
    ISA_METHODS,
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_histogram", NULL, -1, methods};

PyMODINIT_FUNC PyInit__histogram(void) {
    isa_choose();
    return PyModule_Create(&module);
}
