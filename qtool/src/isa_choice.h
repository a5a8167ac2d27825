/* The ISA choice of qtool's small native modules (calibrate/_histogram, fuse/_pair_cost): each picks its
 * path once from the CPU's features (AVX-512F, AVX2, portable C), capped by QTOOL_ISA as the int8
 * kernels are; isa() and set_isa() let tests run every path the CPU has. One copy per module (static):
 * include it once, call isa_choose() in the module's init, list ISA_METHODS in its method table. */
#ifndef QTOOL_ISA_CHOICE_H
#define QTOOL_ISA_CHOICE_H
#include <Python.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(_M_X64)
#define QT_X86 1
#endif

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
static const char *ISA_NAMES[] = {"scalar", "avx2", "avx512"};
static int g_isa = ISA_SCALAR, g_isa_max = ISA_SCALAR;

static PyObject *get_isa(PyObject *self, PyObject *noargs) { return PyUnicode_FromString(ISA_NAMES[g_isa]); }

static int isa_from_name(const char *name) {
    if (!strcmp(name, "avx512") || !strcmp(name, "avx512vnni")) return ISA_AVX512;
    if (!strcmp(name, "avx2")) return ISA_AVX2;
    if (!strcmp(name, "scalar")) return ISA_SCALAR;
    return -1;
}

static PyObject *set_isa(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    int want = isa_from_name(name);
    if (want < 0) {
        PyErr_Format(PyExc_ValueError, "set_isa: unknown ISA '%s' (avx512, avx2, scalar)", name);
        return NULL;
    }
    int prev = g_isa;
    g_isa = want < g_isa_max ? want : g_isa_max; /* never above what the CPU has */
    return PyUnicode_FromString(ISA_NAMES[prev]);
}

/* the best path this CPU has, then QTOOL_ISA's cap */
static void isa_choose(void) {
#ifdef QT_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        g_isa_max = ISA_AVX512;
    else if (__builtin_cpu_supports("avx2"))
        g_isa_max = ISA_AVX2;
#endif
    g_isa = g_isa_max;
    const char *env = getenv("QTOOL_ISA");
    if (env && *env) {
        int want = isa_from_name(env);
        if (want >= 0 && want < g_isa) g_isa = want;
    }
}

#define ISA_METHODS                                                                            \
    {"isa", get_isa, METH_NOARGS, "isa() -> the path in use: avx512, avx2 or scalar"},         \
    {"set_isa", set_isa, METH_VARARGS, "set_isa(name) -> previous; capped at what the CPU supports"}

#endif
