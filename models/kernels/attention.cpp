// Decode attention straight from a paged KV cache (models/cache/paged.py): one new query token per
// row, each row attending exactly its own keys (no padding to the longest row, no mask), read in
// place through the row's block table (no gather copy).
//
// Layout of one layer's pool, flat (N * K * BS + 1, D) float32 or bfloat16 (each value widened to float32
// exactly as it is read): block n, head k, slot t at row (n * K + k) * BS + t (the last row is a trash
// slot no table names). A row's table lists its
// blocks in order; its keys are positions 0 .. lengths[b] - 1 (this step's key included).
//
// Work item (row b, key/value head k): its G = H / K query heads (grouped-query attention) share
// every key and value read, so each key/value byte is read once per step. Scores, softmax and the
// weighted sum are computed per item in a fixed order, whatever else is in the batch: a row's result
// does not depend on its batch (bitwise), as the projections' kernels (panels.cpp) guarantee.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
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

// attend() for a head dim of DV (a multiple of LANES): q and the output accumulators in registers, the
// scores of LANES keys at a time summed by one shuffle tree, each query head over the row's keys in turn.
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

// attend_pool's loop for pools of E (float: float32, uint16_t: bfloat16 bits)
template <typename E>
void attend_rows(const float* qp, const E* kp, const E* vp, const int64_t* tab, const int64_t* len, int64_t B,
                 int64_t H, int64_t D, int64_t M, int64_t kv_heads, int64_t block, float sc, float* op) {
  const int64_t G = H / kv_heads;
  at::parallel_for(0, B * kv_heads, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / kv_heads, kh = i % kv_heads;
      scores.resize(G * len[b]);
      const int64_t head = (b * H + kh * G) * D;  // its first query head
      const int64_t* t = tab + b * M;
      if (D == 32) {
        attend_fixed<32>(qp + head, kp, vp, t, len[b], kv_heads, kh, block, G, sc, op + head, scores.data());
      } else if (D == 64) {
        attend_fixed<64>(qp + head, kp, vp, t, len[b], kv_heads, kh, block, G, sc, op + head, scores.data());
      } else if (D == 128) {
        attend_fixed<128>(qp + head, kp, vp, t, len[b], kv_heads, kh, block, G, sc, op + head, scores.data());
      } else {
        attend(qp + head, kp, vp, t, len[b], kv_heads, kh, block, D, G, sc, op + head, scores.data());
      }
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
