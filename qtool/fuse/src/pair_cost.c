/* Channel pairing's cost matrix: qtool/fuse/pair_channels._accumulate_reference, in C.
 *
 * For one reader weight v [R, C] (float32, in steps of its output channel's max|w| / 127) and each
 * sign, every weight a_i past limit / 2 is charged, in its row, with each partner j no larger than
 * itself: half[i, j] += (a_j + a_i - limit)^2 where that is past the limit. The reference builds the
 * penalty of each such weight against its whole row ([n, C] float32), then np.add.reduceat sums the
 * rows of each column's run. So does this, a row at a time, in SIMD lanes across the partners (no
 * gathers, no branches: a penalty that is not charged is a zero added, as numpy adds it), the run's
 * sums kept in [C]-wide float32 accumulators: ResNet-50's 37 components in about a tenth of the time
 * of a scatter over each weight's possible partners, whose per-partner bookkeeping cost 14 ns a term.
 *
 * Bit for bit the reference: the same float32 penalties (a_j + (a_i - limit), squared), summed as
 * np.add.reduceat sums them: the charged weights are sorted by column, then row, and cut into
 * blocks of `block`; a block's run of one column is summed per partner j in float32 as its first
 * row's penalty plus numpy's pairwise sum of the others (pairwise_sum: sequential under 8 terms, 8
 * interleaved accumulators up to 128, halves beyond), and each run's sums are added to the float64
 * matrix in that order. No FMA contraction (-ffp-contract=off). Paths: AVX-512F, AVX2, portable C
 * (the same loops, vectorised for each target by the compiler), chosen from the CPU's features and
 * capped by QTOOL_ISA; set_isa() lets tests run each. The GIL is released throughout. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "isa_choice.h"
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>


/* numpy's pairwise_sum (numpy/_core/src/umath/loops_utils.h.src) over n values, as a plan: under 8,
 * one sequential sum; up to 128, a leaf (8 interleaved accumulators over the first n - n % 8 values,
 * combined as ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)), then the rest added in order);
 * beyond, the sum of the two halves' (the first n / 2 rounded down to a multiple of 8). The leaves in
 * order, each with the additions that follow it in the post-order walk of that tree. */
#define MAX_LEAVES 4096
#define STACK 32
typedef struct {
    int64_t end, cut; /* positions [.., end); from cut on, the leaf's tail */
    int adds;         /* additions after this leaf */
} leaf;

static int plan_leaves(int64_t o, int64_t n, leaf *L, int *nl, int *depth) {
    if (n <= 128) {
        if (*nl == MAX_LEAVES || *depth == STACK) return -1;
        L[*nl] = (leaf){o + n, o + n - n % 8, 0};
        ++*nl;
        ++*depth;
        return 0;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    if (plan_leaves(o, n2, L, nl, depth) < 0 || plan_leaves(o + n2, n - n2, L, nl, depth) < 0) return -1;
    L[*nl - 1].adds++;
    --*depth;
    return 0;
}

/* a charged weight (a > limit / 2): its row and its magnitude */
typedef struct {
    int32_t row;
    float own;
} charge;

/* One sign of one reader: its charged weights listed by column then row (the reference's stable
 * argsort): column i's are charges[per_col[i] .. per_col[i + 1]). */
typedef struct {
    const float *v;
    Py_ssize_t R, C;
    float sign, limit;
    int64_t *per_col;
    charge *charges;
} side;

static int prepare(side *S) {
    const Py_ssize_t R = S->R, C = S->C;
    S->per_col = calloc((size_t)C + 1, sizeof(int64_t));
    int64_t *fill = malloc((size_t)(C ? C : 1) * sizeof(int64_t));
    if (!S->per_col || !fill) {
        free(fill);
        return -1;
    }
    const float charged = S->limit / 2.0f, sign = S->sign;
    for (int pass = 0; pass < 2; pass++) {
        for (Py_ssize_t r = 0; r < R; r++) {
            const float *row = S->v + r * C;
            for (Py_ssize_t j = 0; j < C; j++) {
                const float a = sign * row[j];
                if (!(a > charged)) continue;
                if (pass == 0)
                    S->per_col[j + 1]++;
                else
                    S->charges[fill[j]++] = (charge){(int32_t)r, a};
            }
        }
        if (pass == 0) {
            for (Py_ssize_t i = 0; i < C; i++) S->per_col[i + 1] += S->per_col[i];
            S->charges = malloc((size_t)(S->per_col[C] ? S->per_col[C] : 1) * sizeof(charge));
            if (!S->charges) {
                free(fill);
                return -1;
            }
            memcpy(fill, S->per_col, (size_t)C * sizeof(int64_t));
        }
    }
    free(fill);
    return 0;
}

static void release(side *S) {
    free(S->per_col);
    free(S->charges);
    S->per_col = NULL;
    S->charges = NULL;
}

/* One thread's [C]-wide float32 sums: the run's first row, the sequential or tail sum, the leaf's 8
 * accumulators, and the finished leaves waiting for their siblings. */
typedef struct {
    float *first, *res, *r, *stack; /* [C], [C], [8][C], [STACK][C] */
} sums;

/* The loops every path shares, compiled once per target (the compiler vectorises them for it). */
#define PATH(SUFFIX, TARGET)                                                                                        \
    /* dst[j] += the penalty of charged weight `own` (row vr, this sign) against partner j, zero where none; */   \
    /* column `col` (the weight itself) left as it was */                                                         \
    TARGET static void penalties_##SUFFIX(float *restrict dst, const float *restrict vr, Py_ssize_t C, float sign, \
                                          float own, float limit, Py_ssize_t col) {                               \
        const float over = own - limit, keep = dst[col]; /* over: exact (Sterbenz), own in [limit/2, 2 limit] */  \
        for (Py_ssize_t j = 0; j < C; j++) {                                                                      \
            float part = sign * vr[j];                                                                            \
            part = part > 0.0f ? part : 0.0f;                                                                     \
            float p = part + over;                                                                                \
            p = p > 0.0f ? p : 0.0f;                                                                              \
            p *= (float)(part <= own); /* the reference's arithmetic: max, times the mask, squared */            \
            dst[j] += p * p;                                                                                      \
        }                                                                                                         \
        dst[col] = keep;                                                                                          \
    }                                                                                                             \
    TARGET static void combine_##SUFFIX(float *restrict out, const float *restrict r, Py_ssize_t C) {             \
        for (Py_ssize_t j = 0; j < C; j++)                                                                        \
            out[j] = ((r[j] + r[C + j]) + (r[2 * C + j] + r[3 * C + j])) +                                        \
                     ((r[4 * C + j] + r[5 * C + j]) + (r[6 * C + j] + r[7 * C + j]));                             \
    }                                                                                                             \
    TARGET static void add_##SUFFIX(float *restrict dst, const float *restrict src, Py_ssize_t C) {               \
        for (Py_ssize_t j = 0; j < C; j++) dst[j] += src[j];                                                      \
    }                                                                                                             \
    /* One run (charges [e0, e1) of column col) into half's row col, in the reference's order. */                \
    TARGET static int run_##SUFFIX(const side *S, const sums *W, double *half, Py_ssize_t col, int64_t e0,        \
                                   int64_t e1, leaf *L) {                                                         \
        const Py_ssize_t C = S->C;                                                                                \
        const int64_t rest = e1 - e0 - 1;                                                                         \
        int nl = 0, depth = 0;                                                                                    \
        if (rest >= 8 && plan_leaves(0, rest, L, &nl, &depth) < 0) return -1;                                     \
        const charge *ch = S->charges;                                                                            \
        memset(W->first, 0, (size_t)C * sizeof(float));                                                          \
        penalties_##SUFFIX(W->first, S->v + (Py_ssize_t)ch[e0].row * C, C, S->sign, ch[e0].own, S->limit, col);   \
        float *out = W->res;                                                                                      \
        memset(W->res, 0, (size_t)C * sizeof(float));                                                            \
        if (rest < 8) {                                                                                           \
            for (int64_t e = e0 + 1; e < e1; e++)                                                                 \
                penalties_##SUFFIX(W->res, S->v + (Py_ssize_t)ch[e].row * C, C, S->sign, ch[e].own, S->limit,     \
                                   col);                                                                          \
        } else {                                                                                                  \
            int64_t start = 0;                                                                                    \
            depth = 0;                                                                                            \
            for (int k = 0; k < nl; k++) {                                                                        \
                memset(W->r, 0, 8 * (size_t)C * sizeof(float));                                                   \
                for (int64_t pos = start; pos < L[k].cut; pos++) {                                                \
                    const charge *c = &ch[e0 + 1 + pos];                                                          \
                    penalties_##SUFFIX(W->r + ((pos - start) % 8) * C, S->v + (Py_ssize_t)c->row * C, C, S->sign, \
                                       c->own, S->limit, col);                                                    \
                }                                                                                                 \
                float *top = W->stack + (Py_ssize_t)depth * C;                                                    \
                combine_##SUFFIX(top, W->r, C); /* the tail's values follow, in order */                         \
                for (int64_t pos = L[k].cut; pos < L[k].end; pos++) {                                             \
                    const charge *c = &ch[e0 + 1 + pos];                                                          \
                    penalties_##SUFFIX(top, S->v + (Py_ssize_t)c->row * C, C, S->sign, c->own, S->limit, col);    \
                }                                                                                                 \
                depth++;                                                                                          \
                for (int a = 0; a < L[k].adds; a++, depth--)                                                      \
                    add_##SUFFIX(W->stack + (Py_ssize_t)(depth - 2) * C, W->stack + (Py_ssize_t)(depth - 1) * C,  \
                                 C);                                                                              \
                start = L[k].end;                                                                                 \
            }                                                                                                     \
            out = W->stack;                                                                                       \
        }                                                                                                         \
        double *dst = half + col * C;                                                                             \
        for (Py_ssize_t j = 0; j < C; j++) dst[j] += (double)(W->first[j] + out[j]);                              \
        return 0;                                                                                                 \
    }

#ifdef QT_X86
PATH(avx512, __attribute__((target("avx512f"))))
PATH(avx2, __attribute__((target("avx2"))))
#endif
PATH(scalar, )

typedef struct {
    const side *sides; /* sign +1, then -1: the reference's order, kept per column */
    double *half;
    Py_ssize_t block, c0, c1;
    int status;
} job;

/* Columns [c0, c1) of both sides into half's rows c0..c1, run by run: a run is the entries of one
 * column within one of the reference's blocks of `block` (counted over all columns of its side). */
static void *run_job(void *arg) {
    job *J = arg;
    const Py_ssize_t C = J->sides[0].C;
    sums W;
    float *mem = malloc((size_t)(C ? C : 1) * (2 + 8 + STACK) * sizeof(float));
    leaf *L = malloc(MAX_LEAVES * sizeof(leaf));
    J->status = -1;
    if (!mem || !L) goto done;
    W = (sums){mem, mem + C, mem + 2 * C, mem + 10 * C};
    for (int s = 0; s < 2; s++) {
        const side *S = &J->sides[s];
        for (Py_ssize_t col = J->c0; col < J->c1; col++) {
            for (int64_t e = S->per_col[col]; e < S->per_col[col + 1];) {
                const int64_t block_end = (e / J->block + 1) * J->block;
                const int64_t end = S->per_col[col + 1] < block_end ? S->per_col[col + 1] : block_end;
                int st;
#ifdef QT_X86
                if (g_isa == ISA_AVX512)
                    st = run_avx512(S, &W, J->half, col, e, end, L);
                else if (g_isa == ISA_AVX2)
                    st = run_avx2(S, &W, J->half, col, e, end, L);
                else
#endif
                    st = run_scalar(S, &W, J->half, col, e, end, L);
                if (st < 0) goto done;
                e = end;
            }
        }
    }
    J->status = 0;
done:
    free(mem);
    free(L);
    return NULL;
}

#define MAX_THREADS 8

/* Runs f over args (each `size` bytes apart) on up to n threads, this one included. */
static void run_all(void *(*f)(void *), char *args, size_t size, int n) {
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 1; t < n; t++) started[t] = pthread_create(&tid[t], NULL, f, args + t * size) == 0;
    f(args);
    for (int t = 1; t < n; t++) {
        if (started[t])
            pthread_join(tid[t], NULL);
        else
            f(args + t * size); /* no thread to be had: this one does it */
    }
}

/* Both signs of one reader into half, columns split over `threads` threads by their charged weights
 * (each column's sums are one thread's, in the reference's order). Returns -1 when memory runs out. */
static int accumulate_reader(const float *v, Py_ssize_t R, Py_ssize_t C, double *half, Py_ssize_t block, float limit,
                             int threads) {
    const int nt = threads < 1 ? 1 : (threads > MAX_THREADS ? MAX_THREADS : threads);
    side sides[2] = {{v, R, C, 1.0f, limit, NULL, NULL}, {v, R, C, -1.0f, limit, NULL, NULL}};
    int status = prepare(&sides[0]) < 0 || prepare(&sides[1]) < 0 ? -1 : 0;
    if (status == 0) {
        const int64_t total = sides[0].per_col[C] + sides[1].per_col[C];
        job jobs[MAX_THREADS];
        Py_ssize_t col = 0;
        for (int t = 0; t < nt; t++) { /* equal shares of the charged weights */
            jobs[t] = (job){sides, half, block, col, col, 0};
            const int64_t goal = total * (t + 1) / nt;
            while (col < C && (t == nt - 1 || sides[0].per_col[col] + sides[1].per_col[col] < goal)) col++;
            jobs[t].c1 = col;
        }
        run_all(run_job, (char *)jobs, sizeof(job), nt);
        for (int t = 0; t < nt; t++)
            if (jobs[t].status < 0) status = -1;
    }
    release(&sides[0]);
    release(&sides[1]);
    return status;
}

static PyObject *accumulate(PyObject *self, PyObject *args) {
    PyObject *ov, *oh;
    Py_ssize_t block;
    double limit;
    int threads;
    if (!PyArg_ParseTuple(args, "OOndi", &ov, &oh, &block, &limit, &threads)) return NULL;
    Py_buffer bv, bh;
    if (PyObject_GetBuffer(ov, &bv, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_ND) < 0) return NULL;
    if (PyObject_GetBuffer(oh, &bh, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_ND | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&bv);
        return NULL;
    }
    PyObject *result = NULL;
    if (bv.ndim != 2 || bv.itemsize != 4 || strcmp(bv.format, "f") != 0 || bh.ndim != 2 || bh.itemsize != 8 ||
        strcmp(bh.format, "d") != 0 || bh.shape[0] != bv.shape[1] || bh.shape[1] != bv.shape[1] || block < 1 ||
        block > (1 << 20) || bv.shape[1] > INT32_MAX || bv.shape[0] > INT32_MAX || !(limit > 0.0)) {
        PyErr_SetString(PyExc_ValueError,
                        "accumulate: v float32 [R, C], half float64 [C, C], 1 <= block <= 2^20, limit > 0");
        goto out;
    }
    const Py_ssize_t R = bv.shape[0], C = bv.shape[1];
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = accumulate_reader((const float *)bv.buf, R, C, (double *)bh.buf, block, (float)limit, threads);
    Py_END_ALLOW_THREADS
    if (status < 0) {
        PyErr_NoMemory();
        goto out;
    }
    Py_INCREF(Py_None);
    result = Py_None;
out:
    PyBuffer_Release(&bv);
    PyBuffer_Release(&bh);
    return result;
}

static PyMethodDef methods[] = {
    {"accumulate", accumulate, METH_VARARGS,
     "accumulate(v, half, block, limit, threads): add one reader's same-sign pair costs into half (float64 [C, C], in "
     "place); v float32 [R, C] in weight steps"},
    ISA_METHODS,
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pair_cost", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pair_cost(void) {
    isa_choose();
    return PyModule_Create(&module);
}
