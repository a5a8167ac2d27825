/* Concat of uint8 tensors, each input copied or requantized to the output's scale. */
#include <stdlib.h>
#include <string.h>

#include "operators.h"

typedef struct {
  const qt_dispatch* d;
  const qt_concat_input* in;
  size_t nin, outer, out_inner;
  uint8_t* y;
  qt_requant rq;
} concat_job;

static void concat_task(void* ctx, size_t begin, size_t end) {
  const concat_job* j = (const concat_job*)ctx;
  for (size_t o = begin; o < end; o++) {
    uint8_t* dst = j->y + o * j->out_inner;
    for (size_t i = 0; i < j->nin; i++) {
      const qt_concat_input* in = &j->in[i];
      const uint8_t* src = in->x + o * in->inner;
      if (in->copy) memcpy(dst, src, in->inner);
      else j->d->requant_copy(in->inner, src, in->zp, in->mult, dst, &j->rq);
      dst += in->inner;
    }
  }
}

void qt_concat(const qt_concat_input* in, size_t nin, size_t outer, uint8_t* y, int32_t y_zp) {
  concat_job j = {qt_get_dispatch(), in, nin, outer, 0, y, {0}};
  for (size_t i = 0; i < nin; i++) j.out_inner += in[i].inner;
  qt_fill_requant(&j.rq, y_zp, 0, 255, 0);
  qt_parallel(outer, concat_task, &j, (double)(outer * j.out_inner) / 8.0);
}
