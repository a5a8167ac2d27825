/* Portable C indirect GEMM: MR=2 x NR=4, weights int8 [ks][kc][NR] per panel. */
#include "qtool_kernels.h"

#define MR 2
#define NR 4

void qu8_qs8w_igemm_minmax_fp32_ukernel_2x4__scalar(size_t mr, size_t nc, size_t kc, size_t ks,
                                                    const intptr_t* ind, const uint8_t* x,
                                                    const uint8_t* zero, const void* w, void* c,
                                                    size_t cm_stride, const qt_requant* rq) {
  const int32_t* bias = (const int32_t*)w;
  const float* mult = (const float*)(bias + NR);
  const int8_t* wp = (const int8_t*)(mult + NR);
  int32_t acc[MR][NR];
  for (size_t i = 0; i < MR; i++)
    for (size_t j = 0; j < NR; j++) acc[i][j] = bias[j];
  for (size_t t = 0; t < ks; t++) {
    const uint8_t* a[MR];
    for (size_t i = 0; i < MR; i++) {
      intptr_t o = ind[t * MR + i];
      a[i] = o >= 0 ? x + o : zero;
    }
    for (size_t k = 0; k < kc; k++) {
      const int8_t* wk = wp + k * NR;
      for (size_t i = 0; i < MR; i++) {
        int32_t av = a[i][k];
        for (size_t j = 0; j < NR; j++) acc[i][j] += av * (int32_t)wk[j];
      }
    }
    wp += kc * NR;
  }
  for (size_t i = 0; i < mr; i++) {
    if (rq->out_f32) {
      float* cf = (float*)((char*)c + i * cm_stride);
      for (size_t j = 0; j < nc; j++) cf[j] = (float)acc[i][j] * mult[j];
    } else {
      uint8_t* cu = (uint8_t*)c + i * cm_stride;
      for (size_t j = 0; j < nc; j++) cu[j] = qt_requant_scalar(acc[i][j], mult[j], rq);
    }
  }
}

const qt_igemm_config qt_igemm_scalar = {
    "qu8_qs8w_igemm_minmax_fp32_ukernel_2x4__scalar",
    qu8_qs8w_igemm_minmax_fp32_ukernel_2x4__scalar, MR, NR, 1, 1};
