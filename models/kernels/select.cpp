// A beam search step's choices (models/beam_search.py): for each group of `rows` beams, the k best
// (beam, token) pairs by running score + log-prob, over all rows * V of them, in one pass over the
// log-probs (torch's add then topk over (G, rows * V) wrote the sums out and partially sorted them,
// which took longer than the decoder step at a few rows); and the whole selection from the
// decoder's logits in one call (search_select: log-softmax, banned tokens, the forced end token, each
// request's argmax or best candidates), the small torch ops and Python between them being most of a
// small translator's step after its decoder call.
//
// beam_top: logp (G * rows, V) float32 rows group by group; scores (G, rows) float32. Returns values (G, k)
// float32, best first, each exactly logp + score as torch adds them (one float addition), and their
// flat indices (G, k) int64 in [0, rows * V): beam = index / V, token = index % V. Equal values come
// lowest index first; a NaN candidate ranks below every number (it enters only while fewer than k
// candidates have been seen).

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "ops.h"
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

// torch.argmax's choice on one row: the first NaN, else the first of the largest values (a lane enters
// only when it beats the best so far, in index order)
TS_TARGET int64_t argmax(const float* row, int64_t V) {
  int64_t best = 0;
  int64_t v = 0;
  for (; v + LANES <= V; v += LANES) {
    const vf x = load(row + v);
    if (nan_lanes(x) != 0) return v + __builtin_ctz(nan_lanes(x));
    uint32_t mask = greater(x, set1(row[best]));
    while (mask != 0) {
      const int j = __builtin_ctz(mask);
      mask &= mask - 1;
      if (row[v + j] > row[best]) best = v + j;
    }
  }
  for (; v < V; ++v) {
    if (std::isnan(row[v])) return v;
    if (row[v] > row[best]) best = v;
  }
  return best;
}

}  // namespace

std::vector<ts::Candidates> ts::search_select(const at::Tensor& logits, const std::vector<int64_t>& banned,
                                              int64_t eos, const std::vector<int64_t>& rows,
                                              const std::vector<int64_t>& beams, const std::vector<bool>& forced,
                                              const std::vector<std::vector<double>>& scores) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits must be a (R, V) float32 tensor");
  const size_t n = rows.size();
  TORCH_CHECK(beams.size() == n && forced.size() == n && scores.size() == n,
              "rows, beams, forced and scores need one entry per request");
  const int64_t R = logits.size(0), V = logits.size(1);
  std::vector<int64_t> first(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(rows[i] >= 1 && beams[i] >= 1 && (beams[i] == 1 || static_cast<int64_t>(scores[i].size()) == rows[i]),
                "request ", i, ": ", rows[i], " rows, beam ", beams[i], ", ", scores[i].size(), " scores");
    TORCH_CHECK(beams[i] == 1 || 2 * beams[i] <= rows[i] * V, "request ", i, ": more candidates than rows * V");
    first[i + 1] = first[i] + rows[i];
  }
  TORCH_CHECK(first[n] == R, "the requests have ", first[n], " rows, the logits ", R);
  for (const int64_t b : banned) TORCH_CHECK(b >= 0 && b < V, "banned token ", b, " is outside the vocabulary");
  TORCH_CHECK(eos >= 0 && eos < V, "end token ", eos, " is outside the vocabulary");
  // torch's own log-softmax: the bits of the Python path's logits.float().log_softmax(-1)
  at::Tensor logp = logits.log_softmax(-1).contiguous();  // (R, V)
  float* lp = logp.data_ptr<float>();
  constexpr float INF = std::numeric_limits<float>::infinity();
  std::vector<Candidates> out(n);
  at::parallel_for(0, static_cast<int64_t>(n), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float* mine = lp + first[i] * V;
      for (int64_t r = 0; r < rows[i]; ++r) {
        float* row = mine + r * V;
        for (const int64_t b : banned) row[b] = -INF;
        if (forced[i]) {  // the length limit: the end token is the only choice
          std::fill(row, row + V, -INF);
          row[eos] = 0.0f;
        }
      }
      auto& [values, beam, token] = out[i];
      if (beams[i] == 1) {  // greedy: its one row's argmax
        values = {0.0};
        beam = {0};
        token = {argmax(mine, V)};
        continue;
      }
      const int64_t k = 2 * beams[i];
      std::vector<float> running(scores[i].begin(), scores[i].end());  // as torch.tensor rounds them
      std::vector<float> top(k);
      std::vector<int64_t> index(k);
      Best best{top.data(), index.data(), k};
      group_top(mine, running.data(), rows[i], V, best);
      values.assign(top.begin(), top.end());
      beam.resize(k);
      token.resize(k);
      for (int64_t j = 0; j < k; ++j) {
        beam[j] = index[j] / V;
        token[j] = index[j] % V;
      }
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> ts::beam_top(const at::Tensor& logp, const at::Tensor& scores, int64_t k) {
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
