// The arithmetic of one output row of the split-KV merge (merge.cu), FP8NCA_HD: the merge kernel
// runs it on the device and the CPU tests run it on host arrays (tests/ext/host_hooks.cpp
// merge_row), so the tests check the kernel's own formula.
//   out[d] = sum_s w_s O_s[d] / (sum_s w_s + 2^(sink - top)),  w_s = 2^(lse_s - top),
//   top = max(max_s lse_s, sink)
// and the merged state's own log2-sum-exp, lse = top + log2(sum_s w_s + 2^(sink - top)) (-inf
// when that sum is 0: a row no split saw stays an empty state for a later merge).
// Each split's O_s is already normalised and scaled by v_scale; lse and sink are in log2 units.
// The sink (none: -inf) is one more term of the denominator with no value, counted once here.
// A split that saw no key has lse -inf: its weight is 0 and its O is never read (an empty
// split's partial may hold anything), so a row no split saw merges to 0. A NaN (from a NaN in
// the cache) is not a zero weight: it reaches the output, as in the reference.
#pragma once

#include <cmath>
#include <cstdint>

#include "../common/host_device.h"

namespace fp8nca {

struct MergeScale {
  float top;  // max(lse_s, sink), 0 when all are -inf (no NaN from -inf - -inf)
  float inv;  // 1 / (sum_s w_s + 2^(sink - top)), 0 when that sum is 0
  float lse;  // top + log2(sum_s w_s + 2^(sink - top)), -inf when that sum is 0
};

// Split s's lse at lse[s * split_stride].
FP8NCA_HD MergeScale merge_scale(const float* lse, int64_t split_stride, int num_splits,
                                 float sink) {
  float top = sink;
  for (int s = 0; s < num_splits; ++s) top = fmaxf(top, lse[s * split_stride]);
  if (top == -INFINITY) top = 0.f;
  float sum = exp2f(sink - top);
  for (int s = 0; s < num_splits; ++s) sum += exp2f(lse[s * split_stride] - top);
  // A NaN sum (a NaN lse) fails `sum > 0` but is no empty state: it stays NaN in lse too.
  const float merged = sum > 0.f ? top + log2f(sum) : (sum == 0.f ? -INFINITY : sum);
  return MergeScale{top, sum > 0.f ? 1.f / sum : 0.f, merged};
}

// One merged element: split s's partial at o[s * o_split_stride], its lse as above.
FP8NCA_HD float merge_element(const float* o, int64_t o_split_stride, const float* lse,
                              int64_t split_stride, int num_splits, MergeScale scale) {
  float acc = 0.f;
  for (int s = 0; s < num_splits; ++s) {
    const float w = exp2f(lse[s * split_stride] - scale.top);
    if (w != 0.f) acc += w * o[s * o_split_stride];
  }
  return acc * scale.inv;
}

}  // namespace fp8nca
