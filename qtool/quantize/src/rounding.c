/* Output-aware weight rounding: the coordinate descent of qtool/quantize/rounding.py, in C.
 *
 * Each output channel rounds its K weights down or up to lower dw^T H dw (H: the covariance of
 * the input patch it reads). The descent visits one weight after another and keeps the gradient
 * H dw current after every move, so it is a serial chain per channel: numpy runs it as K steps of
 * a dozen small array operations over all channels (0.4 s for one 1x1 convolution of EfficientNet-
 * Lite0, 20 s for its 48 pair-safe layers), C as one loop per channel.
 *
 * Bit for bit the numpy reference (rounding._descend_reference, rounding._descend_pair_safe_reference):
 * the same float64 operations in the same order, no FMA contraction (-ffp-contract=off). A channel
 * that changes nothing in a sweep stops: its state is unchanged, so every later sweep of the
 * reference (which stops when no channel changed) leaves it unchanged too. Channels run on
 * `threads` threads; the GIL is released throughout. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>

#define W_MAX 127.0
#define PAIR_LIMIT 128.0
#define TAKE (-1e-18)

/* arithmetic.can_saturate: the same sign and |a + b| past the int16-safe pair limit */
static inline int can_saturate(double a, double b) { return a * b > 0 && fabs(a + b) > PAIR_LIMIT; }

static inline void move(double *grad, const double *hrow, double step, Py_ssize_t k) {
    for (Py_ssize_t l = 0; l < k; l++) grad[l] += step * hrow[l];
}

/* weight j moves by d steps of size s, and the gradient with it */
static inline void step(double *q, double *grad, const double *H, Py_ssize_t j, double d, double s, Py_ssize_t k) {
    q[j] += d;
    move(grad, H + j * k, d * s, k);
}

/* the better of the two directions tried so far: the reference's strict "<" keeps the first of a tie */
static inline void keep_better(double gain, double d, double *best_gain, double *best_d) {
    if (gain < *best_gain) {
        *best_gain = gain;
        *best_d = d;
    }
}

typedef struct {
    double *q, *grad;
    const double *lo, *hi, *v, *s, *h;
    const int64_t *partners;
    Py_ssize_t g, c, k;
    int sweeps, pair_safe;
    Py_ssize_t first, last; /* channels [first, last) of all g * c */
} job;

static void plain_channel(const job *J, Py_ssize_t r) {
    const Py_ssize_t k = J->k;
    const double *H = J->h + (r / J->c) * k * k;
    double *q = J->q + r * k, *grad = J->grad + r * k;
    const double *lo = J->lo + r * k, *hi = J->hi + r * k;
    const double s = J->s[r];
    for (int sweep = 0; sweep < J->sweeps; sweep++) {
        int changed = 0;
        for (Py_ssize_t j = 0; j < k; j++) {
            double alt = lo[j] + hi[j] - q[j];
            double d = (alt - q[j]) * s;
            double gain = 2 * d * grad[j] + d * d * H[j * k + j];
            if (gain < TAKE && d != 0) {
                q[j] = alt;
                move(grad, H + j * k, d, k);
                changed = 1;
            }
        }
        if (!changed) break;
    }
}

static void pair_safe_channel(const job *J, Py_ssize_t r) {
    const Py_ssize_t k = J->k;
    const double *H = J->h + (r / J->c) * k * k;
    double *q = J->q + r * k, *grad = J->grad + r * k;
    const double *v = J->v + r * k;
    const int64_t *partners = J->partners;
    const double s = J->s[r];
    for (int sweep = 0; sweep < J->sweeps; sweep++) {
        int changed = 0;
        for (Py_ssize_t j = 0; j < k; j++) { /* one weight by one step */
            const int64_t p = partners[j];
            double best_gain = 0.0, best_d = 0.0;
            for (int t = 0; t < 2; t++) {
                const double d = t ? 1.0 : -1.0;
                const double alt = q[j] + d;
                int ok = fabs(alt) <= W_MAX && (fabs(alt - v[j]) < 1 || fabs(alt - v[j]) < fabs(q[j] - v[j]));
                if (p >= 0) ok = ok && !can_saturate(alt, q[p]);
                const double dd = d * s;
                keep_better(ok ? 2 * dd * grad[j] + dd * dd * H[j * k + j] : 0.0, d, &best_gain, &best_d);
            }
            if (best_gain < TAKE) {
                step(q, grad, H, j, best_d, s, k);
                changed = 1;
            }
        }
        for (Py_ssize_t a = 0; a < k; a++) { /* one step from one weight of a pair to the other */
            const int64_t b = partners[a];
            if (b <= a) continue;
            const double qa = q[a], qb = q[b];
            double best_gain = 0.0, best_d = 0.0;
            for (int t = 0; t < 2; t++) {
                const double d = t ? 1.0 : -1.0;
                const double na = qa + d, nb = qb - d;
                const int ok = fabs(na) <= W_MAX && fabs(nb) <= W_MAX && !can_saturate(na, nb) && qa * qb > 0;
                const double da = d * s, db = -d * s;
                const double gain = 2 * da * grad[a] + 2 * db * grad[b] + da * da * H[a * k + a] + db * db * H[b * k + b] +
                                    2 * da * db * H[a * k + b];
                keep_better(ok ? gain : 0.0, d, &best_gain, &best_d);
            }
            if (best_gain < TAKE) {
                step(q, grad, H, a, best_d, s, k);
                step(q, grad, H, b, -best_d, s, k);
                changed = 1;
            }
        }
        if (!changed) break;
    }
}

static void *run_job(void *arg) {
    const job *J = (const job *)arg;
    for (Py_ssize_t r = J->first; r < J->last; r++) (J->pair_safe ? pair_safe_channel : plain_channel)(J, r);
    return NULL;
}

static int get(PyObject *o, Py_buffer *b, int writable, Py_ssize_t n, const char *what, Py_ssize_t item) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (b->len != n * item) {
        PyErr_Format(PyExc_ValueError, "descend: %s has %zd bytes, expected %zd", what, b->len, n * item);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

#define MAX_THREADS 16

/* descend(q, grad, lo, hi, v, s, hessian, partners, g, c, k, sweeps, threads): q, grad [G*C*K] float64
 * (updated in place), lo, hi (plain) or v (pair-safe; the others None) [G*C*K], s [G*C], hessian
 * [G*K*K], partners int64 [K] or None (plain). */
static PyObject *descend(PyObject *self, PyObject *args) {
    PyObject *oq, *ograd, *olo, *ohi, *ov, *os, *oh, *op;
    Py_ssize_t g, c, k;
    int sweeps, threads;
    if (!PyArg_ParseTuple(args, "OOOOOOOOnnnii", &oq, &ograd, &olo, &ohi, &ov, &os, &oh, &op, &g, &c, &k, &sweeps,
                          &threads))
        return NULL;
    if (g < 1 || c < 1 || k < 1) {
        PyErr_SetString(PyExc_ValueError, "descend: empty shape");
        return NULL;
    }
    const int pair_safe = op != Py_None;
    Py_buffer bq, bgrad, blo = {0}, bhi = {0}, bv = {0}, bs, bh, bp = {0};
    const Py_ssize_t n = g * c * k;
    int got = 0; /* buffers held, in the order taken */
    Py_buffer *held[8];
#define TAKE_BUF(o, b, w, cnt, name, item)                 \
    do {                                                   \
        if (get(o, b, w, cnt, name, item) < 0) goto fail;  \
        held[got++] = b;                                   \
    } while (0)
    TAKE_BUF(oq, &bq, 1, n, "q", sizeof(double));
    TAKE_BUF(ograd, &bgrad, 1, n, "grad", sizeof(double));
    if (pair_safe) {
        TAKE_BUF(ov, &bv, 0, n, "v", sizeof(double));
        TAKE_BUF(op, &bp, 0, k, "partners", sizeof(int64_t));
    } else {
        TAKE_BUF(olo, &blo, 0, n, "lo", sizeof(double));
        TAKE_BUF(ohi, &bhi, 0, n, "hi", sizeof(double));
    }
    TAKE_BUF(os, &bs, 0, g * c, "s", sizeof(double));
    TAKE_BUF(oh, &bh, 0, g * k * k, "hessian", sizeof(double));
    if (pair_safe) {
        const int64_t *pp = (const int64_t *)bp.buf;
        for (Py_ssize_t j = 0; j < k; j++)
            if (pp[j] >= k || pp[j] < -1) {
                PyErr_SetString(PyExc_ValueError, "descend: a partner index out of range");
                goto fail;
            }
    }
    {
        job base = {(double *)bq.buf, (double *)bgrad.buf, (const double *)blo.buf, (const double *)bhi.buf,
                    (const double *)bv.buf, (const double *)bs.buf, (const double *)bh.buf,
                    (const int64_t *)bp.buf, g, c, k, sweeps, pair_safe, 0, g * c};
        int nt = threads < 1 ? 1 : (threads > MAX_THREADS ? MAX_THREADS : threads);
        if (nt > g * c) nt = (int)(g * c);
        job jobs[MAX_THREADS];
        pthread_t tid[MAX_THREADS];
        int started[MAX_THREADS] = {0};
        Py_BEGIN_ALLOW_THREADS
        for (int t = 0; t < nt; t++) {
            jobs[t] = base;
            jobs[t].first = g * c * t / nt;
            jobs[t].last = g * c * (t + 1) / nt;
            started[t] = t > 0 && pthread_create(&tid[t], NULL, run_job, &jobs[t]) == 0;
        }
        run_job(&jobs[0]);
        for (int t = 1; t < nt; t++) {
            if (started[t])
                pthread_join(tid[t], NULL);
            else
                run_job(&jobs[t]); /* no thread to be had: this one does it */
        }
        Py_END_ALLOW_THREADS
    }
    for (int i = 0; i < got; i++) PyBuffer_Release(held[i]);
    Py_RETURN_NONE;
fail:
    for (int i = 0; i < got; i++) PyBuffer_Release(held[i]);
    return NULL;
#undef TAKE_BUF
}

static PyMethodDef methods[] = {
    {"descend", descend, METH_VARARGS,
     "descend(q, grad, lo, hi, v, s, hessian, partners, g, c, k, sweeps, threads): the rounding descent of "
     "qtool.quantize.rounding, in place on q and grad (float64, C order)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rounding", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rounding(void) { return PyModule_Create(&module); }
