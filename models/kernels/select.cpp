// A beam search step's candidates (models/beam_search.py's _candidates): for each group of `rows`
// beams, the k best (beam, token) pairs by running score + log-prob, over all rows * V of them, in
// one pass over the log-probs (torch's add then topk over (G, rows * V) wrote the sums out and
// partially sorted them: ~1 ns a candidate on this CPU, more than the decoder step at a few rows).
//
// logp (G * rows, V) float32 rows group by group; scores (G, rows) float32. Returns values (G, k)
// float32, best first, each exactly logp + score as torch adds them (one float addition), and their
// flat indices (G, k) int64 in [0, rows * V): beam = index / V, token = index % V. Equal values come
// lowest index first; a NaN candidate ranks below every number (it enters only while fewer than k
// candidates have been seen).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

#include "simd.h"

namespace {

using namespace ts;

// the k best so far, best first; `worst` the bar a new candidate must clear once k are held
struct Best {
  float* value;
  int64_t* index;
  int64_t k, held = 0;

  // a candidate seen after every held one (a higher index): it goes after those it does not beat
  void offer(float v, int64_t i) {
    const float key = std::isnan(v) ? -std::numeric_limits<float>::infinity() : v;
    if (held == k && !(key > rank(held - 1))) return;
    int64_t at = held < k ? held++ : k - 1;
    for (; at > 0 && key > rank(at - 1); --at) {
      value[at] = value[at - 1];
      index[at] = index[at - 1];
    }
    value[at] = v;
    index[at] = i;
  }

  float rank(int64_t at) const {
    return std::isnan(value[at]) ? -std::numeric_limits<float>::infinity() : value[at];
  }

  // the value a candidate must exceed to enter (-inf until k are held: every number beats it but -inf)
  float bar() const { return held < k ? -std::numeric_limits<float>::infinity() : rank(k - 1); }
};

TS_TARGET void group_top(const float* logp, const float* scores, int64_t rows, int64_t V, Best& best) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logp + r * V;
    const float score = scores[r];
    const vf s = set1(score);
    const int64_t base = r * V;
    int64_t v = 0;
    if (best.held < best.k) {  // the first k candidates enter whatever they are (-inf and NaN too)
      for (; v < V && best.held < best.k; ++v) best.offer(row[v] + score, base + v);
    }
    for (; v + LANES <= V; v += LANES) {
      const vf sum = add(load(row + v), s);
      uint32_t mask = greater(sum, set1(best.bar()));
      if (mask == 0) continue;
      alignas(64) float lane[LANES];
      store(lane, sum);
      while (mask != 0) {
        const int j = __builtin_ctz(mask);
        mask &= mask - 1;
        best.offer(lane[j], base + v + j);
      }
    }
    for (; v < V; ++v) best.offer(row[v] + score, base + v);
  }
}

std::tuple<at::Tensor, at::Tensor> beam_top(const at::Tensor& logp, const at::Tensor& scores, int64_t k) {
  TORCH_CHECK(logp.dim() == 2 && logp.scalar_type() == at::kFloat && logp.is_contiguous(),
              "logp must be a contiguous (G * rows, V) float32 tensor");
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat && scores.is_contiguous(),
              "scores must be a contiguous (G, rows) float32 tensor");
  const int64_t G = scores.size(0), rows = scores.size(1), V = logp.size(1);
  TORCH_CHECK(logp.size(0) == G * rows, "logp has ", logp.size(0), " rows, scores ", G, " x ", rows);
  TORCH_CHECK(k >= 1 && k <= rows * V, "k must be in [1, rows * V]");
  at::Tensor values = at::empty({G, k}, logp.options());
  at::Tensor index = at::empty({G, k}, logp.options().dtype(at::kLong));
  const float* lp = logp.data_ptr<float>();
  const float* sp = scores.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = index.data_ptr<int64_t>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      Best best{vp + g * k, ip + g * k, k};
      group_top(lp + g * rows * V, sp + g * rows, rows, V, best);
    }
  });
  return {values, index};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ts_panels, m) {
  m.def("beam_top(Tensor logp, Tensor scores, int k) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ts_panels, CPU, m) {
  m.impl("beam_top", &beam_top);
}
