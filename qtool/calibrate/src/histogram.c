/* Calibration histogram kernel: the one-pass bin update (numpy's SIMD min/max do the rest).
 *
 * accumulate: counts[clamp(floor(x * 2^-e) - k0, 0, nbins-1)] += 1 for every finite x.
 * The numpy reference is qtool.calibrate.histogram.accumulate_reference. Scaling by a
 * power of two is exact in float32 (for the exponents a histogram uses), so floor()
 * puts every value in exactly the bin the reference does.
 *
 * ReLU outputs are often half exact zeros: incrementing one bin over and over is a
 * serial chain of store-to-load dependencies, so four sub-histograms take turns and
 * are summed at the end. The GIL is released throughout. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NSUB 4
#define BLOCK 16

/* floor() of a float that fits int64, without a libm call (baseline x86-64 has no roundps) */
static inline int64_t floor_i64(float t) {
    int64_t k = (int64_t)t;
    return k - (t < (float)k);
}

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
    Py_ssize_t total = xb.len / (Py_ssize_t)sizeof(float);
    /* every step-th block of BLOCK values from block `offset`: a systematic sample, read in
     * place, one cache line per block (single values at a stride would each cost a line) */
    const float *x = (const float *)xb.buf;
    int64_t *counts = (int64_t *)cb.buf;
    Py_ssize_t nblocks = (total + BLOCK - 1) / BLOCK;
    int64_t nb = cb.len / (Py_ssize_t)sizeof(int64_t);
    int64_t *sub = (int64_t *)calloc((size_t)(NSUB * nb), sizeof(int64_t));
    if (!sub) {
        PyBuffer_Release(&xb);
        PyBuffer_Release(&cb);
        return PyErr_NoMemory();
    }
    /* 2^-e as float when representable, else fall back to double arithmetic */
    int exact_f32 = (e > -120 && e < 120);
    float sf = exact_f32 ? ldexpf(1.0f, -e) : 0.0f;
    double sd = ldexp(1.0, -e);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t blk = offset; blk < nblocks; blk += step) {
        Py_ssize_t i0 = blk * BLOCK, i1 = i0 + BLOCK < total ? i0 + BLOCK : total;
        for (Py_ssize_t i = i0; i < i1; i++) {
            float v = x[i];
            if (!(v - v == 0.0f)) continue; /* NaN or inf */
            int64_t k = exact_f32 ? floor_i64(v * sf) : (int64_t)floor((double)v * sd);
            k -= k0;
            k = k < 0 ? 0 : (k >= nb ? nb - 1 : k);
            sub[(i & (NSUB - 1)) * nb + k]++;
        }
    }
    for (int j = 0; j < NSUB; j++)
        for (int64_t b = 0; b < nb; b++) counts[b] += sub[j * nb + b];
    Py_END_ALLOW_THREADS
    free(sub);
    PyBuffer_Release(&xb);
    PyBuffer_Release(&cb);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"accumulate", accumulate, METH_VARARGS,
     "accumulate(x_f32, counts_i64, e, k0[, offset, step]): add every step-th block of 16 values, from block "
     "offset, to the histogram"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_histogram", NULL, -1, methods};

PyMODINIT_FUNC PyInit__histogram(void) { return PyModule_Create(&module); }
