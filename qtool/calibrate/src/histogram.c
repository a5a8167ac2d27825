/* One-pass histogram update for calibration: counts[floor(x * 2^-e) - k0] += 1.
 * The numpy reference is qtool.calibrate.histogram.accumulate_reference; both clip the
 * bin index into [0, nbins) (the caller sizes the window so nothing is clipped). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

static PyObject *accumulate(PyObject *self, PyObject *args) {
    Py_buffer xb, cb;
    int e;
    long long k0;
    if (!PyArg_ParseTuple(args, "y*w*iL", &xb, &cb, &e, &k0)) return NULL;
    if (xb.len % sizeof(float) || cb.len % sizeof(int64_t) || cb.len == 0) {
        PyBuffer_Release(&xb);
        PyBuffer_Release(&cb);
        PyErr_SetString(PyExc_ValueError, "accumulate: need float32 data and int64 counts");
        return NULL;
    }
    const float *x = (const float *)xb.buf;
    int64_t *counts = (int64_t *)cb.buf;
    Py_ssize_t n = xb.len / (Py_ssize_t)sizeof(float);
    int64_t nb = cb.len / (Py_ssize_t)sizeof(int64_t);
    double scale = ldexp(1.0, -e);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        double v = (double)x[i];
        if (!isfinite(v)) continue;
        int64_t k = (int64_t)floor(v * scale) - k0;
        k = k < 0 ? 0 : (k >= nb ? nb - 1 : k);
        counts[k]++;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&xb);
    PyBuffer_Release(&cb);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"accumulate", accumulate, METH_VARARGS, "accumulate(x_f32, counts_i64, e, k0): add x to the histogram"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_histogram", NULL, -1, methods};

PyMODINIT_FUNC PyInit__histogram(void) { return PyModule_Create(&module); }
