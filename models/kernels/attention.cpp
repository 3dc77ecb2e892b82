// Decode attention straight from a paged KV cache (models/cache/paged.py): one new query token per
// row, each row attending exactly its own keys (no padding to the longest row, no mask), read in
// place through the row's block table (no gather copy).
//
// Layout of one layer's pool, flat (N * K * BS + 1, D) float32 or bfloat16 (each value widened to float32
// exactly as it is read): block n, head k, slot t at row (n * K + k) * BS + t (the last row is a trash
// slot no table names). A row's table lists its
// blocks in order; its keys are positions 0 .. lengths[b] - 1 (this step's key included).
//
// A step's entries are rows' new tokens; a row may have several, at consecutive positions (speculative
// decoding verifies drafted tokens as entries). Work item: the entries of one row (one block table)
// for one key/value head, with its G = H / K query heads (grouped-query attention) together or one
// of them an item (attend_rows): every key and value is read and widened once for all the item's
// queries. Each query's scores, softmax and weighted sum are computed in a fixed order, whatever else
// is in the batch or the item: an entry's result does not depend on its batch (bitwise), as the
// projections' kernels (panels.cpp) guarantee.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using namespace ts;

template <typename E>
TS_TARGET inline float dot(const float* a, const E* b, int64_t d) {
  int64_t i = 0;
  vf acc = zero();
  for (; i + LANES <= d; i += LANES) acc = fmadd(load(a + i), widen(b + i), acc);
  float s = reduce_add(acc);
  for (; i < d; ++i) s += a[i] * widen1(b[i]);
  return s;
}

template <typename E>
TS_TARGET inline void axpy(float w, const E* x, float* y, int64_t d) {
  int64_t i = 0;
  const vf wv = set1(w);
  for (; i + LANES <= d; i += LANES) store(y + i, fmadd(wv, widen(x + i), load(y + i)));
  for (; i < d; ++i) y[i] += w * widen1(x[i]);
}

// softmax numerators in place, exp(x - max), over a row of S scores; returns their sum (the lanes'
// partial sums, then the tail's, in a fixed order).
TS_TARGET inline float exp_shifted(float* row, int64_t S) {
  vf mv = set1(-std::numeric_limits<float>::infinity());
  int64_t s = 0;
  for (; s + LANES <= S; s += LANES) mv = max(mv, load(row + s));
  float m = reduce_max(mv);
  for (; s < S; ++s) m = std::max(m, row[s]);
  const vf shift = set1(-m);
  vf acc = zero();
  for (s = 0; s + LANES <= S; s += LANES) {
    const vf e = ts::exp(add(load(row + s), shift));
    store(row + s, e);
    acc = add(acc, e);
  }
  float sum = reduce_add(acc);
  if (s < S) {
    alignas(64) float buf[LANES];
    const int64_t n = S - s;
    for (int64_t i = 0; i < LANES; ++i) buf[i] = i < n ? row[s + i] - m : 0.0f;
    store(buf, ts::exp(load(buf)));
    for (int64_t i = 0; i < n; ++i) {
      row[s + i] = buf[i];
      sum += buf[i];
    }
  }
  return sum;
}

// A row's key (or value) slots in order through its block table, without a division per key:
// slot s is at ((table[s / BS] * K + kh) * BS + s % BS) * D of the pool.
template <typename E>
struct Slots {
  const E* pool;
  const int64_t* table;
  int64_t K, kh, BS, D;
  int64_t block = 0, offset = 0;
  const E* next() {
    const E* p = pool + ((table[block] * K + kh) * BS + offset) * D;
    if (++offset == BS) {
      ++block;
      offset = 0;
    }
    return p;
  }
};

// One entry's G query heads (G, DV) for key/value head kh, DV a multiple of LANES: q and the output
// accumulators in registers, the scores of LANES keys at a time summed by one shuffle tree, each query
// head over the row's keys in turn (keys widened as they are read).
template <int DV, typename E>
TS_TARGET void attend_fixed(const float* q, const E* k_pool, const E* v_pool, const int64_t* table,
                            int64_t S, int64_t K, int64_t kh, int64_t BS, int64_t G, float scale, float* out,
                            float* scores) {
  constexpr int NV = DV / LANES;
  for (int64_t g = 0; g < G; ++g) {
    vf qv[NV];
    for (int i = 0; i < NV; ++i) qv[i] = load(q + g * DV + LANES * i);
    float* row = scores + g * S;
    Slots<E> keys{k_pool, table, K, kh, BS, DV};
    for (int64_t s0 = 0; s0 < S; s0 += LANES) {  // LANES keys (a block holds BS = 16)
      vf acc[LANES];
      const int64_t n = std::min<int64_t>(LANES, S - s0);
      for (int t = 0; t < LANES; ++t) {
        acc[t] = zero();
        if (t >= n) continue;
        const E* kp = keys.next();
        for (int i = 0; i < NV; ++i) acc[t] = fmadd(qv[i], widen(kp + LANES * i), acc[t]);
      }
      const vf sc = mul(sum_lanes(acc), set1(scale));
      if (n == LANES) {
        store(row + s0, sc);
      } else {
        store_first(row + s0, sc, n);
      }
    }
    const float sum = exp_shifted(row, S);
    vf o[NV];
    for (int i = 0; i < NV; ++i) o[i] = zero();
    Slots<E> values{v_pool, table, K, kh, BS, DV};
    for (int64_t s = 0; s < S; ++s) {
      const E* vp = values.next();
      const vf w = set1(row[s]);
      for (int i = 0; i < NV; ++i) o[i] = fmadd(w, widen(vp + LANES * i), o[i]);
    }
    const vf inv = set1(1.0f / sum);
    for (int i = 0; i < NV; ++i) store(out + g * DV + LANES * i, mul(o[i], inv));
  }
}

// One (row, key/value head): q and out are its G query heads (G, D); scores is scratch (G, S).
template <typename E>
TS_TARGET void attend(const float* q, const E* k_pool, const E* v_pool, const int64_t* table, int64_t S,
                           int64_t K, int64_t kh, int64_t BS, int64_t D, int64_t G, float scale, float* out,
                           float* scores) {
  for (int64_t s0 = 0; s0 < S; s0 += BS) {
    const E* kb = k_pool + (table[s0 / BS] * K + kh) * BS * D;
    const int64_t n = std::min(BS, S - s0);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t g = 0; g < G; ++g) scores[g * S + s0 + t] = dot(q + g * D, kb + t * D, D) * scale;
    }
  }
  std::vector<float> inv(G);
  for (int64_t g = 0; g < G; ++g) {
    inv[g] = 1.0f / exp_shifted(scores + g * S, S);
    std::fill(out + g * D, out + (g + 1) * D, 0.0f);
  }
  for (int64_t s0 = 0; s0 < S; s0 += BS) {
    const E* vb = v_pool + (table[s0 / BS] * K + kh) * BS * D;
    const int64_t n = std::min(BS, S - s0);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t g = 0; g < G; ++g) axpy(scores[g * S + s0 + t], vb + t * D, out + g * D, D);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < D; ++i) out[g * D + i] *= inv[g];
  }
}

// The next n slots of `slots` (n <= LANES) as float32 rows of DV into buf (LANES, DV).
template <int DV, typename E>
TS_TARGET inline void widen_next(Slots<E>& slots, int64_t n, float* buf) {
  for (int64_t t = 0; t < n; ++t) {
    const E* p = slots.next();
    for (int i = 0; i < DV / LANES; ++i) store(buf + t * DV + LANES * i, widen(p + LANES * i));
  }
}

// attend_fixed()'s sums for the queries of entries [b0, b1) that share a block table (one row's entries;
// lengths may differ) and query heads [g0, g1) of key/value head kh, each LANES keys (then values)
// widened once into float32 scratch for all of them: each query's result is bitwise attend_fixed's.
// Queries of entry b, head g at q[(b * H + kh * G + g) * DV], and so the outputs.
template <int DV, typename E>
TS_TARGET void attend_shared(const float* q, const E* k_pool, const E* v_pool, const int64_t* table,
                             const int64_t* len, int64_t b0, int64_t b1, int64_t g0, int64_t g1, int64_t H,
                             int64_t K, int64_t kh, int64_t BS, int64_t G, float scale, float* out,
                             std::vector<float>& scratch) {
  constexpr int NV = DV / LANES;
  const int64_t NG = g1 - g0, Q = (b1 - b0) * NG;
  int64_t S = 0;
  for (int64_t b = b0; b < b1; ++b) S = std::max(S, len[b]);
  scratch.resize(Q * S + Q);  // each query's scores (S), then its 1 / softmax sum
  float* inv = scratch.data() + Q * S;
  alignas(64) float buf[LANES * DV];  // LANES keys or values as float32
  auto at = [&](int64_t j) { return ((b0 + j / NG) * H + kh * G + g0 + j % NG) * DV; };
  Slots<E> keys{k_pool, table, K, kh, BS, DV};
  for (int64_t s0 = 0; s0 < S; s0 += LANES) {
    widen_next<DV>(keys, std::min<int64_t>(LANES, S - s0), buf);
    for (int64_t j = 0; j < Q; ++j) {
      const int64_t m = std::min<int64_t>(LANES, len[b0 + j / NG] - s0);
      if (m <= 0) continue;
      vf qv[NV];
      for (int i = 0; i < NV; ++i) qv[i] = load(q + at(j) + LANES * i);
      vf acc[LANES];
      for (int t = 0; t < LANES; ++t) {
        acc[t] = zero();
        if (t >= m) continue;
        for (int i = 0; i < NV; ++i) acc[t] = fmadd(qv[i], load(buf + t * DV + LANES * i), acc[t]);
      }
      const vf sc = mul(sum_lanes(acc), set1(scale));
      float* row = scratch.data() + j * S;
      if (m == LANES) {
        store(row + s0, sc);
      } else {
        store_first(row + s0, sc, m);
      }
    }
  }
  for (int64_t j = 0; j < Q; ++j) {
    inv[j] = 1.0f / exp_shifted(scratch.data() + j * S, len[b0 + j / NG]);
    std::fill(out + at(j), out + at(j) + DV, 0.0f);
  }
  Slots<E> values{v_pool, table, K, kh, BS, DV};
  for (int64_t s0 = 0; s0 < S; s0 += LANES) {
    widen_next<DV>(values, std::min<int64_t>(LANES, S - s0), buf);
    for (int64_t j = 0; j < Q; ++j) {
      const int64_t m = std::min<int64_t>(LANES, len[b0 + j / NG] - s0);
      if (m <= 0) continue;
      float* o = out + at(j);
      const float* row = scratch.data() + j * S + s0;
      vf ov[NV];
      for (int i = 0; i < NV; ++i) ov[i] = load(o + LANES * i);
      for (int64_t t = 0; t < m; ++t) {
        const vf w = set1(row[t]);
        for (int i = 0; i < NV; ++i) ov[i] = fmadd(w, load(buf + t * DV + LANES * i), ov[i]);
      }
      for (int i = 0; i < NV; ++i) store(o + LANES * i, ov[i]);
    }
  }
  for (int64_t j = 0; j < Q; ++j) {
    const vf iv = set1(inv[j]);
    for (int i = 0; i < NV; ++i) store(out + at(j) + LANES * i, mul(load(out + at(j) + LANES * i), iv));
  }
}

// attend_pool's loop for pools of E (float: float32, uint16_t: bfloat16 bits). Head dims of 32, 64 and
// 128: work items are runs of consecutive entries with the same block table by key/value head: a run of
// one entry by attend_fixed, a longer one (a row's drafted tokens) by attend_shared, one query head an
// item where the runs are too few to keep the threads busy. Other head dims: an item per (entry,
// key/value head). An entry's result does not depend on the items it is computed in.
template <typename E>
void attend_rows(const float* qp, const E* kp, const E* vp, const int64_t* tab, const int64_t* len, int64_t B,
                 int64_t H, int64_t D, int64_t M, int64_t kv_heads, int64_t block, float sc, float* op) {
  const int64_t G = H / kv_heads;
  if (D == 32 || D == 64 || D == 128) {
    std::vector<int64_t> starts{0};  // runs [starts[r], starts[r + 1]) of entries sharing a table
    for (int64_t b = 1; b < B; ++b) {
      if (!std::equal(tab + b * M, tab + (b + 1) * M, tab + (b - 1) * M)) starts.push_back(b);
    }
    starts.push_back(B);
    const int64_t runs = static_cast<int64_t>(starts.size()) - 1;
    const bool split = runs * kv_heads < 4 * at::get_num_threads();
    std::vector<std::array<int64_t, 3>> items;  // (run, kh, first query head); G / per heads each
    for (int64_t r = 0; r < runs; ++r) {
      const int64_t per = split && starts[r + 1] - starts[r] > 1 ? 1 : G;
      for (int64_t kh = 0; kh < kv_heads; ++kh) {
        for (int64_t g = 0; g < G; g += per) items.push_back({r, kh, g});
      }
    }
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> scratch;
      for (int64_t i = i0; i < i1; ++i) {
        const auto [r, kh, g0] = items[i];
        const int64_t b0 = starts[r], b1 = starts[r + 1], g1 = b1 - b0 > 1 && split ? g0 + 1 : G;
        const int64_t* t = tab + b0 * M;
        if (b1 - b0 == 1) {
          const int64_t head = (b0 * H + kh * G) * D;
          scratch.resize(G * len[b0]);
          if (D == 32) {
            attend_fixed<32>(qp + head, kp, vp, t, len[b0], kv_heads, kh, block, G, sc, op + head, scratch.data());
          } else if (D == 64) {
            attend_fixed<64>(qp + head, kp, vp, t, len[b0], kv_heads, kh, block, G, sc, op + head, scratch.data());
          } else {
            attend_fixed<128>(qp + head, kp, vp, t, len[b0], kv_heads, kh, block, G, sc, op + head, scratch.data());
          }
        } else if (D == 32) {
          attend_shared<32>(qp, kp, vp, t, len, b0, b1, g0, g1, H, kv_heads, kh, block, G, sc, op, scratch);
        } else if (D == 64) {
          attend_shared<64>(qp, kp, vp, t, len, b0, b1, g0, g1, H, kv_heads, kh, block, G, sc, op, scratch);
        } else {
          attend_shared<128>(qp, kp, vp, t, len, b0, b1, g0, g1, H, kv_heads, kh, block, G, sc, op, scratch);
        }
      }
    });
    return;
  }
  at::parallel_for(0, B * kv_heads, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / kv_heads, kh = i % kv_heads;
      scores.resize(G * len[b]);
      const int64_t head = (b * H + kh * G) * D;  // its first query head
      attend(qp + head, kp, vp, tab + b * M, len[b], kv_heads, kh, block, D, G, sc, op + head, scores.data());
    }
  });
}

// q (B, H, D) float32; k_pool, v_pool (blocks * K * BS [+ 1], D) float32 or bfloat16, both alike; tables
// (B, M) int64; lengths (B,) int64: keys per row, this step's included (>= 1). Returns (B, H, D) float32.
at::Tensor attend_pool(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                       const at::Tensor& tables, const at::Tensor& lengths, int64_t kv_heads, int64_t block,
                       double scale, int64_t blocks) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be a contiguous (B, H, D) float32 tensor");
  const bool bf16 = k_pool.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || k_pool.scalar_type() == at::kFloat) && v_pool.scalar_type() == k_pool.scalar_type() &&
                  k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.dim() == 2 && k_pool.size(1) == q.size(2) &&
                  k_pool.sizes() == v_pool.sizes(),
              "the pools must be contiguous (N * K * BS + 1, D) tensors, both float32 or both bfloat16");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.size(0) == q.size(0),
              "tables must be a contiguous (B, M) int64 tensor");
  TORCH_CHECK(lengths.dim() == 1 && lengths.scalar_type() == at::kLong && lengths.size(0) == q.size(0), "lengths must be (B,) int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), M = tables.size(1);
  TORCH_CHECK(kv_heads > 0 && H % kv_heads == 0 && block > 0, "H must be a multiple of kv_heads");
  TORCH_CHECK(blocks * kv_heads * block <= k_pool.size(0), "the pool holds fewer than ", blocks, " blocks");
  const at::Tensor lens = lengths.contiguous();
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= M * block, "row ", b, " has ", len[b], " keys; its table holds ", M * block);
    for (int64_t j = 0; j < (len[b] + block - 1) / block; ++j) {
      TORCH_CHECK(tab[b * M + j] >= 0 && tab[b * M + j] < blocks, "row ", b, " names block ", tab[b * M + j], " outside the pool");
    }
  }
  at::Tensor out = at::empty_like(q);
  const float sc = static_cast<float>(scale);
  if (bf16) {
    attend_rows(q.data_ptr<float>(), reinterpret_cast<const uint16_t*>(k_pool.data_ptr()),
                reinterpret_cast<const uint16_t*>(v_pool.data_ptr()), tab, len, B, H, D, M, kv_heads, block, sc,
                out.data_ptr<float>());
  } else {
    attend_rows(q.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), tab, len, B, H, D, M,
                kv_heads, block, sc, out.data_ptr<float>());
  }
  return out;
}

// The torch op: a paged KV cache's pool, (N * K * BS + 1, D) with its trash row last.
at::Tensor paged_decode_op(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& tables, const at::Tensor& lengths, int64_t kv_heads, int64_t block,
                           double scale) {
  TORCH_CHECK(kv_heads > 0 && block > 0, "kv_heads and block must be positive");
  return attend_pool(q, k_pool, v_pool, tables, lengths, kv_heads, block, scale,
                     (k_pool.size(0) - 1) / (kv_heads * block));
}

}  // namespace

at::Tensor ts::paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& tables, const at::Tensor& lengths, int64_t kv_heads, int64_t block,
                            double scale) {
  return paged_decode_op(q, k_pool, v_pool, tables, lengths, kv_heads, block, scale);
}

at::Tensor ts::sources_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& sources, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.size(3) == q.size(2) && k.is_contiguous() && v.is_contiguous(),
              "cross keys and values must be contiguous (N, K, S, D) tensors");
  const int64_t N = k.size(0), K = k.size(1), S = k.size(2), D = k.size(3);
  TORCH_CHECK(S > 0, "cross keys need a source position");
  // source n's keys are block n of a pool whose blocks hold S slots: its table is just n
  return attend_pool(q, k.view({N * K * S, D}), v.view({N * K * S, D}), sources, lengths, K, S, scale, N);
}

TORCH_LIBRARY_FRAGMENT(ts_panels, m) {
  m.def("paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor lengths, int kv_heads, int block, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ts_panels, CPU, m) {
  m.impl("paged_decode", &paged_decode_op);
}
