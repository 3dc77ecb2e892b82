// Low-rank adapter updates of a projection's rows (models/adapters/lora.py's LoraLinear, inside the
// stack step of block_step.cpp): y_b += (x_b a_s^T) bt_s for each row b whose adapter slot s >= 0, part
// by part (a fused projection's parts each write their own outputs with their own ranks, and only the
// ranks the slot's adapter uses are read). The factors are float32 or bfloat16 (each value widened to
// float32 exactly as it is read); the products and sums are float32. Rows of one slot are computed
// together, up to ROWS per pass, so each slot's factors are read once per call however many rows use it;
// a row's result does not depend on the others (each output sums its ranks in order, then adds to the
// row), as the projections' kernels.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using namespace ts;

TS_TARGET inline vf load_as_float(const float* p) { return load(p); }
TS_TARGET inline vf load_as_float(const uint16_t* p) { return bf16s(p); }
inline float as_float(float v) { return v; }
inline float as_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Rows a pass of the two products takes together: each factor value is loaded once for all of them
constexpr int64_t ROWS = 4;

// t[k][q * stride] = sum_i a_k[i] * x_q[i] for the m <= 2 rank rows a_k (a_1 = a_0 + len) and the n <= ROWS
// rows x_q, lane by lane then across lanes: each (rank, row) sum is the same whatever is beside it
template <typename W>
TS_TARGET void dots(const W* a, int64_t m, const float* const* x, int64_t n, int64_t len, float* t, int64_t stride) {
  vf acc[2][ROWS] = {{zero(), zero(), zero(), zero()}, {zero(), zero(), zero(), zero()}};
  int64_t i = 0;
  for (; i + LANES <= len; i += LANES) {
    const vf a0 = load_as_float(a + i);
    const vf a1 = m > 1 ? load_as_float(a + len + i) : a0;
    for (int64_t q = 0; q < n; ++q) {
      const vf xv = load(x[q] + i);
      acc[0][q] = fmadd(a0, xv, acc[0][q]);
      acc[1][q] = fmadd(a1, xv, acc[1][q]);
    }
  }
  for (int64_t k = 0; k < m; ++k) {
    for (int64_t q = 0; q < n; ++q) {
      float s = reduce_add(acc[k][q]);
      for (int64_t e = i; e < len; ++e) s += as_float(a[k * len + e]) * x[q][e];
      t[k + q * stride] = s;
    }
  }
}

// y_q[o] += sum_j t_q[j] * bt[j * O + o] over `used` ranks in order, for outputs [0, width) and the
// n <= ROWS rows y_q: each bt value is loaded once for the n rows, two vectors of outputs a pass
template <typename W>
TS_TARGET void updates(const float* const* t, const W* bt, int64_t O, int64_t used, int64_t n, int64_t width,
                       float* const* y) {
  int64_t o = 0;
  for (; o + 2 * LANES <= width; o += 2 * LANES) {
    vf acc[2][ROWS] = {{zero(), zero(), zero(), zero()}, {zero(), zero(), zero(), zero()}};
    for (int64_t j = 0; j < used; ++j) {
      const vf b0 = load_as_float(bt + j * O + o), b1 = load_as_float(bt + j * O + o + LANES);
      for (int64_t q = 0; q < n; ++q) {
        const vf tv = set1(t[q][j]);
        acc[0][q] = fmadd(tv, b0, acc[0][q]);
        acc[1][q] = fmadd(tv, b1, acc[1][q]);
      }
    }
    for (int64_t q = 0; q < n; ++q) {
      store(y[q] + o, add(load(y[q] + o), acc[0][q]));
      store(y[q] + o + LANES, add(load(y[q] + o + LANES), acc[1][q]));
    }
  }
  for (; o + LANES <= width; o += LANES) {
    vf acc[ROWS] = {zero(), zero(), zero(), zero()};
    for (int64_t j = 0; j < used; ++j) {
      const vf vb = load_as_float(bt + j * O + o);
      for (int64_t q = 0; q < n; ++q) acc[q] = fmadd(set1(t[q][j]), vb, acc[q]);
    }
    for (int64_t q = 0; q < n; ++q) store(y[q] + o, add(load(y[q] + o), acc[q]));
  }
  for (; o < width; ++o) {
    for (int64_t q = 0; q < n; ++q) {
      float s = 0.0f;
      for (int64_t j = 0; j < used; ++j) s += t[q][j] * as_float(bt[j * O + o]);
      y[q][o] += s;
    }
  }
}

// Rows one task takes (in passes of ROWS): a group of more rows is split so that both threads share it
constexpr int64_t TASK_ROWS = 8;
// multiply-adds a parallel region must have per thread to be worth waking the others (a decode step's few
// rows stay on one thread: waking them costs more than a small update)
constexpr int64_t TASK_WORK = 1 << 17;

template <typename W>
void lora_add_typed(const at::Tensor& x, at::Tensor& y, const Lora& l, const int64_t* slots) {
  const int64_t R = x.size(0), I = x.size(1), O = y.size(1), N = l.a.size(0), PR = l.a.size(1);
  const int64_t P = static_cast<int64_t>(l.bounds.size()) - 1;
  // rows grouped by slot (stable)
  std::vector<int64_t> order;
  for (int64_t b = 0; b < R; ++b) {
    if (slots[b] >= 0) {
      TORCH_CHECK(slots[b] < N, "adapter slot ", slots[b], " outside the ", N, " slots");
      order.push_back(b);
    }
  }
  if (order.empty()) return;
  std::stable_sort(order.begin(), order.end(), [&](int64_t u, int64_t v) { return slots[u] < slots[v]; });
  const int64_t* ranks = l.ranks.data_ptr<int64_t>();
  // tasks (first row in `order`, rows, part): a slot's rows in blocks of TASK_ROWS, for each part it uses;
  // a task computes both products of its rows and part, so one parallel region does the whole update
  std::vector<int64_t> tasks;
  int64_t work = 0;
  const int64_t n_rows = static_cast<int64_t>(order.size());
  for (int64_t g0 = 0, g1 = 0; g0 < n_rows; g0 = g1) {
    const int64_t s = slots[order[g0]];
    for (g1 = g0; g1 < n_rows && slots[order[g1]] == s; ++g1) {
    }
    for (int64_t p = 0; p < P; ++p) {
      const int64_t used = ranks[s * P + p];
      if (used == 0) continue;
      for (int64_t r0 = g0; r0 < g1; r0 += TASK_ROWS) {
        const int64_t n = std::min(TASK_ROWS, g1 - r0);
        tasks.insert(tasks.end(), {r0, n, p});
        work += n * used * (I + l.bounds[p + 1] - l.bounds[p]);
      }
    }
  }
  const int64_t T = static_cast<int64_t>(tasks.size()) / 3;
  if (T == 0) return;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const W* ap = reinterpret_cast<const W*>(l.a.data_ptr());
  const W* btp = reinterpret_cast<const W*>(l.bt.data_ptr());
  at::parallel_for(0, T, std::max<int64_t>(1, TASK_WORK * T / std::max<int64_t>(work, 1)), [&](int64_t t0, int64_t t1) {
    float t[TASK_ROWS * 256];  // the task's rows' first products (ranks a part <= 256: Blocks::set_lora)
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t r0 = tasks[3 * task], n = tasks[3 * task + 1], p = tasks[3 * task + 2];
      const int64_t s = slots[order[r0]], used = ranks[s * P + p], o0 = l.bounds[p];
      const W* a = ap + (s * PR + p * l.rank) * I;  // (used, I)
      const W* bt = btp + (s * PR + p * l.rank) * O + o0;  // (used, O) from o0
      for (int64_t q0 = 0; q0 < n; q0 += ROWS) {
        const int64_t m = std::min(ROWS, n - q0);
        const float* xs[ROWS];
        const float* ts[ROWS];
        float* ys[ROWS];
        for (int64_t q = 0; q < m; ++q) {
          xs[q] = xp + order[r0 + q0 + q] * I;
          ts[q] = t + (q0 + q) * used;
          ys[q] = yp + order[r0 + q0 + q] * O + o0;
        }
        for (int64_t j = 0; j < used; j += 2) dots(a + j * I, std::min<int64_t>(2, used - j), xs, m, I, t + q0 * used + j, used);
        updates(ts, bt, O, used, m, l.bounds[p + 1] - o0, ys);
      }
    }
  });
}

}  // namespace

void ts::lora_add(const at::Tensor& x, at::Tensor& y, const Lora& l, const int64_t* slots) {
  TORCH_CHECK(l.a.size(2) == x.size(1) && l.bt.size(2) == y.size(1) && l.bt.size(1) == l.a.size(1) &&
                  l.a.size(1) == (static_cast<int64_t>(l.bounds.size()) - 1) * l.rank,
              "an adapter's factors do not fit the projection");
  if (l.a.scalar_type() == at::kBFloat16) {
    lora_add_typed<uint16_t>(x, y, l, slots);
  } else {
    lora_add_typed<float>(x, y, l, slots);
  }
}

namespace {

// y (M, O) plus each row's update from x (M, I), slots (M,) int64: a new tensor (LoraLinear's torch op on
// the CPU, for prompts: every row of a prompt has its request's slot)
at::Tensor lora_update(const at::Tensor& x, const at::Tensor& y, const at::Tensor& a, const at::Tensor& bt,
                       const at::Tensor& ranks, at::IntArrayRef bounds, int64_t rank, const at::Tensor& slots) {
  const int64_t M = x.size(0);
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat &&
                  x.is_contiguous() && y.size(0) == M,
              "x and y must be (M, I) contiguous and (M, O) float32");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) == M,
              "slots must be a contiguous (M,) int64 tensor");
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3 && a.scalar_type() == bt.scalar_type() &&
                  (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16) && a.is_contiguous() &&
                  bt.is_contiguous() && ranks.scalar_type() == at::kLong && ranks.is_contiguous() && rank >= 1 &&
                  rank <= 256 && !bounds.empty() && bounds.front() == 0 && bounds.back() == y.size(1),
              "adapter factors, ranks and bounds as Blocks::set_lora takes them");
  at::Tensor out = y.contiguous().clone();
  const Lora l{a, bt, ranks, std::vector<int64_t>(bounds.begin(), bounds.end()), rank};
  lora_add(x, out, l, slots.data_ptr<int64_t>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ts_panels, m) {
  m.def("lora_update(Tensor x, Tensor y, Tensor a, Tensor bt, Tensor ranks, int[] bounds, int rank, Tensor slots) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(ts_panels, CPU, m) { m.impl("lora_update", &lora_update); }
