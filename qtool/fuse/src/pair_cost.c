/* Channel pairing's cost matrix: qtool/fuse/pair_channels.pair_cost_reference, in C.
 *
 * For one reader weight v [R, C] (float32, in steps of its output channel's max|w| / 127) and each
 * sign, every weight a_i past limit / 2 is charged, in its row, with each partner j no larger than
 * itself: half[i, j] += (a_j + a_i - limit)^2 where that is past the limit. numpy builds the
 * penalty of each such weight against its whole row ([n, C] float32 temporaries, then
 * np.add.reduceat): ResNet-50's 37 readers took 29 s of a 35 s calibration. Here a row's positive
 * weights are bucketed by their integer part once, and a weight visits only the buckets its
 * partners can be in (a_j in (limit - a_i, a_i]).
 *
 * Bit for bit the reference: the same float32 penalties (a_j + (a_i - limit), squared), summed as
 * np.add.reduceat sums them: the charged weights are sorted by column, then row, and cut into
 * blocks of `block`; a block's run of one column is summed per partner j in float32 as its first
 * row's penalty plus numpy's pairwise sum of the others (pairwise_sum: sequential under 8 terms, 8
 * interleaved accumulators up to 128, halves beyond), the penalties that are zero keeping their
 * places; each run's sums are added to the float64 matrix in that order. No FMA contraction
 * (-ffp-contract=off). The GIL is released throughout. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>

#define NBUCKETS 130 /* integer parts 0..128 (a row's max is 127 steps; rounding may pass it) and a spare */
#define WIDTH (2 * NBUCKETS + 2) /* a row's buckets: positive weights, negative ones, zeros (never scanned) */

static inline int bucket_of(float a) {
    int b = (int)a;
    return b < NBUCKETS - 1 ? b : NBUCKETS - 1;
}

/* a weight as a partner: its channel and magnitude, in its row's counting sort by sign and integer
 * part (so that a partner scan reads one array in order) */
typedef struct {
    int32_t j;
    float a;
} partner;

/* Row r's weights of sign s (0: positive, 1: negative) with integer part b are
 * pv[r * C + start[r * WIDTH + s * NBUCKETS + b] .. r * C + start[r * WIDTH + s * NBUCKETS + b + 1]). */
typedef struct {
    const float *v;
    Py_ssize_t C, r0, r1; /* rows [r0, r1): one thread's share */
    int32_t *start;
    partner *pv;
} buckets;

static void *bucket_rows(void *arg) {
    const buckets *B = arg;
    const Py_ssize_t C = B->C;
    for (Py_ssize_t r = B->r0; r < B->r1; r++) { /* a counting sort per row, branch-free: signs are a coin toss */
        const float *row = B->v + r * C;
        int32_t *start = B->start + r * WIDTH, at[WIDTH - 1];
        memset(start, 0, WIDTH * sizeof(int32_t));
        for (Py_ssize_t j = 0; j < C; j++) {
            const float x = row[j];
            const int b = bucket_of(x > 0.0f ? x : -x);
            start[(x > 0.0f ? b : x < 0.0f ? NBUCKETS + b : 2 * NBUCKETS) + 1]++;
        }
        for (Py_ssize_t b = 1; b < WIDTH; b++) start[b] += start[b - 1];
        memcpy(at, start, sizeof at);
        partner *pv = B->pv + r * C;
        for (Py_ssize_t j = 0; j < C; j++) {
            const float x = row[j], a = x > 0.0f ? x : -x;
            const int b = bucket_of(a);
            pv[at[x > 0.0f ? b : x < 0.0f ? NBUCKETS + b : 2 * NBUCKETS]++] = (partner){(int32_t)j, a};
        }
    }
    return NULL;
}

/* The partners of the charged weight `own` in row r: j with a_j in (limit - own, own], in the buckets of
 * integer parts from that of limit - own to that of own -> pv[*k0 .. *k1) (the exact test, the
 * reference's float32 operations, is the scan's). */
static inline void partners(const buckets *B, int off, Py_ssize_t r, float own, float limit, int64_t *k0, int64_t *k1) {
    const int lo = limit - own > 0.0f ? bucket_of(limit - own) : 0, hi = bucket_of(own);
    const int32_t *st = B->start + r * WIDTH + off;
    *k0 = r * B->C + st[lo];
    *k1 = r * B->C + st[hi + 1];
}

/* numpy's pairwise_sum (numpy/_core/src/umath/loops_utils.h.src) over n values, as a plan: under 8,
 * one sequential sum; up to 128, a leaf (8 interleaved accumulators over the first n - n % 8 values,
 * combined as ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)), then the rest added in order);
 * beyond, the sum of the two halves' (the first n / 2 rounded down to a multiple of 8). The leaves in
 * order, each with the additions that follow it in the post-order walk of that tree. */
#define MAX_LEAVES 4096
#define STACK 32
typedef struct {
    int64_t end, cut; /* positions [.., end); from cut on, the leaf's tail */
    int adds, depth;  /* additions after this leaf; the stack's depth after them */
} leaf;

static int plan_leaves(int64_t o, int64_t n, leaf *L, int *nl, int *depth) {
    if (n <= 128) {
        if (*nl == MAX_LEAVES || *depth == STACK) return -1;
        L[*nl] = (leaf){o + n, o + n - n % 8, 0, ++*depth};
        ++*nl;
        return 0;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    if (plan_leaves(o, n2, L, nl, depth) < 0 || plan_leaves(o + n2, n - n2, L, nl, depth) < 0) return -1;
    L[*nl - 1].adds++;
    L[*nl - 1].depth = --*depth;
    return 0;
}

/* per partner, within one run: the first row's penalty, the current leaf's sums (one cache line); the
 * finished leaves' sums waiting for their siblings are its row of the stacks [C, STACK] */
typedef struct {
    float first, res, r[8];
    int32_t combined; /* r was folded into res: the leaf's tail terms follow */
    int32_t seen;     /* in this run's list of touched partners */
    int32_t depth;
    int32_t pad[3];
} partial;

#define SLOT_FIRST 0 /* a term's place in its partial, as a float index */
#define SLOT_RES 1
#define SLOT_R 2
_Static_assert(offsetof(partial, res) == SLOT_RES * sizeof(float) && offsetof(partial, r) == SLOT_R * sizeof(float),
               "a partial's sums are indexed as floats");

static inline float combine(const float *r) { return ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7])); }

/* leaf k is done: each touched partner's sum of it joins its stack, and the additions that follow */
static void finish_leaf(partial *st, float *stacks, const int32_t *touched, Py_ssize_t nt, const leaf *L) {
    for (Py_ssize_t t = 0; t < nt; t++) {
        partial *s = &st[touched[t]];
        float *stack = stacks + (Py_ssize_t)touched[t] * STACK;
        stack[s->depth++] = s->combined ? s->res : combine(s->r);
        for (int a = 0; a < L->adds; a++, s->depth--) stack[s->depth - 2] += stack[s->depth - 1];
        s->res = 0.0f;
        s->combined = 0;
        memset(s->r, 0, sizeof s->r);
    }
}

/* a charged weight (a > limit / 2): its row, its magnitude, and its partners' span of the row's buckets
 * (found as its row is read, so that the column-major walk reads neither the weights nor the buckets) */
typedef struct {
    int32_t row;
    float own;
    int64_t k0, k1;
} charge;

/* One sign of one reader: its rows bucketed, its charged weights listed by column then row (the
 * reference's stable argsort): column i's are charges[per_col[i] .. per_col[i + 1]). */
typedef struct {
    Py_ssize_t R, C;
    float limit;
    const buckets *B;
    int off; /* this sign's first bucket: 0 for the positive weights, NBUCKETS for the negative */
    int64_t *per_col;
    charge *charges;
    int status;
} side;

static void *prepare(void *arg) {
    side *S = arg;
    const Py_ssize_t R = S->R, C = S->C;
    S->status = -1;
    S->per_col = calloc((size_t)C + 1, sizeof(int64_t));
    int64_t *fill = malloc((size_t)C * sizeof(int64_t));
    if (!S->per_col || !fill) goto done;
    const float charged = S->limit / 2.0f;
    const int from = bucket_of(charged); /* the charged are in the buckets from its integer part on */
    for (int pass = 0; pass < 2; pass++) {
        for (Py_ssize_t r = 0; r < R; r++) {
            const int32_t *sr = S->B->start + r * WIDTH + S->off;
            for (int32_t k = sr[from]; k < sr[NBUCKETS]; k++) {
                const partner *p = &S->B->pv[r * C + k];
                if (!(p->a > charged)) continue;
                if (pass == 0) {
                    S->per_col[p->j + 1]++;
                    continue;
                }
                charge *c = &S->charges[fill[p->j]++];
                c->row = (int32_t)r;
                c->own = p->a;
                partners(S->B, S->off, r, p->a, S->limit, &c->k0, &c->k1);
            }
        }
        if (pass == 0) {
            for (Py_ssize_t i = 0; i < C; i++) S->per_col[i + 1] += S->per_col[i];
            S->charges = malloc((size_t)(S->per_col[C] ? S->per_col[C] : 1) * sizeof(charge));
            if (!S->charges) goto done;
            memcpy(fill, S->per_col, (size_t)C * sizeof(int64_t));
        }
    }
    S->status = 0;
done:
    free(fill);
    return NULL;
}

static void release(side *S) {
    free(S->per_col);
    free(S->charges);
}

/* Columns [c0, c1) of one side into half's rows c0..c1, run by run: a run is the entries of one
 * column within one of the reference's blocks of `block` (counted over all columns); reduceat sums
 * it per partner as the first row's penalty + pairwise_sum of the other `rest` rows' (zeros keep
 * their places). Returns -1 when memory runs out. */
static int run_columns(const side *S, double *half, Py_ssize_t block, Py_ssize_t c0, Py_ssize_t c1) {
    const Py_ssize_t C = S->C;
    const int64_t *per_col = S->per_col;
    int32_t *touched = malloc((size_t)C * sizeof(int32_t));
    partial *st = calloc((size_t)C, sizeof(partial));
    float *stacks = malloc((size_t)C * STACK * sizeof(float));
    leaf *L = malloc(MAX_LEAVES * sizeof(leaf));
    int status = -1;
    if (!touched || !st || !stacks || !L) goto done;
    Py_ssize_t col = c0;
    for (int64_t e = per_col[c0]; e < per_col[c1];) {
        while (per_col[col + 1] <= e) col++; /* the column of entry e */
        const int64_t block_end = (e / block + 1) * block;
        const int64_t first = e, end = per_col[col + 1] < block_end ? per_col[col + 1] : block_end;
        const int64_t rest = end - first - 1;
        int nl = 0, depth = 0, k = 0;
        if (rest >= 8 && plan_leaves(0, rest, L, &nl, &depth) < 0) goto done;
        Py_ssize_t nt = 0;
        for (; e < end; e++) {
            const int64_t pos = e - first - 1;
            for (; k < nl && pos >= L[k].end; k++) finish_leaf(st, stacks, touched, nt, &L[k]);
            const charge *c = &S->charges[e];
            const float own = c->own, over = own - S->limit; /* exact (Sterbenz): own is in [limit / 2, 2 limit] */
            const partner *pv = S->B->pv;
            const int64_t k0 = c->k0, k1 = c->k1;
            /* positions ascend: every term arrives in its sum's order. Where it goes: the first row's
             * slot, the running sum (under 8 rows), or the leaf's accumulator of this position */
            const int tail = rest >= 8 && pos >= L[k].cut;
            const int slot = pos < 0 ? SLOT_FIRST : rest < 8 ? SLOT_RES
                                                              : SLOT_R + (int)((pos - (k ? L[k - 1].end : 0)) % 8);
            const int32_t fresh_depth = k ? L[k - 1].depth : 0; /* a partner first met in leaf k: zeros before */
            for (int64_t q = k0; q < k1; q++) {
                const float part = pv[q].a, p = part + over;
                const int32_t j = pv[q].j;
                if (!(p > 0.0f && part <= own && j != col)) continue;
                partial *s = &st[j];
                if (!s->seen) {
                    s->seen = 1;
                    s->depth = fresh_depth;
                    for (int32_t d = 0; d < fresh_depth; d++) stacks[(Py_ssize_t)j * STACK + d] = 0.0f;
                    touched[nt++] = j;
                }
                if (tail) { /* the leaf's last n % 8 values, added after its accumulators are combined */
                    if (!s->combined) s->res = combine(s->r), s->combined = 1;
                    s->res += p * p;
                } else
                    ((float *)s)[slot] += p * p;
            }
        }
        for (; k < nl; k++) finish_leaf(st, stacks, touched, nt, &L[k]);
        double *dst = half + col * C;
        for (Py_ssize_t t = 0; t < nt; t++) {
            partial *s = &st[touched[t]];
            float out = s->first;
            out += rest >= 8 ? stacks[(Py_ssize_t)touched[t] * STACK] : s->res;
            dst[touched[t]] += (double)out;
            s->first = s->res = 0.0f; /* (finish_leaf left r and combined at zero) */
            s->seen = 0;
        }
    }
    status = 0;
done:
    free(touched);
    free(st);
    free(stacks);
    free(L);
    return status;
}

typedef struct {
    const side *sides; /* sign +1, then -1: the reference's order, kept per column */
    double *half;
    Py_ssize_t block, c0, c1;
    int status;
} job;

static void *run_job(void *arg) {
    job *J = arg;
    J->status = 0;
    for (int s = 0; s < 2 && J->status == 0; s++) J->status = run_columns(&J->sides[s], J->half, J->block, J->c0, J->c1);
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
    int32_t *start = malloc((size_t)(R ? R : 1) * WIDTH * sizeof(int32_t));
    partner *pv = malloc((size_t)(R * C ? R * C : 1) * sizeof(partner));
    if (!start || !pv) {
        free(start);
        free(pv);
        return -1;
    }
    buckets rowjobs[MAX_THREADS];
    for (int t = 0; t < nt; t++) rowjobs[t] = (buckets){v, C, R * t / nt, R * (t + 1) / nt, start, pv};
    run_all(bucket_rows, (char *)rowjobs, sizeof(buckets), nt);
    side sides[2] = {{R, C, limit, &rowjobs[0], 0, NULL, NULL, 0}, {R, C, limit, &rowjobs[0], NBUCKETS, NULL, NULL, 0}};
    if (nt > 1)
        run_all(prepare, (char *)sides, sizeof(side), 2);
    else
        prepare(&sides[0]), prepare(&sides[1]);
    int status = sides[0].status < 0 || sides[1].status < 0 ? -1 : 0;
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
    free(start);
    free(pv);
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
        block > (1 << 20) || bv.shape[1] > INT32_MAX || bv.shape[0] > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError,
                        "accumulate: v float32 [R, C], half float64 [C, C], 1 <= block <= 2^20");
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
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pair_cost", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pair_cost(void) { return PyModule_Create(&module); }
