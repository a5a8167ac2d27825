/* Which two weights vpmaddubsw adds into one int16.
 *
 * vpmaddubsw computes sat16(x_a * w_a + x_b * w_b) for u8 x and s8 w. For any x in [0, 255] the
 * sum lies in [255 * (neg part), 255 * (pos part)], so it cannot saturate when the two weights
 * have opposite signs (or one is 0), or the same sign with |w_a + w_b| <= 128
 * (255 * 128 = 32640 < 32767; 129 would allow 32895). A kernel whose every pair is safe gives
 * the exact int32 sum.
 *
 * qtool owns its packing, so it may choose the pairs: within a block of L consecutive K
 * positions (L = 16, 8 or 4, what one broadcast of the input holds), each output column gets its
 * own pairing, realised by a vpshufb of the input. The natural pairing (0,1), (2,3), ... is tried
 * first, so that weights already safe in ONNX Runtime's order (pairs at even K) keep it. */
#include <stdlib.h>

#include "qtool_kernels.h"

int qt_pair_is_safe(int a, int b) {
  if ((a > 0 && b < 0) || (a < 0 && b > 0) || a == 0 || b == 0) return 1;
  const int s = a + b;
  return s <= QT_PAIR_LIMIT && s >= -QT_PAIR_LIMIT;
}

int qt_pair_block(const int8_t* w, size_t L, uint8_t* perm) {
  int ok = 1;
  for (size_t p = 0; p < L; p += 2) ok &= qt_pair_is_safe(w[p], w[p + 1]);
  for (size_t p = 0; p < L; p++) perm[p] = (uint8_t)p;
  if (ok) return 1;
  /* Largest magnitude first: give it the largest opposite-sign (or zero) partner left, else the
   * largest same-sign partner that still fits. Greedy; a block it cannot pair gets split. */
  uint8_t order[QT_PAIR_BLOCK], used[QT_PAIR_BLOCK] = {0};
  for (size_t p = 0; p < L; p++) order[p] = (uint8_t)p;
  for (size_t p = 1; p < L; p++)
    for (size_t q = p; q > 0 && abs(w[order[q]]) > abs(w[order[q - 1]]); q--) {
      uint8_t t = order[q]; order[q] = order[q - 1]; order[q - 1] = t;
    }
  size_t np = 0;
  for (size_t oi = 0; oi < L; oi++) {
    const size_t i = order[oi];
    if (used[i]) continue;
    used[i] = 1;
    int best = -1, best_mag = -1, best_opp = 0;
    for (size_t j = 0; j < L; j++) {
      if (used[j]) continue;
      const int opp = (int)w[i] * (int)w[j] <= 0;
      if (!opp && !qt_pair_is_safe(w[i], w[j])) continue;
      const int mag = abs(w[j]);
      if (opp > best_opp || (opp == best_opp && mag > best_mag)) {
        best = (int)j; best_mag = mag; best_opp = opp;
      }
    }
    if (best < 0) {
      for (size_t p = 0; p < L; p++) perm[p] = (uint8_t)p;
      return 0;
    }
    used[best] = 1;
    perm[2 * np] = (uint8_t)i;
    perm[2 * np + 1] = (uint8_t)best;
    np++;
  }
  return 2;
}
