// Low-rank adapter updates of a projection's rows (models/adapters/lora.py's LoraLinear, inside the
// stack step of block_step.cpp): y_b += (x_b a_s^T) bt_s for each row b whose adapter slot s >= 0, part
// by part (a fused projection's parts each write their own outputs with their own ranks, and only the
// ranks the slot's adapter uses are read). The factors are float32, bfloat16 or int8 (each value widened
// to float32 exactly as it is read; int8 ranks' first products times their scales); the products and sums
// are float32. Rows of one slot are computed together, up to ROWS per pass, so each slot's factors are
// read once per call however many rows use it; a row's result does not depend on the others (each output
// sums its ranks in order, then adds to the row), as the projections' kernels. Two ways to share the work
// between threads, the same bits: lora_add after the projection, in a region of its own (the first
// products split by ranks, the second, after a barrier, by output columns), or, for a step's one or two
// rows with an adapter, LoraAfter inside the projection's region (each thread adds its own outputs'
// updates, computing the first products of the parts they fall in itself): no region and no barrier of
// its own.

#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using namespace ts;

// Accumulators a pass keeps in registers (AVX-512 has 32 vector registers, AVX2 16): a pass of the first
// product takes KB rank rows x up to ROWS rows, one of the second takes CB vectors of outputs x ROWS rows
constexpr int ROWS = 4;
constexpr int KB = LANES == 16 ? 4 : 2;
constexpr int CB = LANES == 16 ? 4 : 2;

// t[k + q * stride] = sum_i a_k[i] * x_q[i] for the M rank rows a_k (a_k = a + k * len) and the N rows x_q,
// lane by lane then across lanes: each (rank, row) sum is the same whatever is beside it
template <typename W, int M, int N>
TS_TARGET void dots(const W* a, const float* const* x, int64_t len, float* t, int64_t stride) {
  vf acc[M][N];
  for (int k = 0; k < M; ++k)
    for (int q = 0; q < N; ++q) acc[k][q] = zero();
  int64_t i = 0;
  for (; i + LANES <= len; i += LANES) {
    vf av[M];
    for (int k = 0; k < M; ++k) av[k] = widen(a + k * len + i);
    for (int q = 0; q < N; ++q) {
      const vf xv = load(x[q] + i);
      for (int k = 0; k < M; ++k) acc[k][q] = fmadd(av[k], xv, acc[k][q]);
    }
  }
  for (int k = 0; k < M; ++k) {
    for (int q = 0; q < N; ++q) {
      float s = reduce_add(acc[k][q]);
      for (int64_t e = i; e < len; ++e) s += widen1(a[k * len + e]) * x[q][e];
      t[k + q * stride] = s;
    }
  }
}

// y_q[o] += sum_j t_q[j] * bt[j * O + o] over `used` ranks in order, for outputs [o0, o1) and the N rows
// y_q: each bt value is loaded once for the N rows
template <typename W, int N>
TS_TARGET void updates(const float* const* t, const W* bt, int64_t O, int64_t used, int64_t o0, int64_t o1,
                       float* const* y) {
  int64_t o = o0;
  for (; o + CB * LANES <= o1; o += CB * LANES) {
    vf acc[CB][N];
    for (int c = 0; c < CB; ++c)
      for (int q = 0; q < N; ++q) acc[c][q] = zero();
    for (int64_t j = 0; j < used; ++j) {
      vf b[CB];
      for (int c = 0; c < CB; ++c) b[c] = widen(bt + j * O + o + c * LANES);
      for (int q = 0; q < N; ++q) {
        const vf tv = set1(t[q][j]);
        for (int c = 0; c < CB; ++c) acc[c][q] = fmadd(tv, b[c], acc[c][q]);
      }
    }
    for (int q = 0; q < N; ++q)
      for (int c = 0; c < CB; ++c) store(y[q] + o + c * LANES, add(load(y[q] + o + c * LANES), acc[c][q]));
  }
  for (; o + LANES <= o1; o += LANES) {
    vf acc[N];
    for (int q = 0; q < N; ++q) acc[q] = zero();
    for (int64_t j = 0; j < used; ++j) {
      const vf vb = widen(bt + j * O + o);
      for (int q = 0; q < N; ++q) acc[q] = fmadd(set1(t[q][j]), vb, acc[q]);
    }
    for (int q = 0; q < N; ++q) store(y[q] + o, add(load(y[q] + o), acc[q]));
  }
  for (; o < o1; ++o) {  // as a lane of the loops above computes it: which loop an output falls in changes nothing
    for (int q = 0; q < N; ++q) {
      float s = 0.0f;
      for (int64_t j = 0; j < used; ++j) s = std::fma(t[q][j], widen1(bt[j * O + o]), s);
      y[q][o] += s;
    }
  }
}

// the kernels above for a run-time row count n <= ROWS (and rank rows m <= KB)
template <typename W, int M>
void dots_rows(const W* a, const float* const* x, int64_t n, int64_t len, float* t, int64_t stride) {
  switch (n) {
    case 1: return dots<W, M, 1>(a, x, len, t, stride);
    case 2: return dots<W, M, 2>(a, x, len, t, stride);
    case 3: return dots<W, M, 3>(a, x, len, t, stride);
    default: return dots<W, M, ROWS>(a, x, len, t, stride);
  }
}
template <typename W>
void dots_any(const W* a, int64_t m, const float* const* x, int64_t n, int64_t len, float* t, int64_t stride) {
  static_assert(KB == 2 || KB == 4, "rank rows a pass takes");
  switch (m) {
    case 1: return dots_rows<W, 1>(a, x, n, len, t, stride);
    case 2: return dots_rows<W, 2>(a, x, n, len, t, stride);
    case 3: return dots_rows<W, KB == 4 ? 3 : 2>(a, x, n, len, t, stride);
    default: return dots_rows<W, KB>(a, x, n, len, t, stride);
  }
}
template <typename W>
void updates_any(const float* const* t, const W* bt, int64_t O, int64_t used, int64_t o0, int64_t o1, int64_t n,
                 float* const* y) {
  switch (n) {
    case 1: return updates<W, 1>(t, bt, O, used, o0, o1, y);
    case 2: return updates<W, 2>(t, bt, O, used, o0, o1, y);
    case 3: return updates<W, 3>(t, bt, O, used, o0, o1, y);
    default: return updates<W, ROWS>(t, bt, O, used, o0, o1, y);
  }
}

// t[q * stride + j] *= scales[j] for the n rows q and the ranks j < m: an int8 adapter's first products times
// their ranks' scales (the first's and the second's together); nothing for float factors (scales null)
inline void scale_firsts(float* t, int64_t stride, int64_t n, const float* scales, int64_t m) {
  if (scales == nullptr) return;
  for (int64_t q = 0; q < n; ++q)
    for (int64_t j = 0; j < m; ++j) t[q * stride + j] *= scales[j];
}

// a slot's scales (N, P r) at [slot, lo), or null for float factors
inline const float* scales_at(const Lora& l, int64_t slot, int64_t lo) {
  return l.sp == nullptr ? nullptr : l.sp + slot * l.PR + lo;
}

// Outputs one item of the second product takes: a slot's rows and a part are split in column ranges so
// that one row's update spreads over the threads too
constexpr int64_t COLUMNS = 256;
// multiply-adds below which the whole update stays on the calling thread (waking the others costs more)
constexpr int64_t PARALLEL_WORK = 1 << 14;

// An update's work in two phases of items, each item's result independent of which thread runs it:
// first products (a chunk of <= ROWS rows of one slot, a part, KB of its ranks) into t, then, after every
// thread has finished the first phase, second products (a chunk, a part, a range of its outputs) into y.
struct Item {
  int64_t chunk, part, begin, end;  // ranks [begin, end) of the part, or its outputs [begin, end)
  int64_t work;
};

// items [i0, i1) of `items` whose cumulative work falls in thread `tid`'s share of `n` (contiguous, balanced)
std::pair<int64_t, int64_t> share(const std::vector<int64_t>& cumulative, int tid, int n) {
  const int64_t total = cumulative.back();
  auto at = [&](int k) {
    const int64_t goal = total * k / n;
    return static_cast<int64_t>(std::lower_bound(cumulative.begin(), cumulative.end(), goal) - cumulative.begin());
  };
  return {at(tid), at(tid + 1)};
}

// c[i] = the work of items [0, i); returns c
const std::vector<int64_t>& cumulative_work(const std::vector<Item>& items, std::vector<int64_t>& c) {
  c.assign(items.size() + 1, 0);
  for (size_t i = 0; i < items.size(); ++i) c[i + 1] = c[i] + items[i].work;
  return c;
}

// order: the rows b < R with an adapter (slots[b] >= 0), grouped by slot (stable); chunks (first row in
// `order`, rows): each slot's rows, ROWS at a time
void group_rows(const int64_t* slots, int64_t R, std::vector<int64_t>& order,
                std::vector<std::pair<int64_t, int64_t>>& chunks) {
  order.clear();
  chunks.clear();
  for (int64_t b = 0; b < R; ++b) {
    if (slots[b] >= 0) order.push_back(b);
  }
  auto by_slot = [&](int64_t u, int64_t v) { return slots[u] < slots[v]; };
  if (!std::is_sorted(order.begin(), order.end(), by_slot)) std::stable_sort(order.begin(), order.end(), by_slot);
  const int64_t n = static_cast<int64_t>(order.size());
  for (int64_t g0 = 0, g1 = 0; g0 < n; g0 = g1) {
    for (g1 = g0; g1 < n && slots[order[g1]] == slots[order[g0]]; ++g1) {
    }
    for (int64_t r0 = g0; r0 < g1; r0 += ROWS) chunks.emplace_back(r0, std::min<int64_t>(ROWS, g1 - r0));
  }
}

// An update's plan (lora_add_typed): the rows in slot order, their chunks, the two phases' items and
// their cumulative work, and the first products t
struct Plan {
  std::vector<int64_t> order;
  std::vector<std::pair<int64_t, int64_t>> chunks;
  std::vector<Item> firsts, seconds;
  std::vector<int64_t> c1, c2;
  std::vector<float> t;
};

template <typename W>
void lora_add_typed(const at::Tensor& x, at::Tensor& y, const Lora& l, const int64_t* slots) {
  const int64_t R = x.size(0), I = l.I, O = l.O, PR = l.PR, P = l.P;
  // the plan's lists live from call to call on each calling thread: a decode step's hundred calls at a
  // few rows allocate nothing
  thread_local Plan plan;
  group_rows(slots, R, plan.order, plan.chunks);
  const std::vector<int64_t>& order = plan.order;
  const std::vector<std::pair<int64_t, int64_t>>& chunks = plan.chunks;
  if (order.empty()) return;
  const int64_t n_rows = static_cast<int64_t>(order.size());
  const int64_t* ranks = l.rp;
  std::vector<Item>& firsts = plan.firsts;
  std::vector<Item>& seconds = plan.seconds;
  firsts.clear();
  seconds.clear();
  for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c) {
    const int64_t s = slots[order[chunks[c].first]], n = chunks[c].second;
    for (int64_t p = 0; p < P; ++p) {
      const int64_t used = ranks[s * P + p];
      for (int64_t j = 0; j < used; j += KB) firsts.push_back({c, p, j, std::min<int64_t>(used, j + KB), n * KB * I});
      for (int64_t o = l.bounds[p]; used > 0 && o < l.bounds[p + 1]; o += COLUMNS) {
        const int64_t end = std::min(l.bounds[p + 1], o + COLUMNS);
        seconds.push_back({c, p, o, end, n * used * (end - o)});
      }
    }
  }
  if (firsts.empty()) return;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const W* ap = static_cast<const W*>(l.ap);
  const W* btp = static_cast<const W*>(l.btp);
  // t[u * PR + p * rank + j]: the first product of row order[u], part p, rank j
  std::vector<float>& t = plan.t;
  t.resize(static_cast<size_t>(n_rows * PR));
  auto first = [&](const Item& it) {
    const auto [r0, n] = chunks[it.chunk];
    const int64_t s = slots[order[r0]];
    const float* xs[ROWS];
    for (int64_t q = 0; q < n; ++q) xs[q] = xp + order[r0 + q] * I;
    const W* a = ap + (s * PR + it.part * l.rank + it.begin) * I;  // (end - begin, I)
    float* out = t.data() + r0 * PR + it.part * l.rank + it.begin;
    dots_any(a, it.end - it.begin, xs, n, I, out, PR);
    scale_firsts(out, PR, n, scales_at(l, s, it.part * l.rank + it.begin), it.end - it.begin);
  };
  auto second = [&](const Item& it) {
    const auto [r0, n] = chunks[it.chunk];
    const int64_t s = slots[order[r0]], used = ranks[s * P + it.part];
    const float* ts[ROWS];
    float* ys[ROWS];
    for (int64_t q = 0; q < n; ++q) {
      ts[q] = t.data() + (r0 + q) * PR + it.part * l.rank;
      ys[q] = yp + order[r0 + q] * O;
    }
    const W* bt = btp + (s * PR + it.part * l.rank) * O;  // (used, O)
    updates_any(ts, bt, O, used, it.begin, it.end, n, ys);
  };
  const std::vector<int64_t>& c1 = cumulative_work(firsts, plan.c1);
  const std::vector<int64_t>& c2 = cumulative_work(seconds, plan.c2);
  const int threads = (at::in_parallel_region() || c1.back() + c2.back() < PARALLEL_WORK)
                          ? 1
                          : static_cast<int>(std::min<int64_t>(at::get_num_threads(), seconds.size()));
  if (threads <= 1) {
    for (const Item& it : firsts) first(it);
    for (const Item& it : seconds) second(it);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), n = omp_get_num_threads();
    const auto [f0, f1] = share(c1, tid, n);
    for (int64_t i = f0; i < f1; ++i) first(firsts[i]);
#pragma omp barrier
    const auto [s0, s1] = share(c2, tid, n);
    for (int64_t i = s0; i < s1; ++i) second(seconds[i]);
  }
}

// Rows with an adapter at or below which the updates run inside the projection's region (LoraAfter)
constexpr int64_t FUSED_ROWS = 2;

// the checks of lora_add and lora_fuses, on the calling thread (not inside a parallel region): the
// factors' shapes were checked by make_lora
void check_fits(const at::Tensor& x, const Lora& l, const int64_t* slots) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == l.I, "an adapter's factors do not fit the projection's input");
  for (int64_t b = 0; b < x.size(0); ++b)
    TORCH_CHECK(slots[b] < l.N, "adapter slot ", slots[b], " outside the ", l.N, " slots");
}

template <typename W>
void after_typed(const at::Tensor& x, float* yp, const Lora& l, const int64_t* slots, int64_t o0, int64_t o1) {
  const int64_t R = x.size(0), I = l.I, O = l.O, PR = l.PR, P = l.P;
  const float* xp = x.data_ptr<float>();
  const W* ap = static_cast<const W*>(l.ap);
  const W* btp = static_cast<const W*>(l.btp);
  thread_local std::vector<float> t;  // t[q * rank + j]: row q of a chunk, rank j of the part at hand
  thread_local std::vector<int64_t> order;
  thread_local std::vector<std::pair<int64_t, int64_t>> chunks;
  t.resize(static_cast<size_t>(ROWS * l.rank));
  group_rows(slots, R, order, chunks);
  for (const auto& [r0, n] : chunks) {
    const int64_t s = slots[order[r0]];
    const float* xs[ROWS];
    float* ys[ROWS];
    float* ts[ROWS];
    for (int64_t q = 0; q < n; ++q) {
      xs[q] = xp + order[r0 + q] * I;
      ys[q] = yp + order[r0 + q] * O;
      ts[q] = t.data() + q * l.rank;
    }
    for (int64_t p = 0; p < P; ++p) {
      const int64_t begin = std::max(o0, l.bounds[p]), end = std::min(o1, l.bounds[p + 1]), used = l.rp[s * P + p];
      if (begin >= end || used == 0) continue;
      const W* a = ap + (s * PR + p * l.rank) * I;  // (used, I)
      for (int64_t j = 0; j < used; j += KB)
        dots_any(a + j * I, std::min<int64_t>(KB, used - j), xs, n, I, t.data() + j, l.rank);
      scale_firsts(t.data(), l.rank, n, scales_at(l, s, p * l.rank), used);
      updates_any(ts, btp + (s * PR + p * l.rank) * O, O, used, begin, end, n, ys);
    }
  }
}

}  // namespace

ts::Lora ts::make_lora(at::Tensor a, at::Tensor bt, at::Tensor ranks, std::vector<int64_t> bounds, int64_t rank,
                       at::Tensor scales, int64_t outputs) {
  const int64_t P = static_cast<int64_t>(bounds.size()) - 1;
  TORCH_CHECK(P >= 1 && rank >= 1 && rank <= 256 && bounds.front() == 0 && bounds.back() == outputs,
              "bounds must cover the outputs, and a part has 1 to 256 ranks");
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3 && a.scalar_type() == bt.scalar_type() &&
                  (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kChar) &&
                  a.is_contiguous() && bt.is_contiguous() && a.size(0) == bt.size(0) && a.size(1) == P * rank &&
                  bt.size(1) == P * rank && bt.size(2) == outputs,
              "adapter factors must be contiguous float32, bfloat16 or int8 (N, P r, I) and (N, P r, O)");
  TORCH_CHECK(a.scalar_type() != at::kChar || (scales.defined() && scales.dim() == 2 &&
                                               scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                                               scales.size(0) == a.size(0) && scales.size(1) == P * rank),
              "int8 adapter factors need their scales: a contiguous (N, P r) float32 tensor");
  TORCH_CHECK(ranks.dim() == 2 && ranks.scalar_type() == at::kLong && ranks.is_contiguous() && ranks.size(0) == a.size(0) &&
                  ranks.size(1) == P,
              "adapter ranks must be a contiguous (N, P) int64 tensor");
  Lora l;
  l.dtype = a.scalar_type();
  l.ap = a.data_ptr();
  l.btp = bt.data_ptr();
  l.rp = ranks.data_ptr<int64_t>();
  l.sp = l.dtype == at::kChar ? scales.data_ptr<float>() : nullptr;
  l.N = a.size(0);
  l.PR = P * rank;
  l.I = a.size(2);
  l.O = outputs;
  l.P = P;
  l.a = std::move(a);
  l.bt = std::move(bt);
  l.ranks = std::move(ranks);
  l.scales = std::move(scales);
  l.bounds = std::move(bounds);
  l.rank = rank;
  return l;
}

bool ts::lora_fuses(const at::Tensor& x, const Lora& l, const int64_t* slots) {
  int64_t n = 0;
  for (int64_t b = 0; b < x.size(0); ++b) n += slots[b] >= 0;
  if (n < 1 || n > FUSED_ROWS) return false;
  check_fits(x, l, slots);
  return true;
}

void ts::LoraAfter::operator()(float* y, int64_t o0, int64_t o1) const {
  if (lora.dtype == at::kBFloat16) {
    after_typed<uint16_t>(x, y, lora, slots, o0, o1);
  } else if (lora.dtype == at::kChar) {
    after_typed<int8_t>(x, y, lora, slots, o0, o1);
  } else {
    after_typed<float>(x, y, lora, slots, o0, o1);
  }
}

void ts::lora_add(const at::Tensor& x, at::Tensor& y, const Lora& l, const int64_t* slots) {
  check_fits(x, l, slots);
  TORCH_CHECK(y.size(1) == l.O, "an adapter's factors do not fit the projection's outputs");
  if (l.dtype == at::kBFloat16) {
    lora_add_typed<uint16_t>(x, y, l, slots);
  } else if (l.dtype == at::kChar) {
    lora_add_typed<int8_t>(x, y, l, slots);
  } else {
    lora_add_typed<float>(x, y, l, slots);
  }
}

namespace {

// y (M, O) += each row's update from x (M, I), slots (M,) int64, in place (LoraLinear's torch op on the CPU,
// for prompts: every row of a prompt has its request's slot); `scales` for int8 factors
void lora_update_(const at::Tensor& x, at::Tensor& y, const at::Tensor& a, const at::Tensor& bt,
                  const at::Tensor& ranks, at::IntArrayRef bounds, int64_t rank, const at::Tensor& slots,
                  const c10::optional<at::Tensor>& scales) {
  const int64_t M = x.size(0);
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat &&
                  x.is_contiguous() && y.is_contiguous() && y.size(0) == M,
              "x and y must be (M, I) and (M, O) contiguous float32");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) == M,
              "slots must be a contiguous (M,) int64 tensor");
  const Lora l = make_lora(a, bt, ranks, std::vector<int64_t>(bounds.begin(), bounds.end()), rank,
                           scales.has_value() ? *scales : at::Tensor(), y.size(1));
  lora_add(x, y, l, slots.data_ptr<int64_t>());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ts_panels, m) {
  m.def("lora_update_(Tensor x, Tensor(y!) y, Tensor a, Tensor bt, Tensor ranks, int[] bounds, int rank, "
        "Tensor slots, Tensor? scales=None) -> ()");
}

TORCH_LIBRARY_IMPL(ts_panels, CPU, m) {
  m.impl("lora_update_", &lora_update_);
}
