/* Portable C depthwise convolution. Packed: int32 bias[C], float mult[C], int8 w[ks][C]. */
#include "qtool_kernels.h"

#define CHUNK 256

static size_t packed_size(size_t channels, size_t ks) { return channels * (8 + ks); }

static void pack(size_t channels, size_t ks, const int8_t* w, const int32_t* bias, const float* mult,
                 void* out) {
  int32_t* b = (int32_t*)out;
  float* m = (float*)(b + channels);
  int8_t* wp = (int8_t*)(m + channels);
  for (size_t c = 0; c < channels; c++) {
    b[c] = bias[c];
    m[c] = mult[c];
    for (size_t t = 0; t < ks; t++) wp[t * channels + c] = w[c * ks + t];
  }
}

void qu8_qs8w_dwconv_minmax_fp32_ukernel__scalar(size_t channels, size_t ow, size_t ks, const uint8_t* const* in, size_t in_step, ptrdiff_t in_offset, const uint8_t* zero, const void* w, uint8_t* out, size_t out_stride, const qt_requant* rq) {
  const int32_t* bias = (const int32_t*)w;
  const float* mult = (const float*)(bias + channels);
  const int8_t* wp = (const int8_t*)(mult + channels);
  int32_t acc[CHUNK];
  for (size_t p = 0; p < ow; p++) {
    const uint8_t* const* ip = in + p * in_step;
    for (size_t c0 = 0; c0 < channels; c0 += CHUNK) {
      size_t n = channels - c0 < CHUNK ? channels - c0 : CHUNK;
      for (size_t c = 0; c < n; c++) acc[c] = bias[c0 + c];
      for (size_t t = 0; t < ks; t++) {
        const uint8_t* xi = QT_DW_PTR(ip[t], in_offset, zero) + c0;
        const int8_t* wt = wp + t * channels + c0;
        for (size_t c = 0; c < n; c++) acc[c] += (int32_t)xi[c] * (int32_t)wt[c];
      }
      uint8_t* o = out + p * out_stride + c0;
      for (size_t c = 0; c < n; c++) o[c] = qt_requant_scalar(acc[c], mult[c0 + c], rq);
    }
  }
}

const qt_dwconv_config qt_dwconv_scalar = {"qu8_qs8w_dwconv_minmax_fp32_ukernel__scalar",
                                           qu8_qs8w_dwconv_minmax_fp32_ukernel__scalar, 1,
                                           packed_size, pack};
