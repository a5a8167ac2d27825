/* Python bindings: qtool.kernels._native. Thin: argument checks happen in qtool/kernels/__init__.py;
 * here we only check buffer sizes, then release the GIL and run. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "operators.h"

#define CAPSULE_NAME "qtool.kernels.conv"

typedef struct {
  Py_buffer b;
  int ok;
} buf_t;

static int get_buf(PyObject* o, buf_t* bt, int writable, Py_ssize_t need, const char* what) {
  bt->ok = 0;
  if (PyObject_GetBuffer(o, &bt->b, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) != 0)
    return -1;
  bt->ok = 1;
  if (need >= 0 && bt->b.len != need) {
    PyErr_Format(PyExc_ValueError, "%s: buffer has %zd bytes, expected %zd", what, bt->b.len, need);
    return -1;
  }
  return 0;
}

static void rel(buf_t* bt) {
  if (bt->ok) PyBuffer_Release(&bt->b);
  bt->ok = 0;
}

static void capsule_free(PyObject* cap) {
  qt_conv* cv = (qt_conv*)PyCapsule_GetPointer(cap, CAPSULE_NAME);
  qt_conv_free(cv);
}

static PyObject* py_info(PyObject* self, PyObject* args) {
  (void)self; (void)args;
  const qt_cpu_features* f = qt_cpu();
  const qt_dispatch* d = qt_get_dispatch();
  PyObject* sup = Py_BuildValue("{s:O,s:O,s:O,s:O,s:O,s:O,s:O,s:O,s:O,s:O,s:O}",
      "avx2", f->avx2 ? Py_True : Py_False, "fma", f->fma ? Py_True : Py_False,
      "avx512f", f->avx512f ? Py_True : Py_False, "avx512bw", f->avx512bw ? Py_True : Py_False,
      "avx512vl", f->avx512vl ? Py_True : Py_False, "avx512dq", f->avx512dq ? Py_True : Py_False,
      "avx512vnni", f->avx512vnni ? Py_True : Py_False, "os_ymm", f->os_ymm ? Py_True : Py_False,
      "os_zmm", f->os_zmm ? Py_True : Py_False, "amx_int8", f->amx_int8 ? Py_True : Py_False,
      "os_amx", f->os_amx ? Py_True : Py_False);
  PyObject* ker = Py_BuildValue("{s:s,s:s,s:s,s:s}", "igemm", d->amx.ukernel ? d->amx.name : d->igemm.name, "dwconv",
                                d->dwconv.name, "add", d->add_name, "lut", d->lut_name);
  size_t jobs, chunks, wchunks;
  qt_pool_stats(&jobs, &chunks, &wchunks);
  PyObject* pool = Py_BuildValue("{s:n,s:n,s:n}", "parallel_jobs", (Py_ssize_t)jobs, "chunks",
                                 (Py_ssize_t)chunks, "chunks_run_by_workers", (Py_ssize_t)wchunks);
  return Py_BuildValue("{s:s,s:s,s:N,s:i,s:N,s:N}", "isa", d->isa_name, "best_isa",
                       qt_isa_name(qt_best_isa()), "supported", sup, "num_threads",
                       qt_get_num_threads(), "kernels", ker, "pool", pool);
}

static PyObject* py_set_isa(PyObject* self, PyObject* args) {
  (void)self;
  int isa;
  if (!PyArg_ParseTuple(args, "i", &isa)) return NULL;
  qt_get_dispatch();
  return PyLong_FromLong(qt_set_isa(isa));
}

static PyObject* py_get_isa(PyObject* self, PyObject* args) {
  (void)self; (void)args;
  return PyLong_FromLong(qt_get_dispatch()->isa);
}

static PyObject* py_set_num_threads(PyObject* self, PyObject* args) {
  (void)self;
  int n;
  if (!PyArg_ParseTuple(args, "i", &n)) return NULL;
  qt_set_num_threads(n);
  Py_RETURN_NONE;
}

static PyObject* py_set_parallel_min_ns(PyObject* self, PyObject* args) {
  (void)self;
  double ns;
  if (!PyArg_ParseTuple(args, "d", &ns)) return NULL;
  qt_set_parallel_min_ns(ns);
  Py_RETURN_NONE;
}

static PyObject* py_set_spin_ns(PyObject* self, PyObject* args) {
  (void)self;
  double ns;
  if (!PyArg_ParseTuple(args, "d", &ns)) return NULL;
  qt_set_spin_ns(ns);
  Py_RETURN_NONE;
}

static PyObject* py_get_spin_ns(PyObject* self, PyObject* args) {
  (void)self; (void)args;
  return PyFloat_FromDouble(qt_get_spin_ns());
}

static PyObject* py_pool_wake_ns(PyObject* self, PyObject* args) {
  (void)self;
  int asleep;
  double ns;
  if (!PyArg_ParseTuple(args, "i", &asleep)) return NULL;
  Py_BEGIN_ALLOW_THREADS
  ns = qt_pool_wake_ns(asleep);
  Py_END_ALLOW_THREADS
  return PyFloat_FromDouble(ns);
}

static PyObject* py_pool_prewake(PyObject* self, PyObject* args) {
  (void)self; (void)args;
  qt_pool_prewake();  /* takes the pool's call lock only briefly */
  Py_RETURN_NONE;
}

static PyObject* py_pool_sleeping(PyObject* self, PyObject* args) {
  (void)self; (void)args;
  return PyLong_FromLong(qt_pool_sleeping());
}

static PyObject* py_pause_ns(PyObject* self, PyObject* args) {
  (void)self; (void)args;
  double ns;
  Py_BEGIN_ALLOW_THREADS
  ns = qt_pause_ns();
  Py_END_ALLOW_THREADS
  return PyFloat_FromDouble(ns);
}

static PyObject* py_set_kblock(PyObject* self, PyObject* args) {
  (void)self;
  int mode;
  if (!PyArg_ParseTuple(args, "i", &mode)) return NULL;
  qt_set_kblock(mode);
  Py_RETURN_NONE;
}

static PyObject* py_peak_gmacs(PyObject* self, PyObject* args) {
  (void)self;
  int kind;
  double seconds;
  if (!PyArg_ParseTuple(args, "id", &kind, &seconds)) return NULL;
  const int need = kind == QT_PEAK_AVX512VNNI ? QT_ISA_AVX512VNNI : QT_ISA_AVX2;
  if (kind < QT_PEAK_AVX2 || kind > QT_PEAK_AVX512VNNI || qt_best_isa() < need) return PyFloat_FromDouble(0.0);
  double r;
  Py_BEGIN_ALLOW_THREADS
  r = qt_peak_gmacs(kind, seconds);
  Py_END_ALLOW_THREADS
  return PyFloat_FromDouble(r);
}

static PyObject* py_get_exact_only(PyObject* self, PyObject* args) {
  (void)self; (void)args;
  return PyLong_FromLong(qt_get_exact_only());
}

static PyObject* py_set_exact_only(PyObject* self, PyObject* args) {
  (void)self;
  int on;
  if (!PyArg_ParseTuple(args, "i", &on)) return NULL;
  qt_set_exact_only(on);
  Py_RETURN_NONE;
}

static PyObject* py_get_num_threads(PyObject* self, PyObject* args) {
  (void)self; (void)args;
  return PyLong_FromLong(qt_get_num_threads());
}

/* conv_create(w, bias, mult, groups, cin_g, cout_g, kh, kw, sh, sw, pt, pl, dh, dw,
 *             x_zp, y_zp, lo, hi, out_f32, kind)   kind: 0 conv, 1 depthwise, 2 fully connected */
static PyObject* py_conv_create(PyObject* self, PyObject* args) {
  (void)self;
  PyObject *ow, *ob, *om;
  Py_ssize_t g, cin_g, cout_g, kh, kw, sh, sw, pt, pl, dh, dw;
  int x_zp, y_zp, lo, hi, out_f32, depthwise;
  if (!PyArg_ParseTuple(args, "OOOnnnnnnnnnnniiiiii", &ow, &ob, &om, &g, &cin_g, &cout_g, &kh, &kw,
                        &sh, &sw, &pt, &pl, &dh, &dw, &x_zp, &y_zp, &lo, &hi, &out_f32, &depthwise))
    return NULL;
  if (g < 1 || cin_g < 1 || cout_g < 1 || kh < 1 || kw < 1 || sh < 1 || sw < 1 || dh < 1 || dw < 1 ||
      pt < 0 || pl < 0) {
    PyErr_SetString(PyExc_ValueError, "conv_create: bad dimensions");
    return NULL;
  }
  buf_t bw, bb, bm;
  bw.ok = bb.ok = bm.ok = 0;
  qt_conv* cv = NULL;
  if (get_buf(ow, &bw, 0, g * cout_g * kh * kw * cin_g, "weights") == 0 &&
      get_buf(ob, &bb, 0, g * cout_g * 4, "bias") == 0 &&
      get_buf(om, &bm, 0, g * cout_g * 4, "multiplier") == 0) {
    Py_BEGIN_ALLOW_THREADS
    cv = qt_conv_create((const int8_t*)bw.b.buf, (const int32_t*)bb.b.buf, (const float*)bm.b.buf,
                        g, cin_g, cout_g, kh, kw, sh, sw, pt, pl, dh, dw, x_zp, y_zp, lo, hi, out_f32,
                        depthwise);
    Py_END_ALLOW_THREADS
    if (!cv) PyErr_NoMemory();
  }
  rel(&bw); rel(&bb); rel(&bm);
  if (!cv) return NULL;
  PyObject* cap = PyCapsule_New(cv, CAPSULE_NAME, capsule_free);
  if (!cap) qt_conv_free(cv);
  return cap;
}

static PyObject* py_conv_info(PyObject* self, PyObject* args) {
  (void)self;
  PyObject* cap;
  if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
  qt_conv* cv = (qt_conv*)PyCapsule_GetPointer(cap, CAPSULE_NAME);
  if (!cv) return NULL;
  /* pairing: (column, block) counts of a vpmaddubsw kernel's packer: natural pairs, reordered,
   * fallback (igemm: split into two passes; depthwise: on the 16-bit form); all 0 for other kernels */
  return Py_BuildValue("{s:s,s:s,s:n,s:{s:n,s:n,s:n,s:n}}", "kernel", cv->kernel_name, "isa",
                       cv->d->isa_name, "packed_bytes", (Py_ssize_t)cv->w_bytes, "pairing",
                       "blocks", (Py_ssize_t)cv->pairs.blocks, "natural", (Py_ssize_t)cv->pairs.natural,
                       "reordered", (Py_ssize_t)cv->pairs.reordered, "fallback", (Py_ssize_t)cv->pairs.fallback);
}

/* conv_run(cap, x, n, h, w, y, oh, ow) */
static PyObject* py_conv_run(PyObject* self, PyObject* args) {
  (void)self;
  PyObject *cap, *ox, *oy;
  Py_ssize_t n, h, w, oh, ow;
  if (!PyArg_ParseTuple(args, "OOnnnOnn", &cap, &ox, &n, &h, &w, &oy, &oh, &ow)) return NULL;
  qt_conv* cv = (qt_conv*)PyCapsule_GetPointer(cap, CAPSULE_NAME);
  if (!cv) return NULL;
  if (n < 0 || h < 0 || w < 0 || oh < 0 || ow < 0) {
    PyErr_SetString(PyExc_ValueError, "conv_run: negative dimension");
    return NULL;
  }
  /* every tap of every output pixel must stay inside the (padded) input */
  if (oh > 0 && ow > 0 &&
      ((Py_ssize_t)((oh - 1) * cv->sh + (cv->kh - 1) * cv->dh) - (Py_ssize_t)cv->pt < 0 && h == 0)) {
    PyErr_SetString(PyExc_ValueError, "conv_run: empty input");
    return NULL;
  }
  const Py_ssize_t es = cv->rq.out_f32 ? 4 : 1;
  buf_t bx, by;
  bx.ok = by.ok = 0;
  int rc = -2;
  if (get_buf(ox, &bx, 0, n * h * w * (Py_ssize_t)cv->cin, "x") == 0 &&
      get_buf(oy, &by, 1, n * oh * ow * (Py_ssize_t)cv->cout * es, "out") == 0) {
    Py_BEGIN_ALLOW_THREADS
    rc = qt_conv_run(cv, (const uint8_t*)bx.b.buf, n, h, w, by.b.buf, oh, ow);
    Py_END_ALLOW_THREADS
    if (rc == -1) PyErr_NoMemory();
  }
  rel(&bx); rel(&by);
  if (rc != 0) return NULL;
  Py_RETURN_NONE;
}

/* deconv_run(phases, x, n, h, w, y, oh, ow, sh, sw, tmp): phases a tuple of (conv capsule, py, px),
 * every capsule with the same cin and cout (qtool/kernels/deconv.py packs them) */
#define QT_MAX_PHASES 64
static PyObject* py_deconv_run(PyObject* self, PyObject* args) {
  (void)self;
  PyObject *phases, *ox, *oy, *ot;
  Py_ssize_t n, h, w, oh, ow, sh, sw;
  if (!PyArg_ParseTuple(args, "O!OnnnOnnnnO", &PyTuple_Type, &phases, &ox, &n, &h, &w, &oy, &oh, &ow,
                        &sh, &sw, &ot))
    return NULL;
  const Py_ssize_t nph = PyTuple_GET_SIZE(phases);
  if (nph < 1 || nph > QT_MAX_PHASES || n < 0 || h < 0 || w < 0 || oh < 0 || ow < 0 || sh < 1 || sw < 1) {
    PyErr_SetString(PyExc_ValueError, "deconv_run: bad phases or dimensions");
    return NULL;
  }
  qt_deconv_phase ph[QT_MAX_PHASES];
  for (Py_ssize_t k = 0; k < nph; k++) {
    PyObject* cap;
    Py_ssize_t py, px;
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(phases, k), "Onn", &cap, &py, &px)) return NULL;
    ph[k].cv = (qt_conv*)PyCapsule_GetPointer(cap, CAPSULE_NAME);
    if (!ph[k].cv) return NULL;
    if (py < 0 || px < 0 || py >= sh || px >= sw || ph[k].cv->cin != ph[0].cv->cin ||
        ph[k].cv->cout != ph[0].cv->cout || ph[k].cv->rq.out_f32) {
      PyErr_SetString(PyExc_ValueError, "deconv_run: a phase does not fit the others");
      return NULL;
    }
    ph[k].py = (size_t)py; ph[k].px = (size_t)px;
  }
  const Py_ssize_t cin = (Py_ssize_t)ph[0].cv->cin, cout = (Py_ssize_t)ph[0].cv->cout;
  buf_t bx, by, bt;
  bx.ok = by.ok = bt.ok = 0;
  int rc = -2;
  if (get_buf(ox, &bx, 0, n * h * w * cin, "x") == 0 && get_buf(oy, &by, 1, n * oh * ow * cout, "out") == 0 &&
      get_buf(ot, &bt, 1, -1, "scratch") == 0) {
    if (sh * sw > 1 && bt.b.len < n * ((oh + sh - 1) / sh) * ((ow + sw - 1) / sw) * cout) {  /* (stride 1: unused) */
      PyErr_SetString(PyExc_ValueError, "deconv_run: scratch buffer too small");
    } else {
      Py_BEGIN_ALLOW_THREADS
      rc = qt_deconv_run(ph, (size_t)nph, (const uint8_t*)bx.b.buf, n, h, w, (uint8_t*)by.b.buf, oh, ow, sh,
                         sw, (uint8_t*)bt.b.buf);
      Py_END_ALLOW_THREADS
      if (rc == -1) PyErr_NoMemory();
    }
  }
  rel(&bx); rel(&by); rel(&bt);
  if (rc != 0) return NULL;
  Py_RETURN_NONE;
}

/* f32_deconv(x, wt, bias, y, cols, (n, cin, h, w, groups, og, kh, kw, sh, sw, pt, pl, oh, ow)): float32
 * ConvTranspose, NCHW; bias None or [groups * og] */
static PyObject* py_f32_deconv(PyObject* self, PyObject* args) {
  (void)self;
  PyObject *ox, *ow_, *ob, *oy, *oc;
  Py_ssize_t v[14];
  if (!PyArg_ParseTuple(args, "OOOOO(nnnnnnnnnnnnnn)", &ox, &ow_, &ob, &oy, &oc, &v[0], &v[1], &v[2], &v[3], &v[4],
                        &v[5], &v[6], &v[7], &v[8], &v[9], &v[10], &v[11], &v[12], &v[13]))
    return NULL;
  for (int i = 0; i < 14; i++)
    if (v[i] < 0 || ((i == 4 || i == 8 || i == 9) && v[i] < 1)) {
      PyErr_SetString(PyExc_ValueError, "f32_deconv: bad dimensions");
      return NULL;
    }
  qt_f32_deconv_shape s = {v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11], v[12], v[13]};
  if (s.cin % s.groups) {
    PyErr_SetString(PyExc_ValueError, "f32_deconv: groups do not divide the input channels");
    return NULL;
  }
  const Py_ssize_t cout = v[4] * v[5], m = v[5] * v[6] * v[7];
  buf_t bx, bw, bb, by, bc;
  bx.ok = bw.ok = bb.ok = by.ok = bc.ok = 0;
  int rc = -2;
  if (get_buf(ox, &bx, 0, v[0] * v[1] * v[2] * v[3] * 4, "x") == 0 &&
      get_buf(ow_, &bw, 0, v[4] * m * (v[1] / v[4]) * 4, "packed weights") == 0 &&
      (ob == Py_None || get_buf(ob, &bb, 0, cout * 4, "bias") == 0) &&
      get_buf(oy, &by, 1, v[0] * cout * v[12] * v[13] * 4, "out") == 0 &&
      get_buf(oc, &bc, 1, v[0] * v[4] * m * v[2] * v[3] * 4, "cols") == 0) {
    Py_BEGIN_ALLOW_THREADS
    rc = qt_f32_deconv((const float*)bx.b.buf, (const float*)bw.b.buf, bb.ok ? (const float*)bb.b.buf : NULL,
                       (float*)by.b.buf, (float*)bc.b.buf, &s);
    Py_END_ALLOW_THREADS
    if (rc == -1) PyErr_NoMemory();
  }
  rel(&bx); rel(&bw); rel(&bb); rel(&by); rel(&bc);
  if (rc != 0) return NULL;
  Py_RETURN_NONE;
}

/* add(a, b, y, ma, za, mb, zb, y_zp, lo, hi) */
static PyObject* py_add(PyObject* self, PyObject* args) {
  (void)self;
  PyObject *oa, *ob, *oy;
  float ma, mb;
  int za, zb, y_zp, lo, hi;
  if (!PyArg_ParseTuple(args, "OOOfifiiii", &oa, &ob, &oy, &ma, &za, &mb, &zb, &y_zp, &lo, &hi))
    return NULL;
  buf_t a, b, y;
  a.ok = b.ok = y.ok = 0;
  int ok = 0;
  if (get_buf(oa, &a, 0, -1, "a") == 0 && get_buf(ob, &b, 0, a.b.len, "b") == 0 &&
      get_buf(oy, &y, 1, a.b.len, "out") == 0) {
    Py_BEGIN_ALLOW_THREADS
    qt_add((const uint8_t*)a.b.buf, (const uint8_t*)b.b.buf, (uint8_t*)y.b.buf, (size_t)a.b.len, ma,
           za, mb, zb, y_zp, lo, hi);
    Py_END_ALLOW_THREADS
    ok = 1;
  }
  rel(&a); rel(&b); rel(&y);
  if (!ok) return NULL;
  Py_RETURN_NONE;
}

/* pool(x, y, n, h, w, c, oh, ow, kh, kw, sh, sw, pt, pl, pb, pr, dh, dw, avg, cip, x_zp, mult,
 *      y_zp, lo, hi) */
static PyObject* py_pool(PyObject* self, PyObject* args) {
  (void)self;
  PyObject *ox, *oy;
  Py_ssize_t n, h, w, c, oh, ow, kh, kw, sh, sw, pt, pl, pb, pr, dh, dw;
  int avg, cip, x_zp, y_zp, lo, hi;
  float mult;
  if (!PyArg_ParseTuple(args, "OOnnnnnnnnnnnnnnnniiifiii", &ox, &oy, &n, &h, &w, &c, &oh, &ow, &kh,
                        &kw, &sh, &sw, &pt, &pl, &pb, &pr, &dh, &dw, &avg, &cip, &x_zp, &mult, &y_zp,
                        &lo, &hi))
    return NULL;
  if (n < 0 || h < 0 || w < 0 || c < 0 || oh < 0 || ow < 0 || kh < 1 || kw < 1 || sh < 1 || sw < 1 ||
      pt < 0 || pl < 0 || pb < 0 || pr < 0 || dh < 1 || dw < 1) {
    PyErr_SetString(PyExc_ValueError, "pool: bad dimensions");
    return NULL;
  }
  buf_t x, y;
  x.ok = y.ok = 0;
  int ok = 0;
  if (get_buf(ox, &x, 0, n * h * w * c, "x") == 0 && get_buf(oy, &y, 1, n * oh * ow * c, "out") == 0) {
    Py_BEGIN_ALLOW_THREADS
    qt_pool((const uint8_t*)x.b.buf, (uint8_t*)y.b.buf, n, h, w, c, oh, ow, kh, kw, sh, sw, pt, pl,
            pb, pr, dh, dw, avg, cip, x_zp, mult, y_zp, lo, hi);
    Py_END_ALLOW_THREADS
    ok = 1;
  }
  rel(&x); rel(&y);
  if (!ok) return NULL;
  Py_RETURN_NONE;
}

/* concat(list of (x, inner, copy, zp, mult), outer, y, y_zp) */
static PyObject* py_concat(PyObject* self, PyObject* args) {
  (void)self;
  PyObject *lst, *oy;
  Py_ssize_t outer;
  int y_zp;
  if (!PyArg_ParseTuple(args, "O!nOi", &PyList_Type, &lst, &outer, &oy, &y_zp)) return NULL;
  Py_ssize_t nin = PyList_GET_SIZE(lst);
  buf_t* bufs = (buf_t*)calloc((size_t)nin + 1, sizeof(buf_t));
  qt_concat_input* in = (qt_concat_input*)calloc((size_t)nin + 1, sizeof(qt_concat_input));
  buf_t y;
  y.ok = 0;
  int ok = bufs && in;
  Py_ssize_t total = 0;
  for (Py_ssize_t i = 0; ok && i < nin; i++) {
    PyObject* ox;
    Py_ssize_t inner;
    int copy, zp;
    float m;
    if (!PyArg_ParseTuple(PyList_GET_ITEM(lst, i), "Onpif", &ox, &inner, &copy, &zp, &m) ||
        inner < 0 || get_buf(ox, &bufs[i], 0, outer * inner, "concat input") != 0) {
      ok = 0;
      break;
    }
    in[i].x = (const uint8_t*)bufs[i].b.buf;
    in[i].inner = (size_t)inner;
    in[i].copy = copy;
    in[i].zp = zp;
    in[i].mult = m;
    total += inner;
  }
  if (ok && get_buf(oy, &y, 1, outer * total, "out") != 0) ok = 0;
  if (ok) {
    Py_BEGIN_ALLOW_THREADS
    qt_concat(in, (size_t)nin, (size_t)outer, (uint8_t*)y.b.buf, y_zp);
    Py_END_ALLOW_THREADS
  } else if (!PyErr_Occurred()) {
    PyErr_NoMemory();
  }
  for (Py_ssize_t i = 0; bufs && i < nin; i++) rel(&bufs[i]);
  rel(&y);
  free(bufs);
  free(in);
  if (!ok) return NULL;
  Py_RETURN_NONE;
}

/* quantize(x_f32_nchw, y_u8_nhwc, n, c, h, w, scale, zp) / dequantize(x_u8_nhwc, y_f32_nchw, ...) */
static PyObject* boundary(PyObject* args, int quant) {
  PyObject *ox, *oy;
  Py_ssize_t n, c, h, w;
  float scale;
  int zp;
  if (!PyArg_ParseTuple(args, "OOnnnnfi", &ox, &oy, &n, &c, &h, &w, &scale, &zp)) return NULL;
  if (n < 0 || c < 0 || h < 0 || w < 0) {
    PyErr_SetString(PyExc_ValueError, "negative dimension");
    return NULL;
  }
  const Py_ssize_t count = n * c * h * w;
  buf_t x, y;
  x.ok = y.ok = 0;
  int ok = 0;
  if (get_buf(ox, &x, 0, count * (quant ? 4 : 1), "x") == 0 &&
      get_buf(oy, &y, 1, count * (quant ? 1 : 4), "out") == 0) {
    Py_BEGIN_ALLOW_THREADS
    if (quant) qt_quantize_nchw_to_nhwc((const float*)x.b.buf, (uint8_t*)y.b.buf, n, c, h, w, scale, zp);
    else qt_dequantize_nhwc_to_nchw((const uint8_t*)x.b.buf, (float*)y.b.buf, n, c, h, w, scale, zp);
    Py_END_ALLOW_THREADS
    ok = 1;
  }
  rel(&x); rel(&y);
  if (!ok) return NULL;
  Py_RETURN_NONE;
}

static PyObject* py_quantize(PyObject* self, PyObject* args) { (void)self; return boundary(args, 1); }
static PyObject* py_dequantize(PyObject* self, PyObject* args) { (void)self; return boundary(args, 0); }

/* mul(a, b, y, rows, inner, b_rows_per, ratio, za, zb, y_zp, lo, hi) */
static PyObject* py_mul(PyObject* self, PyObject* args) {
  (void)self;
  PyObject *oa, *ob, *oy;
  Py_ssize_t rows, inner, brp;
  float ratio;
  int za, zb, y_zp, lo, hi;
  if (!PyArg_ParseTuple(args, "OOOnnnfiiiii", &oa, &ob, &oy, &rows, &inner, &brp, &ratio, &za, &zb,
                        &y_zp, &lo, &hi))
    return NULL;
  if (rows < 0 || inner < 0 || brp < 0 || (brp && rows % brp)) {
    PyErr_SetString(PyExc_ValueError, "mul: bad dimensions");
    return NULL;
  }
  buf_t a, b, y;
  a.ok = b.ok = y.ok = 0;
  int ok = 0;
  if (get_buf(oa, &a, 0, rows * inner, "a") == 0 &&
      get_buf(ob, &b, 0, brp ? rows / brp * inner : rows * inner, "b") == 0 &&
      get_buf(oy, &y, 1, rows * inner, "out") == 0) {
    Py_BEGIN_ALLOW_THREADS
    qt_mul((const uint8_t*)a.b.buf, (const uint8_t*)b.b.buf, (uint8_t*)y.b.buf, rows, inner, brp,
           ratio, za, zb, y_zp, lo, hi);
    Py_END_ALLOW_THREADS
    ok = 1;
  }
  rel(&a); rel(&b); rel(&y);
  if (!ok) return NULL;
  Py_RETURN_NONE;
}

/* lut(x, table, y, c): c = 0 -> one 256-byte table; else [c][256] tables, channel minor */
static PyObject* py_lut(PyObject* self, PyObject* args) {
  (void)self;
  PyObject *ox, *ot, *oy;
  Py_ssize_t c;
  if (!PyArg_ParseTuple(args, "OOOn", &ox, &ot, &oy, &c)) return NULL;
  buf_t x, t, y;
  x.ok = t.ok = y.ok = 0;
  int ok = 0;
  if (c >= 0 && get_buf(ox, &x, 0, -1, "x") == 0 && get_buf(ot, &t, 0, c ? c * 256 : 256, "table") == 0 &&
      get_buf(oy, &y, 1, x.b.len, "out") == 0) {
    if (c && x.b.len % c) {
      PyErr_SetString(PyExc_ValueError, "lut: size is not a multiple of the channel count");
    } else {
      Py_BEGIN_ALLOW_THREADS
      qt_lut((const uint8_t*)x.b.buf, (const uint8_t*)t.b.buf, (uint8_t*)y.b.buf, (size_t)x.b.len, c);
      Py_END_ALLOW_THREADS
      ok = 1;
    }
  }
  rel(&x); rel(&t); rel(&y);
  if (!ok) return NULL;
  Py_RETURN_NONE;
}

/* ---- float32 transformer ops (operators-transformer.c); every buffer float32 C-contiguous */
static int opt_buf(PyObject* o, buf_t* bt, Py_ssize_t need, const char* what) {
  bt->ok = 0;
  if (o == Py_None) return 0;
  return get_buf(o, bt, 0, need, what);
}

/* layernorm(x, x2|None, s|None, gamma|None, beta|None, y, rows, n, eps): of x (+ x2, kept in s) */
static PyObject* py_layernorm(PyObject* self, PyObject* args) {
  (void)self;
  PyObject *ox, *ox2, *os, *og, *ob, *oy;
  Py_ssize_t rows, n;
  float eps;
  if (!PyArg_ParseTuple(args, "OOOOOOnnf", &ox, &ox2, &os, &og, &ob, &oy, &rows, &n, &eps)) return NULL;
  if (rows < 0 || n < 1) {
    PyErr_SetString(PyExc_ValueError, "layernorm: bad dimensions");
    return NULL;
  }
  buf_t x, x2, s, g, b, y;
  x.ok = x2.ok = s.ok = g.ok = b.ok = y.ok = 0;
  int ok = 0;
  if (get_buf(ox, &x, 0, rows * n * 4, "x") == 0 && opt_buf(ox2, &x2, rows * n * 4, "residual") == 0 &&
      (os == Py_None || get_buf(os, &s, 1, rows * n * 4, "sum") == 0) && opt_buf(og, &g, n * 4, "gamma") == 0 &&
      opt_buf(ob, &b, n * 4, "beta") == 0 && get_buf(oy, &y, 1, rows * n * 4, "out") == 0) {
    Py_BEGIN_ALLOW_THREADS
    qt_f32_layernorm((const float*)x.b.buf, x2.ok ? (const float*)x2.b.buf : NULL, s.ok ? (float*)s.b.buf : NULL,
                     g.ok ? (const float*)g.b.buf : NULL, b.ok ? (const float*)b.b.buf : NULL, (float*)y.b.buf, rows, n,
                     eps);
    Py_END_ALLOW_THREADS
    ok = 1;
  }
  rel(&x); rel(&x2); rel(&s); rel(&g); rel(&b); rel(&y);
  if (!ok) return NULL;
  Py_RETURN_NONE;
}

/* softmax(x, y, rows, n, k, div, mask|None, mask_rows): div -1 plain; 0/1: of x * k or x / k, plus
 * the mask's row r / (rows / mask_rows) when given */
static PyObject* py_softmax(PyObject* self, PyObject* args) {
  (void)self;
  PyObject *ox, *oy, *om;
  Py_ssize_t rows, n, mrows;
  float k;
  int div;
  if (!PyArg_ParseTuple(args, "OOnnfiOn", &ox, &oy, &rows, &n, &k, &div, &om, &mrows)) return NULL;
  if (rows < 0 || n < 1 || mrows < 1 || rows % mrows) {
    PyErr_SetString(PyExc_ValueError, "softmax: bad dimensions");
    return NULL;
  }
  buf_t x, y, m;
  x.ok = y.ok = m.ok = 0;
  int ok = 0;
  if (get_buf(ox, &x, 0, rows * n * 4, "x") == 0 && get_buf(oy, &y, 1, rows * n * 4, "out") == 0 &&
      opt_buf(om, &m, mrows * n * 4, "mask") == 0) {
    Py_BEGIN_ALLOW_THREADS
    qt_f32_softmax((const float*)x.b.buf, (float*)y.b.buf, rows, n, k, div, m.ok ? (const float*)m.b.buf : NULL,
                   (size_t)(rows / mrows));
    Py_END_ALLOW_THREADS
    ok = 1;
  }
  rel(&x); rel(&y); rel(&m);
  if (!ok) return NULL;
  Py_RETURN_NONE;
}

/* gelu(x, y, k_in, div, k_add, k_out); erf(x, y) */
static PyObject* py_gelu(PyObject* self, PyObject* args) {
  (void)self;
  PyObject *ox, *oy;
  float k_in, k_add, k_out;
  int div;
  if (!PyArg_ParseTuple(args, "OOfiff", &ox, &oy, &k_in, &div, &k_add, &k_out)) return NULL;
  buf_t x, y;
  x.ok = y.ok = 0;
  int ok = 0;
  if (get_buf(ox, &x, 0, -1, "x") == 0 && get_buf(oy, &y, 1, x.b.len, "out") == 0) {
    Py_BEGIN_ALLOW_THREADS
    qt_f32_gelu((const float*)x.b.buf, (float*)y.b.buf, (size_t)x.b.len / 4, k_in, div, k_add, k_out);
    Py_END_ALLOW_THREADS
    ok = 1;
  }
  rel(&x); rel(&y);
  if (!ok) return NULL;
  Py_RETURN_NONE;
}

static PyObject* py_erf(PyObject* self, PyObject* args) {
  (void)self;
  PyObject *ox, *oy;
  if (!PyArg_ParseTuple(args, "OO", &ox, &oy)) return NULL;
  buf_t x, y;
  x.ok = y.ok = 0;
  int ok = 0;
  if (get_buf(ox, &x, 0, -1, "x") == 0 && get_buf(oy, &y, 1, x.b.len, "out") == 0) {
    Py_BEGIN_ALLOW_THREADS
    qt_f32_erf((const float*)x.b.buf, (float*)y.b.buf, (size_t)x.b.len / 4);
    Py_END_ALLOW_THREADS
    ok = 1;
  }
  rel(&x); rel(&y);
  if (!ok) return NULL;
  Py_RETURN_NONE;
}

/* dynamic_quantize(x_f32, y_u8, scale_f32[1], zp_u8[1]) */
static PyObject* py_dynamic_quantize(PyObject* self, PyObject* args) {
  (void)self;
  PyObject *ox, *oy, *os, *oz;
  if (!PyArg_ParseTuple(args, "OOOO", &ox, &oy, &os, &oz)) return NULL;
  buf_t x, y, s, z;
  x.ok = y.ok = s.ok = z.ok = 0;
  int ok = 0;
  if (get_buf(ox, &x, 0, -1, "x") == 0 && get_buf(oy, &y, 1, x.b.len / 4, "out") == 0 &&
      get_buf(os, &s, 1, 4, "scale") == 0 && get_buf(oz, &z, 1, 1, "zero point") == 0) {
    Py_BEGIN_ALLOW_THREADS
    qt_dynamic_quantize((const float*)x.b.buf, (uint8_t*)y.b.buf, (size_t)x.b.len / 4, (float*)s.b.buf,
                        (uint8_t*)z.b.buf);
    Py_END_ALLOW_THREADS
    ok = 1;
  }
  rel(&x); rel(&y); rel(&s); rel(&z);
  if (!ok) return NULL;
  Py_RETURN_NONE;
}

/* dynamic_quantize_scaled(x_f32 [rows, n], m_f32 [n], y_u8, scale_f32[1], zp_u8[1]): of x * m */
static PyObject* py_dynamic_quantize_scaled(PyObject* self, PyObject* args) {
  (void)self;
  PyObject *ox, *om, *oy, *os, *oz;
  if (!PyArg_ParseTuple(args, "OOOOO", &ox, &om, &oy, &os, &oz)) return NULL;
  buf_t x, m, y, s, z;
  x.ok = m.ok = y.ok = s.ok = z.ok = 0;
  int ok = 0;
  if (get_buf(ox, &x, 0, -1, "x") == 0 && get_buf(om, &m, 0, -1, "multiplier") == 0 &&
      get_buf(oy, &y, 1, x.b.len / 4, "out") == 0 && get_buf(os, &s, 1, 4, "scale") == 0 &&
      get_buf(oz, &z, 1, 1, "zero point") == 0) {
    const size_t n = (size_t)m.b.len / 4, count = (size_t)x.b.len / 4;
    if (n == 0 || count % n) {
      PyErr_Format(PyExc_ValueError, "x of %zu values is not rows of the multiplier's %zu", count, n);
    } else {
      Py_BEGIN_ALLOW_THREADS
      qt_dynamic_quantize_scaled((const float*)x.b.buf, (const float*)m.b.buf, count / n, n, (uint8_t*)y.b.buf,
                                 (float*)s.b.buf, (uint8_t*)z.b.buf);
      Py_END_ALLOW_THREADS
      ok = 1;
    }
  }
  rel(&x); rel(&m); rel(&y); rel(&s); rel(&z);
  if (!ok) return NULL;
  Py_RETURN_NONE;
}

/* dynamic_epilogue(y_f32 [rows, n], rows, n, scale_f32[1], zp_u8[1], colsum_f32[n], w_scale_f32[n], bias|None) */
static PyObject* py_dynamic_epilogue(PyObject* self, PyObject* args) {
  (void)self;
  PyObject *oy, *os, *oz, *oc, *ow, *ob;
  Py_ssize_t rows, n;
  if (!PyArg_ParseTuple(args, "OnnOOOOO", &oy, &rows, &n, &os, &oz, &oc, &ow, &ob)) return NULL;
  if (rows < 0 || n < 1) {
    PyErr_SetString(PyExc_ValueError, "dynamic_epilogue: bad dimensions");
    return NULL;
  }
  buf_t y, s, z, c, w, b;
  y.ok = s.ok = z.ok = c.ok = w.ok = b.ok = 0;
  int rc = -2;
  if (get_buf(oy, &y, 1, rows * n * 4, "out") == 0 && get_buf(os, &s, 0, 4, "scale") == 0 &&
      get_buf(oz, &z, 0, 1, "zero point") == 0 && get_buf(oc, &c, 0, n * 4, "colsum") == 0 &&
      get_buf(ow, &w, 0, n * 4, "w_scale") == 0 && opt_buf(ob, &b, n * 4, "bias") == 0) {
    const float scale = *(const float*)s.b.buf;
    const int32_t zp = *(const uint8_t*)z.b.buf;
    Py_BEGIN_ALLOW_THREADS
    rc = qt_dynamic_epilogue((float*)y.b.buf, rows, n, scale, zp, (const float*)c.b.buf, (const float*)w.b.buf,
                             b.ok ? (const float*)b.b.buf : NULL);
    Py_END_ALLOW_THREADS
    if (rc == -1) PyErr_NoMemory();
  }
  rel(&y); rel(&s); rel(&z); rel(&c); rel(&w); rel(&b);
  if (rc != 0) return NULL;
  Py_RETURN_NONE;
}

/* matmul(a, b, y): float32 y[..., M, N] (C-contiguous) = a[..., M, K] @ b[..., K, N], a and b any
 * strided float32 arrays whose leading dims broadcast to y's (numpy's matmul) */
static int batch_offsets(const Py_buffer* v, const Py_buffer* y, size_t batch, ptrdiff_t* off) {
  const int yl = y->ndim - 2, vl = v->ndim - 2;
  if (vl > yl) return -1;
  for (int d = 0; d < vl; d++) {
    const Py_ssize_t vs = v->shape[d], ys = y->shape[yl - vl + d];
    if (vs != 1 && vs != ys) return -1;
    if (v->strides[d] % 4) return -1;
  }
  for (size_t i = 0; i < batch; i++) {
    size_t rest = i;
    ptrdiff_t o = 0;
    for (int d = yl - 1; d >= 0; d--) {
      const size_t idx = rest % (size_t)y->shape[d];
      rest /= (size_t)y->shape[d];
      const int vd = d - (yl - vl);
      if (vd >= 0 && v->shape[vd] != 1) o += (ptrdiff_t)idx * (v->strides[vd] / 4);
    }
    off[i] = o;
  }
  return 0;
}

static PyObject* py_matmul(PyObject* self, PyObject* args) {
  (void)self;
  PyObject *oa, *ob, *oy;
  if (!PyArg_ParseTuple(args, "OOO", &oa, &ob, &oy)) return NULL;
  Py_buffer a, b;
  buf_t y;
  y.ok = 0;
  if (PyObject_GetBuffer(oa, &a, PyBUF_RECORDS_RO) != 0) return NULL;
  if (PyObject_GetBuffer(ob, &b, PyBUF_RECORDS_RO) != 0) {
    PyBuffer_Release(&a);
    return NULL;
  }
  int rc = -2;
  ptrdiff_t* off = NULL;
  if (get_buf(oy, &y, 1, -1, "out") == 0) {
    const int ok_types = a.itemsize == 4 && b.itemsize == 4 && a.format && b.format && !strcmp(a.format, "f") &&
                         !strcmp(b.format, "f") && a.ndim >= 2 && b.ndim >= 2 && y.b.ndim >= 2;
    size_t batch = 1;
    for (int d = 0; ok_types && d < y.b.ndim - 2; d++) batch *= (size_t)y.b.shape[d];
    const Py_ssize_t m = ok_types ? a.shape[a.ndim - 2] : 0, k = ok_types ? a.shape[a.ndim - 1] : 0;
    const Py_ssize_t n = ok_types ? b.shape[b.ndim - 1] : 0;
    off = ok_types ? (ptrdiff_t*)malloc(2 * batch * sizeof(ptrdiff_t) + 1) : NULL;
    if (!ok_types || !off || b.shape[b.ndim - 2] != k || y.b.shape[y.b.ndim - 2] != m ||
        y.b.shape[y.b.ndim - 1] != n || y.b.len != (Py_ssize_t)(batch * m * n * 4) ||
        a.strides[a.ndim - 1] % 4 || a.strides[a.ndim - 2] % 4 || b.strides[b.ndim - 1] % 4 ||
        b.strides[b.ndim - 2] % 4 || batch_offsets(&a, &y.b, batch, off) || batch_offsets(&b, &y.b, batch, off + batch)) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "matmul: float32 a [..., M, K], b [..., K, N] and out [..., M, N] expected");
    } else {
      Py_BEGIN_ALLOW_THREADS
      rc = qt_f32_matmul((const float*)a.buf, (const float*)b.buf, (float*)y.b.buf, batch, off, off + batch,
                         (size_t)m, (size_t)n, (size_t)k, a.strides[a.ndim - 2] / 4, a.strides[a.ndim - 1] / 4,
                         b.strides[b.ndim - 2] / 4, b.strides[b.ndim - 1] / 4);
      Py_END_ALLOW_THREADS
      if (rc == -1) PyErr_NoMemory();
    }
  }
  free(off);
  PyBuffer_Release(&a);
  PyBuffer_Release(&b);
  rel(&y);
  if (rc != 0) return NULL;
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"matmul", py_matmul, METH_VARARGS, "float32 batched MatMul of strided arrays"},
    {"layernorm", py_layernorm, METH_VARARGS, "float32 LayerNormalization over rows"},
    {"softmax", py_softmax, METH_VARARGS, "float32 Softmax over rows"},
    {"gelu", py_gelu, METH_VARARGS, "float32 erf GELU as exporters write it"},
    {"erf", py_erf, METH_VARARGS, "float32 erf"},
    {"dynamic_quantize", py_dynamic_quantize, METH_VARARGS, "DynamicQuantizeLinear (float32 -> uint8, scale, zp)"},
    {"dynamic_quantize_scaled", py_dynamic_quantize_scaled, METH_VARARGS, "DynamicQuantizeLinear of x * m, m a row [n]"},
    {"dynamic_epilogue", py_dynamic_epilogue, METH_VARARGS, "the dynamic MatMul's float32 epilogue"},
    {"mul", py_mul, METH_VARARGS, "quantized multiply (ORT QLinearMul rounding)"},
    {"lut", py_lut, METH_VARARGS, "uint8 table lookup"},
    {"quantize", py_quantize, METH_VARARGS, "float32 NCHW -> uint8 NHWC (QuantizeLinear)"},
    {"dequantize", py_dequantize, METH_VARARGS, "uint8 NHWC -> float32 NCHW (DequantizeLinear)"},
    {"info", py_info, METH_NOARGS, "CPU features and the selected ISA"},
    {"set_isa", py_set_isa, METH_VARARGS, "force an ISA (0 scalar, 1 avx2, 2 avx512vnni, 3 amx; -1 best)"},
    {"get_isa", py_get_isa, METH_NOARGS, "selected ISA"},
    {"set_num_threads", py_set_num_threads, METH_VARARGS, "threads used by the kernels"},
    {"get_num_threads", py_get_num_threads, METH_NOARGS, "threads used by the kernels"},
    {"set_spin_ns", py_set_spin_ns, METH_VARARGS, "how long idle pool workers spin before sleeping (ns)"},
    {"get_spin_ns", py_get_spin_ns, METH_NOARGS, "how long idle pool workers spin before sleeping (ns)"},
    {"pool_prewake", py_pool_prewake, METH_NOARGS,
     "wake sleeping pool workers (they spin for the spin time) and return at once"},
    {"pool_sleeping", py_pool_sleeping, METH_NOARGS, "pool workers asleep now"},
    {"pool_wake_ns", py_pool_wake_ns, METH_VARARGS,
     "ns from posting a job to a worker starting it, one sample (1: worker asleep, 0: spinning); < 0: none"},
    {"pause_ns", py_pause_ns, METH_NOARGS, "ns one pause instruction takes here"},
    {"set_kblock", py_set_kblock, METH_VARARGS, "K blocking of large igemm panels: 0 off, 1 on, 2 forced (objects packed later)"},
    {"peak_gmacs", py_peak_gmacs, METH_VARARGS,
     "GMAC/s of a register-only loop of a GEMM mix on this thread (1 avx2, 2 avx2 exact, 3 avx512vnni)"},
    {"get_exact_only", py_get_exact_only, METH_NOARGS, "see set_exact_only"},
    {"set_exact_only", py_set_exact_only, METH_VARARGS,
     "1: objects packed afterwards use the exact 16-bit kernels where the tier has them (AVX2)"},
    {"set_parallel_min_ns", py_set_parallel_min_ns, METH_VARARGS,
     "ops estimated below this many ns run on the calling thread"},
    {"conv_create", py_conv_create, METH_VARARGS, "pack a convolution / GEMM"},
    {"conv_info", py_conv_info, METH_VARARGS, "kernel of a packed convolution"},
    {"conv_run", py_conv_run, METH_VARARGS, "run a packed convolution"},
    {"f32_deconv", py_f32_deconv, METH_VARARGS, "float32 ConvTranspose, NCHW"},
    {"deconv_run", py_deconv_run, METH_VARARGS, "run a ConvTranspose packed as one convolution per phase"},
    {"add", py_add, METH_VARARGS, "quantized add"},
    {"pool", py_pool, METH_VARARGS, "max / average pooling"},
    {"concat", py_concat, METH_VARARGS, "requantizing concat"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_native", "qtool native INT8 kernels", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&moddef); }
