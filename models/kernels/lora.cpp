// Low-rank adapter updates of a projection's rows (models/adapters/lora.py's LoraLinear, inside the
// stack step of block_step.cpp): y_b += (x_b a_s^T) bt_s for each row b whose adapter slot s >= 0, part
// by part (a fused projection's parts each write their own outputs with their own ranks, and only the
// ranks the slot's adapter uses are read). Rows of one slot are computed together, so each slot's
// factors are read once per call however many rows use it; a row's result does not depend on the
// others (each output sums its ranks in order, then adds to the row), as the projections' kernels.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using namespace ts;

// sum_i a[i] * x[i], lane by lane then across lanes
TS_TARGET float dot(const float* a, const float* x, int64_t n) {
  vf acc = zero();
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) acc = fmadd(load(a + i), load(x + i), acc);
  float s = reduce_add(acc);
  for (; i < n; ++i) s += a[i] * x[i];
  return s;
}

// y[i] += t * b[i]
TS_TARGET void axpy(float t, const float* b, float* y, int64_t n) {
  const vf tv = set1(t);
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) store(y + i, fmadd(tv, load(b + i), load(y + i)));
  for (; i < n; ++i) y[i] += t * b[i];
}

// y[i] += d[i]
TS_TARGET void add_into(const float* d, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) store(y + i, add(load(y + i), load(d + i)));
  for (; i < n; ++i) y[i] += d[i];
}

}  // namespace

void ts::lora_add(const at::Tensor& x, at::Tensor& y, const Lora& l, const int64_t* slots) {
  const int64_t R = x.size(0), I = x.size(1), O = y.size(1), N = l.a.size(0), PR = l.a.size(1);
  const int64_t P = static_cast<int64_t>(l.bounds.size()) - 1;
  TORCH_CHECK(l.a.size(2) == I && l.bt.size(2) == O && l.bt.size(1) == PR && PR == P * l.rank,
              "an adapter's factors do not fit the projection");
  // rows grouped by slot (stable), each group one task per part
  std::vector<int64_t> order;
  for (int64_t b = 0; b < R; ++b) {
    if (slots[b] >= 0) {
      TORCH_CHECK(slots[b] < N, "adapter slot ", slots[b], " outside the ", N, " slots");
      order.push_back(b);
    }
  }
  if (order.empty()) return;
  std::stable_sort(order.begin(), order.end(), [&](int64_t u, int64_t v) { return slots[u] < slots[v]; });
  std::vector<int64_t> starts;  // each group's first index in `order`, then order.size()
  for (size_t i = 0; i < order.size(); ++i) {
    if (i == 0 || slots[order[i]] != slots[order[i - 1]]) starts.push_back(static_cast<int64_t>(i));
  }
  starts.push_back(static_cast<int64_t>(order.size()));
  const int64_t G = static_cast<int64_t>(starts.size()) - 1;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t* ranks = l.ranks.data_ptr<int64_t>();
  at::parallel_for(0, G * P, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> t, d;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t g = task / P, p = task % P;
      const int64_t s = slots[order[starts[g]]], rows = starts[g + 1] - starts[g];
      const int64_t used = ranks[s * P + p], o0 = l.bounds[p], width = l.bounds[p + 1] - o0;
      if (used == 0) continue;
      const float* a = l.a.data_ptr<float>() + (s * PR + p * l.rank) * I;  // (used, I)
      const float* bt = l.bt.data_ptr<float>() + (s * PR + p * l.rank) * O + o0;  // (used, O) from o0
      t.assign(rows * used, 0.0f);
      for (int64_t j = 0; j < used; ++j) {  // each rank's row of a once for every row of the group
        for (int64_t r = 0; r < rows; ++r) t[r * used + j] = dot(a + j * I, xp + order[starts[g] + r] * I, I);
      }
      d.assign(rows * width, 0.0f);
      for (int64_t j = 0; j < used; ++j) {
        for (int64_t r = 0; r < rows; ++r) axpy(t[r * used + j], bt + j * O, d.data() + r * width, width);
      }
      for (int64_t r = 0; r < rows; ++r) add_into(d.data() + r * width, yp + order[starts[g] + r] * O + o0, width);
    }
  });
}
