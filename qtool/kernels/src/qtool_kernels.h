/* qtool native INT8 kernels: shared types, microkernel signatures, dispatch table.
 *
 * Naming follows XNNPACK: <types>_<op>_<activation>_<requant>_ukernel_<tile>__<isa>.
 *   qu8_qs8w_igemm_minmax_fp32_ukernel_8x32c4__avx512vnni: u8 activations x s8 weights,
 *   indirect GEMM, min/max clamp, fp32 requantization, tile MR=8 x NR=32, K in groups of 4.
 *
 * Epilogue (identical to qtool.qparams.requantize, and to ONNX Runtime/MLAS, which clamps in
 * float before rounding; clamping to integer bounds commutes with round-half-even):
 *   y = clamp(float(acc) * mult[c], lo - zp, hi - zp);  out = rint_half_even(y) + zp
 */
#ifndef QTOOL_KERNELS_H
#define QTOOL_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define QT_X86 1
#else
#define QT_X86 0
#endif

#define QT_TARGET_AVX2 __attribute__((target("avx2,fma,bmi2")))
#define QT_TARGET_AVX512VNNI __attribute__((target("avx2,fma,bmi2,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define QT_INLINE static inline __attribute__((always_inline))

enum qt_isa { QT_ISA_SCALAR = 0, QT_ISA_AVX2 = 1, QT_ISA_AVX512VNNI = 2, QT_ISA_AMX = 3, QT_ISA_COUNT = 4 };

/* Requantization parameters shared by all u8-output kernels. */
typedef struct {
  int32_t zp;        /* output zero point */
  int32_t lo, hi;    /* output clamp in u8 (fused Relu/Clip) */
  float lo_f, hi_f;  /* lo - zp, hi - zp as float */
  int out_f32;       /* GEMM only: write float32(acc) * mult instead of u8 */
} qt_requant;

/* Round half to even for |v| < 2^22 (values are clamped to [-255, 255] first). */
QT_INLINE float qt_rint_small(float v) {
  const float magic = 12582912.0f; /* 1.5 * 2^23 */
  return (v + magic) - magic;
}

QT_INLINE uint8_t qt_requant_scalar(int32_t acc, float mult, const qt_requant* rq) {
  float y = (float)acc * mult;
  y = y < rq->lo_f ? rq->lo_f : y;
  y = y > rq->hi_f ? rq->hi_f : y;
  return (uint8_t)((int32_t)qt_rint_small(y) + rq->zp);
}

/* Indirect GEMM microkernel. One NR-wide panel of packed weights, up to MR rows.
 *   ind: [ks][MR] byte offsets into x (one per tap and row); a negative offset means padding,
 *        which reads `zero` (kc bytes filled with the input zero point).
 *   w:   packed panel: int32 bias[NR] (zero-point compensated), float mult[NR], then weights
 *        in the ISA's layout for ks taps x kc (padded to KR).
 *   c:   output row 0; rows are cm_stride bytes apart; nc <= NR valid columns (u8 or f32). */
typedef void (*qt_igemm_ukernel)(size_t mr, size_t nc, size_t kc, size_t ks, const intptr_t* ind,
                                 const uint8_t* x, const uint8_t* zero, const void* w, void* c,
                                 size_t cm_stride, const qt_requant* rq);

/* Depthwise microkernel: one output row segment of `ow` pixels, all channels.
 *   in: input pointers; pixel p's ks tap pointers are in[p * in_step .. + ks) in the packed tap
 *       order (kx major, ky minor), so with in_step = stride * KH neighbouring pixels share their
 *       overlapping columns (XNNPACK's indirection "step"). A pointer equal to `zero` is padding
 *       (a zp-filled buffer of >= channels bytes); any other gets `in_offset` added.
 *   w:  packed per channel tile (ISA layout); out: ow x channels u8, pixels out_stride apart. */
typedef void (*qt_dwconv_ukernel)(size_t channels, size_t ow, size_t ks, const uint8_t* const* in,
                                  size_t in_step, ptrdiff_t in_offset, const uint8_t* zero, const void* w,
                                  uint8_t* out, size_t out_stride, const qt_requant* rq);
#define QT_DW_MADDUBS_MAX_KS 255  /* its packed tap indices are bytes */
#define QT_DW_PTR(ptr, off, zero) ((ptr) != (zero) ? (ptr) + (off) : (zero))

/* K-blocked igemm: taps [t0, t0 + ks) of a full panel; acc_in NULL = start from the bias;
 * acc_out non-NULL = write MR x NR int32 partial sums instead of the output. */
typedef void (*qt_igemm_acc_ukernel)(size_t mr, size_t nc, size_t kc, size_t t0, size_t ks,
                                     const intptr_t* ind, const uint8_t* x, const uint8_t* zero,
                                     const void* w, const int32_t* acc_in, int32_t* acc_out,
                                     void* c, size_t cm_stride, const qt_requant* rq);

/* vpmaddubsw pairing (qs8-pairing.c): a pair (w_a, w_b) cannot saturate the int16 sum for any u8
 * input when the signs differ (or one is 0) or |w_a + w_b| <= QT_PAIR_LIMIT. */
#define QT_PAIR_LIMIT 128
#define QT_PAIR_BLOCK 16
int qt_pair_is_safe(int a, int b);
/* perm[0..L) (L even, <= QT_PAIR_BLOCK): (perm[2p], perm[2p+1]) are pairs, every one safe.
 * Returns 1 for the natural pairing (0,1), (2,3), ... (tried first), 2 for another, 0 if the
 * greedy search found none (perm is then the natural order). */
int qt_pair_block(const int8_t* w, size_t L, uint8_t* perm);

/* What a pairing packer did with a layer's blocks (one block = one column's L weights). */
typedef struct {
  size_t blocks, natural, reordered, fallback;  /* fallback: igemm split into hi + lo, dwconv on the 16-bit form */
} qt_pair_stats;

typedef struct {
  const char* name;
  qt_igemm_ukernel ukernel;
  size_t mr, nr, kr;   /* tile; kr = K grouping of the packed weights */
  size_t welem;        /* bytes per packed weight element (1 = int8, 2 = int16) */
  qt_igemm_ukernel ukernel_half;  /* optional NR/2-wide variant for a group's last <= NR/2 columns */
  qt_igemm_acc_ukernel ukernel_acc; /* optional K-blocked variant (int32 partial sums in/out) */
  /* optional: the kernel packs its own panels (layout chosen per column, e.g. the vpmaddubsw
   * pairing). wrows[j]: column j's weights [ks][kc]; returns the bytes written (out NULL: the
   * bytes needed) and adds to *st. */
  size_t (*pack_panel)(size_t ks, size_t kc, size_t cols, const int8_t* const* wrows,
                       const int32_t* bias, const float* mult, void* out, qt_pair_stats* st);
} qt_igemm_config;

/* AMX tile GEMM (the "amx" tier; see qu8-gemm-amx.c): A row blocks are packed to [mr][kp]
 * (kp = ks*kc rounded up to 64), weights to 32-column panels of two [kp/4][16][4] halves. */
typedef struct {
  const char* name;
  size_t mr, nr;
  /* mr rows x np panels (panel_bytes apart, the last with nc_last columns); cbuf 32 x 32 */
  void (*ukernel)(size_t mr, size_t np, size_t nc_last, size_t kp, const uint8_t* a,
                  size_t a_stride, const void* w, size_t panel_bytes, void* c, size_t cm_stride,
                  const qt_requant* rq, int32_t* cbuf);
  void (*pack_a)(size_t rows, size_t kc, size_t ks, const intptr_t* ind, const uint8_t* x,
                 const uint8_t* zero, uint8_t* a, size_t kp);
  void (*pack_panel)(size_t kp, size_t kk_n, size_t cols, const int8_t* const* wrows,
                     const int32_t* bias, const float* mult, void* panel);
  void (*begin)(void);   /* configure the tiles on the calling thread */
  void (*end)(void);     /* release them */
} qt_amx_gemm_config;

typedef struct {
  const char* name;
  qt_dwconv_ukernel ukernel;
  size_t ct;           /* channel tile */
  /* packing travels with the kernel: w is [channels][ks] int8 in tap order (kx major), bias
   * int32 (compensated) */
  size_t (*packed_size)(size_t channels, size_t ks);
  void (*pack)(size_t channels, size_t ks, const int8_t* w, const int32_t* bias, const float* mult,
               void* out);
  /* optional, instead of pack: a packer that also reports its pairing (kernels on vpmaddubsw);
   * w in the same packed tap order, kh x kw given so it can pair in ONNX's row-major order */
  void (*pack_paired)(size_t channels, size_t kh, size_t kw, const int8_t* w, const int32_t* bias,
                      const float* mult, void* out, qt_pair_stats* st);
} qt_dwconv_config;

/* Elementwise / pooling kernels, compiled once per ISA from the same C bodies. */
typedef void (*qt_add_fn)(size_t n, const uint8_t* a, const uint8_t* b, uint8_t* y, float ma,
                          int32_t za, float mb, int32_t zb, const qt_requant* rq);
typedef void (*qt_max_fn)(size_t n, const uint8_t* x, uint8_t* acc);           /* acc = max(acc, x) */
typedef void (*qt_sum_fn)(size_t n, const uint8_t* x, int32_t* acc);           /* acc += x */
typedef void (*qt_avg_out_fn)(size_t n, const int32_t* acc, int32_t bias, float m, uint8_t* y,
                              const qt_requant* rq);                            /* y = rq(acc + bias) */
typedef void (*qt_requant_copy_fn)(size_t n, const uint8_t* x, int32_t zx, float m, uint8_t* y,
                                   const qt_requant* rq);

typedef void (*qt_maxpix_fn)(size_t n, size_t nt, const uint8_t* const* taps, uint8_t* y);
typedef void (*qt_sumpix_fn)(size_t n, size_t nt, const uint8_t* const* taps, int32_t* acc);
typedef void (*qt_mul_fn)(size_t n, const uint8_t* a, const uint8_t* b, uint8_t* y, float ratio,
                          int32_t za, int32_t zb, const qt_requant* rq);
typedef void (*qt_quant_row_fn)(size_t n, const float* x, float scale, int32_t zp, uint8_t* y);
typedef void (*qt_lut_fn)(size_t n, const uint8_t* x, const uint8_t* table, uint8_t* y);
/* float32 row kernels of transformer graphs (f32-transformer.c) */
typedef void (*qt_f32_layernorm_fn)(size_t n, const float* x, const float* g, const float* b, float eps,
                                    float* y);
typedef void (*qt_f32_row_fn)(size_t n, const float* x, float* y);
typedef void (*qt_f32_gelu_fn)(size_t n, const float* x, float* y, float k_in, int div, float k_add,
                               float k_out);
typedef void (*qt_f32_scale_add_fn)(size_t n, const float* x, float k, int div, const float* m, float* y);
/* C[mr x nc] = A[mr x kc] (strides a_rs, a_cs floats) B[kc x nc] (rows ldb floats apart), mr <= 8 */
typedef void (*qt_f32_gemm_fn)(size_t mr, size_t nc, size_t kc, const float* a, ptrdiff_t a_rs, ptrdiff_t a_cs,
                               const float* b, size_t ldb, float* c, size_t ldc);
typedef void (*qt_f32_minmax_fn)(size_t n, const float* x, float* mn, float* mx);
typedef void (*qt_f32_dyn_epilogue_fn)(size_t n, float* y, const float* zpcs, const float* m,
                                       const float* bias);

typedef struct {
  int isa;
  const char* isa_name;
  qt_igemm_config igemm;
  qt_amx_gemm_config amx;        /* ukernel NULL below the AMX tier */
  qt_dwconv_config dwconv;
  /* AVX2: the exact 16-bit (vpmaddwd) kernels, chosen instead of igemm/dwconv for objects packed
   * while qt_set_exact_only(1) (benchmarks and tests compare the two); zero on other tiers */
  qt_igemm_config igemm_exact;
  qt_dwconv_config dwconv_exact;
  qt_add_fn add; const char* add_name;
  qt_max_fn vmax;
  qt_sum_fn vsum;
  qt_avg_out_fn avg_out;
  qt_requant_copy_fn requant_copy;
  qt_mul_fn mul;
  qt_maxpix_fn maxpix;
  qt_sumpix_fn sumpix;
  qt_quant_row_fn quant_row;
  qt_lut_fn lut; const char* lut_name;
  void (*interleave3)(size_t n, const uint8_t* p0, const uint8_t* p1, const uint8_t* p2, uint8_t* y);
  qt_f32_layernorm_fn f32_layernorm;
  qt_f32_row_fn f32_softmax, f32_erf;
  qt_f32_gelu_fn f32_gelu;
  qt_f32_scale_add_fn f32_scale_add;
  qt_f32_gemm_fn f32_gemm;
  qt_f32_minmax_fn f32_minmax;
  qt_f32_dyn_epilogue_fn f32_dyn_epilogue;
} qt_dispatch;

/* cpu.c */
typedef struct {
  int avx2, fma, avx512f, avx512bw, avx512vl, avx512dq, avx512vnni, avx512vbmi, os_ymm, os_zmm;
  int amx_int8, os_amx;  /* os_amx: XCR0 tile state enabled and the process got permission */
} qt_cpu_features;
const qt_cpu_features* qt_cpu(void);
int qt_best_isa(void);
const qt_dispatch* qt_get_dispatch(void);          /* currently selected table */
const qt_dispatch* qt_dispatch_for(int isa);
int qt_set_isa(int isa);                            /* returns the ISA actually selected */
const char* qt_isa_name(int isa);

/* threadpool.c: run fn(ctx, begin, end) over [0, n) in contiguous chunks on the pool.
 * `est_ns` is the caller's estimate of the single-thread run time: jobs below
 * QT_PARALLEL_MIN_NS run on the calling thread alone (a hand-off costs microseconds, and much
 * more when the other core is busy with another process). */
#define QT_PARALLEL_MIN_NS 15000
typedef void (*qt_task_fn)(void* ctx, size_t begin, size_t end);
void qt_parallel(size_t n, qt_task_fn fn, void* ctx, double est_ns);
void qt_set_parallel_min_ns(double ns);
void qt_pool_stats(size_t* jobs, size_t* chunks, size_t* worker_chunks);  /* tests set 0 to thread every op */
void qt_set_num_threads(int n);
int qt_get_num_threads(void);
void qt_set_spin_ns(double ns);   /* how long idle workers spin before sleeping (default 100 us) */
double qt_get_spin_ns(void);
double qt_pool_wake_ns(int asleep);  /* one wake-up sample (ns), worker asleep or spinning; < 0: none */
double qt_pause_ns(void);
void qt_pool_prewake(void);  /* wake sleeping workers (an empty job) and return at once */
int qt_pool_sleeping(void);  /* workers asleep now */

/* Per-ISA kernel tables (defined in the kernel files). */
extern const qt_igemm_config qt_igemm_scalar, qt_igemm_avx2, qt_igemm_avx2_maddubs,
    qt_igemm_avx512vnni;
extern const qt_amx_gemm_config qt_gemm_amx;
extern const qt_dwconv_config qt_dwconv_scalar, qt_dwconv_avx2, qt_dwconv_avx2_maddubs,
    qt_dwconv_avx512vnni;
/* qu8-peak.c: GMAC/s of a register-only loop of a GEMM kernel's instruction mix, one thread
 * (0 if the CPU cannot run it; check the ISA first) */
enum { QT_PEAK_AVX2 = 1, QT_PEAK_AVX2_EXACT = 2, QT_PEAK_AVX512VNNI = 3 };
double qt_peak_gmacs(int kind, double seconds);
void qt_set_exact_only(int on);   /* 1: pack later objects with igemm_exact/dwconv_exact if any */
int qt_get_exact_only(void);
void qt_fill_elementwise(qt_dispatch* d, int isa);
void qt_fill_transformer(qt_dispatch* d, int isa);
void qu8_lut_ukernel__scalar(size_t n, const uint8_t* x, const uint8_t* t, uint8_t* y);
void qu8_lut_ukernel__avx512vbmi(size_t n, const uint8_t* x, const uint8_t* t, uint8_t* y);
void qu8_interleave3_ukernel__scalar(size_t n, const uint8_t* p0, const uint8_t* p1,
                                     const uint8_t* p2, uint8_t* y);
void qu8_interleave3_ukernel__avx512vbmi(size_t n, const uint8_t* p0, const uint8_t* p1,
                                         const uint8_t* p2, uint8_t* y);

#endif
