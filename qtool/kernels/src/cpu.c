/* CPU feature detection (cpuid + xgetbv) and the one dispatch table, walked
 * AVX-512 VNNI -> AVX2 -> portable C. QTOOL_ISA caps the choice; it never goes above
 * what the CPU and the OS (saved zmm/ymm state) support. */
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "qtool_kernels.h"

#if QT_X86
#include <cpuid.h>
static uint64_t qt_xgetbv0(void) {
  uint32_t eax, edx;
  __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(eax), "=d"(edx) : "c"(0));
  return ((uint64_t)edx << 32) | eax;
}
#endif

static qt_cpu_features g_cpu;
static int g_cpu_done = 0;

const qt_cpu_features* qt_cpu(void) {
  if (g_cpu_done) return &g_cpu;
  memset(&g_cpu, 0, sizeof(g_cpu));
#if QT_X86
  unsigned a, b, c, d;
  if (__get_cpuid(0, &a, &b, &c, &d) && a >= 7) {
    unsigned max_leaf = a;
    __cpuid(1, a, b, c, d);
    int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1;
    g_cpu.fma = (c >> 12) & 1;
    if (osxsave) {
      uint64_t xcr0 = qt_xgetbv0();
      g_cpu.os_ymm = avx && (xcr0 & 0x6) == 0x6;                 /* SSE + AVX state */
      g_cpu.os_zmm = g_cpu.os_ymm && (xcr0 & 0xE0) == 0xE0;      /* opmask, ZMM_Hi256, Hi16_ZMM */
    }
    if (max_leaf >= 7) {
      __cpuid_count(7, 0, a, b, c, d);
      g_cpu.avx2 = (b >> 5) & 1;
      g_cpu.avx512f = (b >> 16) & 1;
      g_cpu.avx512dq = (b >> 17) & 1;
      g_cpu.avx512bw = (b >> 30) & 1;
      g_cpu.avx512vl = (b >> 31) & 1;
      g_cpu.avx512vnni = (c >> 11) & 1;
      g_cpu.avx512vbmi = (c >> 1) & 1;
      g_cpu.amx_int8 = ((d >> 24) & 1) && ((d >> 25) & 1);  /* AMX-TILE, AMX-INT8 */
    }
#if defined(__linux__) && defined(__x86_64__) && defined(SYS_arch_prctl)
    /* Linux enables the 8 KB tile state per process on request (ARCH_REQ_XCOMP_PERM, 0x1023,
     * feature 18 = XTILEDATA); XCR0 bits 17-18 say the OS manages it at all. */
    if (g_cpu.amx_int8 && osxsave && (qt_xgetbv0() & 0x60000) == 0x60000)
      g_cpu.os_amx = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#endif
  }
#endif
  g_cpu_done = 1;
  return &g_cpu;
}

int qt_best_isa(void) {
  const qt_cpu_features* f = qt_cpu();
  if (f->os_zmm && f->avx512f && f->avx512bw && f->avx512vl && f->avx512dq && f->avx512vnni &&
      f->avx2 && f->fma && f->amx_int8 && f->os_amx)
    return QT_ISA_AMX;
  if (f->os_zmm && f->avx512f && f->avx512bw && f->avx512vl && f->avx512dq && f->avx512vnni &&
      f->avx2 && f->fma)
    return QT_ISA_AVX512VNNI;
  if (f->os_ymm && f->avx2 && f->fma) return QT_ISA_AVX2;
  return QT_ISA_SCALAR;
}

const char* qt_isa_name(int isa) {
  switch (isa) {
    case QT_ISA_AMX: return "amx";
    case QT_ISA_AVX512VNNI: return "avx512vnni";
    case QT_ISA_AVX2: return "avx2";
    default: return "scalar";
  }
}

static qt_dispatch g_tables[QT_ISA_COUNT];
static int g_tables_done = 0;
static int g_isa = -1;

static void qt_init_tables(void) {
  if (g_tables_done) return;
  for (int isa = 0; isa < QT_ISA_COUNT; isa++) {
    qt_dispatch* d = &g_tables[isa];
    memset(d, 0, sizeof(*d));
    d->isa = isa;
    d->isa_name = qt_isa_name(isa);
    /* the AMX tier is the AVX-512 VNNI tier with convolutions and GEMMs on tiles (depthwise,
     * elementwise and pools stay on AVX-512) */
    const int vec = isa == QT_ISA_AMX ? QT_ISA_AVX512VNNI : isa;
    /* AVX2: vpmaddubsw where the packer proves (or makes) every int16 pair safe, the exact
     * 16-bit kernels kept beside it for comparison (qt_set_exact_only) */
    d->igemm = vec == QT_ISA_AVX512VNNI ? qt_igemm_avx512vnni
             : vec == QT_ISA_AVX2 ? qt_igemm_avx2_maddubs : qt_igemm_scalar;
    if (vec == QT_ISA_AVX2) {
      d->igemm_exact = qt_igemm_avx2;
      d->dwconv_exact = qt_dwconv_avx2;
    }
    if (isa == QT_ISA_AMX) d->amx = qt_gemm_amx;
    d->dwconv = vec == QT_ISA_AVX512VNNI ? qt_dwconv_avx512vnni
              : vec == QT_ISA_AVX2 ? qt_dwconv_avx2_maddubs : qt_dwconv_scalar;
    qt_fill_elementwise(d, vec);
    qt_fill_transformer(d, vec);
    d->lut = qu8_lut_ukernel__scalar;
    d->lut_name = "qu8_lut_ukernel__scalar";
    d->interleave3 = qu8_interleave3_ukernel__scalar;
#if QT_X86
    /* the VBMI table lookup rides on the AVX-512 tier (its own feature bit is checked too) */
    if (vec == QT_ISA_AVX512VNNI && qt_cpu()->avx512vbmi) {
      d->lut = qu8_lut_ukernel__avx512vbmi;
      d->lut_name = "qu8_lut_ukernel__avx512vbmi";
      d->interleave3 = qu8_interleave3_ukernel__avx512vbmi;
    }
#endif
  }
  g_tables_done = 1;
}

const qt_dispatch* qt_dispatch_for(int isa) {
  qt_init_tables();
  return &g_tables[isa];
}

int qt_set_isa(int isa) {
  int best = qt_best_isa();
  if (isa < 0 || isa > best) isa = best;
  g_isa = isa;
  return g_isa;
}

const qt_dispatch* qt_get_dispatch(void) {
  qt_init_tables();
  if (g_isa < 0) {
    int isa = qt_best_isa();
    const char* env = getenv("QTOOL_ISA");
    if (env && *env) {
      if (!strcmp(env, "scalar")) isa = QT_ISA_SCALAR;
      else if (!strcmp(env, "avx2")) isa = isa < QT_ISA_AVX2 ? isa : QT_ISA_AVX2;
      else if (!strcmp(env, "avx512vnni")) isa = isa < QT_ISA_AVX512VNNI ? isa : QT_ISA_AVX512VNNI;
      else if (!strcmp(env, "amx")) isa = isa < QT_ISA_AMX ? isa : QT_ISA_AMX;
    }
    g_isa = isa;
  }
  return &g_tables[g_isa];
}
