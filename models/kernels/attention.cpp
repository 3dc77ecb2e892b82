// Decode attention straight from a paged KV cache (models/paged_cache.py): one new query token per
// row, each row attending exactly its own keys (no padding to the longest row, no mask), read in
// place through the row's block table (no gather copy).
//
// Layout of one layer's pool, flat (N * K * BS + 1, D) float32: block n, head k, slot t at row
// (n * K + k) * BS + t (the last row is a trash slot no table names). A row's table lists its
// blocks in order; its keys are positions 0 .. lengths[b] - 1 (this step's key included).
//
// Work item (row b, key/value head k): its G = H / K query heads (grouped-query attention) share
// every key and value read, so each key/value byte is read once per step. Scores, softmax and the
// weighted sum are computed per item in a fixed order, whatever else is in the batch: a row's result
// does not depend on its batch (bitwise), as the projections' kernels (panels.cpp) guarantee.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

#define TS_AVX512_ATTN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

TS_AVX512_ATTN inline float dot(const float* a, const float* b, int64_t d) {
  int64_t i = 0;
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  float s = _mm512_reduce_add_ps(acc);
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

TS_AVX512_ATTN inline void axpy(float w, const float* x, float* y, int64_t d) {
  int64_t i = 0;
  const __m512 wv = _mm512_set1_ps(w);
  for (; i + 16 <= d; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  for (; i < d; ++i) y[i] += w * x[i];
}

// softmax numerators in place, exp(x - max), over a row of S scores; returns their sum.
inline float exp_shifted(float* row, int64_t S) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < S; ++s) m = std::max(m, row[s]);
  float sum = 0.0f;
  for (int64_t s = 0; s < S; ++s) {
    row[s] = std::exp(row[s] - m);
    sum += row[s];
  }
  return sum;
}

// The sums of 16 vectors' lanes, one per lane of the result: out[t] = sum(v[t]). A tree of lane
// shuffles (4 levels, 15 adds) instead of 16 horizontal reductions.
TS_AVX512_ATTN inline __m512 sum16(__m512 (&v)[16]) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: w[i] low half partial sums of v[i], high half of v[i + 8]
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lanes of x[i]: v[i], v[i + 8], v[i + 4], v[i + 12]
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88), _mm512_shuffle_f32x4(w[i], w[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)  // per lane: pairs of x[i]'s and x[i + 2]'s vectors
    y[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[i], x[i + 2]), _mm512_unpackhi_ps(x[i], x[i + 2]));
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 2, 3, 2)));
  // z holds v0 v2 v1 v3 | v8 v10 v9 v11 | v4 v6 v5 v7 | v12 v14 v13 v15: back to order
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(order, z);
}

// attend() for a head dim of DV (a multiple of 16): q and the output accumulators in registers, the
// scores of 16 keys at a time summed by one shuffle tree, each query head over the row's keys in turn.
template <int DV>
TS_AVX512_ATTN void attend_fixed(const float* q, const float* k_pool, const float* v_pool, const int64_t* table,
                                 int64_t S, int64_t K, int64_t kh, int64_t BS, int64_t G, float scale, float* out,
                                 float* scores) {
  constexpr int NV = DV / 16;
  for (int64_t g = 0; g < G; ++g) {
    __m512 qv[NV];
    for (int i = 0; i < NV; ++i) qv[i] = _mm512_loadu_ps(q + g * DV + 16 * i);
    float* row = scores + g * S;
    for (int64_t s0 = 0; s0 < S; s0 += 16) {  // 16 keys (one block when BS = 16; a block may hold more)
      __m512 acc[16];
      const int64_t n = std::min<int64_t>(16, S - s0);
      for (int t = 0; t < 16; ++t) {
        acc[t] = _mm512_setzero_ps();
        if (t >= n) continue;
        const int64_t s = s0 + t;
        const float* kp = k_pool + ((table[s / BS] * K + kh) * BS + s % BS) * DV;
        for (int i = 0; i < NV; ++i) acc[t] = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(kp + 16 * i), acc[t]);
      }
      const __m512 sc = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
      _mm512_mask_storeu_ps(row + s0, static_cast<__mmask16>((1u << n) - 1u), sc);
    }
    const float sum = exp_shifted(row, S);
    __m512 o[NV];
    for (int i = 0; i < NV; ++i) o[i] = _mm512_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      const float* vp = v_pool + ((table[s / BS] * K + kh) * BS + s % BS) * DV;
      const __m512 w = _mm512_set1_ps(row[s]);
      for (int i = 0; i < NV; ++i) o[i] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vp + 16 * i), o[i]);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sum);
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(out + g * DV + 16 * i, _mm512_mul_ps(o[i], inv));
  }
}

// One (row, key/value head): q and out are its G query heads (G, D); scores is scratch (G, S).
TS_AVX512_ATTN void attend(const float* q, const float* k_pool, const float* v_pool, const int64_t* table, int64_t S,
                           int64_t K, int64_t kh, int64_t BS, int64_t D, int64_t G, float scale, float* out,
                           float* scores) {
  for (int64_t s0 = 0; s0 < S; s0 += BS) {
    const float* kb = k_pool + (table[s0 / BS] * K + kh) * BS * D;
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
    const float* vb = v_pool + (table[s0 / BS] * K + kh) * BS * D;
    const int64_t n = std::min(BS, S - s0);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t g = 0; g < G; ++g) axpy(scores[g * S + s0 + t], vb + t * D, out + g * D, D);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < D; ++i) out[g * D + i] *= inv[g];
  }
}

// q (B, H, D); k_pool, v_pool (N * K * BS + 1, D); tables (B, M) int64; lengths (B,) int64: keys per
// row, this step's included (>= 1). Returns (B, H, D).
at::Tensor paged_decode_f32(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& tables, const at::Tensor& lengths, int64_t kv_heads, int64_t block,
                            double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be a contiguous (B, H, D) float32 tensor");
  TORCH_CHECK(k_pool.scalar_type() == at::kFloat && v_pool.scalar_type() == at::kFloat && k_pool.is_contiguous() &&
                  v_pool.is_contiguous() && k_pool.dim() == 2 && k_pool.size(1) == q.size(2) && k_pool.sizes() == v_pool.sizes(),
              "the pools must be contiguous (N * K * BS + 1, D) float32 tensors");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.size(0) == q.size(0),
              "tables must be a contiguous (B, M) int64 tensor");
  TORCH_CHECK(lengths.dim() == 1 && lengths.scalar_type() == at::kLong && lengths.size(0) == q.size(0), "lengths must be (B,) int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), M = tables.size(1);
  TORCH_CHECK(kv_heads > 0 && H % kv_heads == 0 && block > 0, "H must be a multiple of kv_heads");
  const int64_t G = H / kv_heads;
  const int64_t blocks = (k_pool.size(0) - 1) / (kv_heads * block);
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
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * kv_heads, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / kv_heads, kh = i % kv_heads;
      scores.resize(G * len[b]);
      const int64_t head = (b * H + kh * G) * D;  // its first query head
      const int64_t* t = tab + b * M;
      if (D == 64) {
        attend_fixed<64>(qp + head, kp, vp, t, len[b], kv_heads, kh, block, G, sc, op + head, scores.data());
      } else if (D == 128) {
        attend_fixed<128>(qp + head, kp, vp, t, len[b], kv_heads, kh, block, G, sc, op + head, scores.data());
      } else {
        attend(qp + head, kp, vp, t, len[b], kv_heads, kh, block, D, G, sc, op + head, scores.data());
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ts_panels, m) {
  m.def("paged_decode_f32(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor lengths, int kv_heads, int block, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ts_panels, CPU, m) {
  m.impl("paged_decode_f32", &paged_decode_f32);
}
