/* The peak a tier's GEMM can reach on the machine at hand: a register-only loop of the
 * microkernel's instruction mix (no loads, no stores), timed on the calling thread. `qtool bench
 * --profile` and benchmarks/bench_kernels.py report GMAC/s as a share of it.
 *   avx2:       vpshufb + vpmaddubsw + vpmaddwd(ones) + vpaddd per 32 MACs (the igemm kernel's
 *               inner step, qu8-igemm-avx2-maddubs.c)
 *   avx2 exact: 2 vpshufb + 4 x (vpmaddwd + vpaddd) per 64 MACs (qu8-igemm-avx2.c)
 *   avx512vnni: vpdpbusd zmm, 64 MACs
 * The AMX tier's tdpbusd peak is not measured here (bench_kernels.py keeps a recorded figure). */
#include <time.h>

#include "qtool_kernels.h"

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#if QT_X86
#define CLOBBER_YMM "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", \
    "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"
#define R8(op) op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7)
/* ymm0-7 accumulators, ymm8 input, ymm9/10 control, ymm11/12 weights, ymm13 ones, ymm14/15 temps */
#define MADDUBS(i) "vpshufb %%ymm9, %%ymm8, %%ymm14\n\t" "vpmaddubsw %%ymm11, %%ymm14, %%ymm14\n\t" \
    "vpmaddwd %%ymm13, %%ymm14, %%ymm14\n\t" "vpaddd %%ymm14, %%ymm" #i ", %%ymm" #i "\n\t"
#define EXACT(i) "vpshufb %%ymm9, %%ymm8, %%ymm14\n\t" "vpshufb %%ymm10, %%ymm8, %%ymm15\n\t"  \
    "vpmaddwd %%ymm11, %%ymm14, %%ymm12\n\t" "vpaddd %%ymm12, %%ymm" #i ", %%ymm" #i "\n\t"   \
    "vpmaddwd %%ymm13, %%ymm14, %%ymm12\n\t" "vpaddd %%ymm12, %%ymm" #i ", %%ymm" #i "\n\t"   \
    "vpmaddwd %%ymm11, %%ymm15, %%ymm12\n\t" "vpaddd %%ymm12, %%ymm" #i ", %%ymm" #i "\n\t"   \
    "vpmaddwd %%ymm13, %%ymm15, %%ymm12\n\t" "vpaddd %%ymm12, %%ymm" #i ", %%ymm" #i "\n\t"

QT_TARGET_AVX2 static void loop_maddubs(long n) {
  __asm__ volatile("vpxor %%xmm8, %%xmm8, %%xmm8\n\t" "vpxor %%xmm9, %%xmm9, %%xmm9\n\t"
                   "vpxor %%xmm11, %%xmm11, %%xmm11\n\t" "vpxor %%xmm13, %%xmm13, %%xmm13\n\t"
                   "1:\n\t" R8(MADDUBS) "dec %0\n\t" "jnz 1b\n\t"
                   : "+r"(n) : : "memory", CLOBBER_YMM);
}

QT_TARGET_AVX2 static void loop_exact(long n) {
  __asm__ volatile("vpxor %%xmm8, %%xmm8, %%xmm8\n\t" "vpxor %%xmm9, %%xmm9, %%xmm9\n\t"
                   "vpxor %%xmm10, %%xmm10, %%xmm10\n\t" "vpxor %%xmm11, %%xmm11, %%xmm11\n\t"
                   "vpxor %%xmm13, %%xmm13, %%xmm13\n\t"
                   "1:\n\t" R8(EXACT) "dec %0\n\t" "jnz 1b\n\t"
                   : "+r"(n) : : "memory", CLOBBER_YMM);
}

#define R12(op) op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7) op(8) op(9) op(10) op(11)
#define DPBUSD(i) "vpdpbusd %%zmm14, %%zmm13, %%zmm" #i "\n\t"
QT_TARGET_AVX512VNNI static void loop_vnni(long n) {
  __asm__ volatile("vpxord %%zmm13, %%zmm13, %%zmm13\n\t" "vpxord %%zmm14, %%zmm14, %%zmm14\n\t"
                   "1:\n\t" R12(DPBUSD) "dec %0\n\t" "jnz 1b\n\t"
                   : "+r"(n) : : "memory", CLOBBER_YMM);
}
#endif

double qt_peak_gmacs(int kind, double seconds) {
#if QT_X86
  void (*loop)(long) = NULL;
  double macs_per_iter = 0;
  if (kind == QT_PEAK_AVX2) { loop = loop_maddubs; macs_per_iter = 8 * 32; }
  else if (kind == QT_PEAK_AVX2_EXACT) { loop = loop_exact; macs_per_iter = 8 * 64; }
  else if (kind == QT_PEAK_AVX512VNNI) { loop = loop_vnni; macs_per_iter = 12 * 64; }
  if (!loop) return 0.0;
  /* best of short chunks: on a shared machine the least disturbed one is the machine's peak */
  const long n = 20000;
  double best = 0.0, t_end = now_s() + (seconds > 0 ? seconds : 0.02);
  loop(n);
  do {
    double t = now_s();
    loop(n);
    t = now_s() - t;
    const double r = (double)n * macs_per_iter / t / 1e9;
    if (r > best) best = r;
  } while (now_s() < t_end);
  return best;
#else
  (void)kind; (void)seconds;
  return 0.0;
#endif
}
