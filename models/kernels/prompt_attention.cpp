// Prompt attention straight from a paged KV cache (models/cache/paged.py): T new query tokens a row (a
// prompt, a chunk of one after its cached keys, a preempted request's recompute), query t of row b at
// position past[b] + t attending keys 0 .. past[b] + t (causal, after the row's past keys), read in
// place through the row's block table. This step's keys are in the pool already.
//
// Layout: q (B, H, T, D) float32, any strides but a contiguous last dim; the pools as attention.cpp's
// (N * K * BS + 1, D) float32 or bfloat16; tables (B, M) int64; keys (B,) int64 = past + T. The
// output is (B, T, H, D) float32, returned as its (B, H, T, D) view (the o projection reads it as
// (B, T, H D) without a copy).
//
// Work item (row b, key/value head kh, a tile of TQ query tokens): its G = H / K query heads x TQ
// tokens are M query rows, transposed once into (D, M) so that scores are computed LANES rows at a
// time. Keys go by in tiles of BK at fixed positions (multiples of BK), widened to float32 once per
// item; an online softmax (flash attention) keeps each row's running max, sum and output. Every float
// operation of a query row is lane-wise in that row or summed over keys in order, so a row's output
// is bitwise the same alone, in any batch, in any tile of queries, and whether its prompt is computed
// whole or in chunks after cached keys (masked keys add exact zeros, a tile with no key of a row
// leaves it exactly as it was); and the same at either vector width.
//
// bf16_products (the AVX512-BF16 build only): the two products in bfloat16 pairs by vdpbf16ps, q and
// the softmax weights rounded to bfloat16, for prompts whose projections round their inputs to
// bfloat16 already; half the instructions, the same row-wise guarantees within that build.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using namespace ts;

constexpr int64_t BK = 64;                       // keys a tile
constexpr int QJ = LANES == 16 ? 6 : 2;          // keys per scores block
constexpr int QRV = 4;                           // row vectors per scores block
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// How the two products multiply: float32 lanes by fused multiply-adds, or (the AVX512-BF16 build)
// bfloat16 pairs by vdpbf16ps, each 32-bit lane two values summed into one float32 lane. T is what q,
// keys, weights and values are kept as in the scratch (a float, or a pair of bfloat16 bits).
struct F32 {
  using T = float;
  using V = vf;
  TS_TARGET static V lanes(const T* p) { return load(p); }
  TS_TARGET static V one(T x) { return set1(x); }
  TS_TARGET static vf madd(vf acc, V a, V b) { return fmadd(a, b, acc); }
};

#if defined(TS_BF16)
struct BF16 {
  using T = uint32_t;
  using V = vi;
  TS_TARGET static V lanes(const T* p) { return load_i(p); }
  TS_TARGET static V one(T x) { return set1_i32(static_cast<int32_t>(x)); }
  TS_TARGET static vf madd(vf acc, V a, V b) { return dot_bf16(acc, a, b); }
};
#endif

// st (J keys, RV row vectors) = kp (J, n) . qt (n, rows at r0): each score summed over its n steps
// (d, or pairs of d) in order
template <typename P, int J, int RV>
TS_TARGET void scores_block(const typename P::T* qt, int64_t mp, int64_t r0, const typename P::T* kp, int64_t n,
                            float* st) {
  vf acc[J][RV];
  for (int j = 0; j < J; ++j)
    for (int v = 0; v < RV; ++v) acc[j][v] = zero();
  for (int64_t d = 0; d < n; ++d) {
    typename P::V q[RV];
    for (int v = 0; v < RV; ++v) q[v] = P::lanes(qt + d * mp + r0 + v * LANES);
    for (int j = 0; j < J; ++j) {
      const typename P::V k = P::one(kp[j * n + d]);
      for (int v = 0; v < RV; ++v) acc[j][v] = P::madd(acc[j][v], q[v], k);
    }
  }
  for (int j = 0; j < J; ++j)
    for (int v = 0; v < RV; ++v) store(st + j * mp + r0 + v * LANES, acc[j][v]);
}

template <typename P, int J>
TS_TARGET void scores_rows(const typename P::T* qt, int64_t mp, int64_t rv0, int64_t rv1, const typename P::T* kp,
                           int64_t n, float* st) {
  int64_t rv = rv0;
  for (; rv + QRV <= rv1; rv += QRV) scores_block<P, J, QRV>(qt, mp, rv * LANES, kp, n, st);
  switch (rv1 - rv) {
    case 3: scores_block<P, J, 3>(qt, mp, rv * LANES, kp, n, st); break;
    case 2: scores_block<P, J, 2>(qt, mp, rv * LANES, kp, n, st); break;
    case 1: scores_block<P, J, 1>(qt, mp, rv * LANES, kp, n, st); break;
    default: break;
  }
}

// st (nk keys, mp rows) for row vectors [rv0, rv1)
template <typename P>
TS_TARGET void scores(const typename P::T* qt, int64_t mp, int64_t rv0, int64_t rv1, const typename P::T* kp,
                      int64_t nk, int64_t n, float* st) {
  int64_t j = 0;
  for (; j + QJ <= nk; j += QJ) scores_rows<P, QJ>(qt, mp, rv0, rv1, kp + j * n, n, st + j * mp);
  for (; j < nk; ++j) scores_rows<P, 1>(qt, mp, rv0, rv1, kp + j * n, n, st + j * mp);
}

// o (R rows of D) = o * alpha + sum over the tile's n steps (keys, or pairs of keys), in order, of the
// step's weights of row r (pt[j * mp + r]) times its values (vp (n, D))
template <typename P, int R, int DV>
TS_TARGET void values_block(const typename P::T* pt, int64_t mp, int64_t r0, const float* alpha,
                            const typename P::T* vp, int64_t n, float* o) {
  constexpr int64_t D = DV * LANES;
  vf acc[R][DV];
  for (int r = 0; r < R; ++r) {
    const vf a = set1(alpha[r0 + r]);
    for (int i = 0; i < DV; ++i) acc[r][i] = mul(load(o + (r0 + r) * D + i * LANES), a);
  }
  for (int64_t j = 0; j < n; ++j) {
    typename P::V v[DV];
    for (int i = 0; i < DV; ++i) v[i] = P::lanes(vp + j * D + i * LANES);
    for (int r = 0; r < R; ++r) {
      const typename P::V p = P::one(pt[j * mp + r0 + r]);
      for (int i = 0; i < DV; ++i) acc[r][i] = P::madd(acc[r][i], v[i], p);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < DV; ++i) store(o + (r0 + r) * D + i * LANES, acc[r][i]);
}

template <int DV>
constexpr int value_rows() {
  return LANES == 16 ? (DV <= 2 ? 12 : DV == 4 ? 6 : DV == 8 ? 3 : 1) : (DV <= 2 ? 6 : DV == 4 ? 3 : 1);
}

template <typename P, int DV, int R>
TS_TARGET void values_tail(const typename P::T* pt, int64_t mp, int64_t r0, int64_t rows, const float* alpha,
                           const typename P::T* vp, int64_t n, float* o) {
  if constexpr (R > 0) {
    if (rows >= R) {
      values_block<P, R, DV>(pt, mp, r0, alpha, vp, n, o);
      values_tail<P, DV, R>(pt, mp, r0 + R, rows - R, alpha, vp, n, o);
    } else {
      values_tail<P, DV, R - 1>(pt, mp, r0, rows, alpha, vp, n, o);
    }
  }
}

// rows [r0, r1): o = o * alpha + p v
template <typename P, int DV>
TS_TARGET void values(const typename P::T* pt, int64_t mp, int64_t r0, int64_t r1, const float* alpha,
                      const typename P::T* vp, int64_t n, float* o) {
  constexpr int R = value_rows<DV>();
  int64_t r = r0;
  for (; r + R <= r1; r += R) values_block<P, R, DV>(pt, mp, r, alpha, vp, n, o);
  values_tail<P, DV, R - 1>(pt, mp, r, r1 - r, alpha, vp, n, o);
}

#if defined(TS_BF16)
// bfloat16 products (AVX512-BF16's vdpbf16ps: each pair's products exact, summed in float32 with the
// instruction's own rounding, the same in every lane): for prompts whose projections already round their
// inputs to bfloat16 (the bfloat16 panels), q and the softmax weights are rounded to bfloat16 (nearest,
// ties to even, as torch rounds) and keys and values read as bfloat16.

inline uint32_t bf16_bits(float x) {  // round to nearest even (finite x)
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
}

// LANES floats rounded to bfloat16, as 16-bit values zero-extended in 32-bit lanes
TS_TARGET inline vi bf16_lanes(vf x) { return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)); }
// LANES bfloat16 values (their bits) zero-extended in 32-bit lanes
TS_TARGET inline vi bf16_lanes(const uint16_t* p) {
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
TS_TARGET inline vi bf16_lanes(const float* p) { return bf16_lanes(load(p)); }
// lane i: a's value in the low half, b's in the high half (a pair for vdpbf16ps)
TS_TARGET inline vi pair(vi a, vi b) { return _mm512_or_si512(a, _mm512_slli_epi32(b, 16)); }

// the tile's weights st (nk keys, mp rows) as bfloat16 pairs of keys (2 jp, 2 jp + 1): pt2 (nk / 2 up, mp)
TS_TARGET void weight_pairs(const float* st, int64_t mp, int64_t rv0, int64_t mv, int64_t nk, uint32_t* pt2) {
  for (int64_t jp = 0; 2 * jp < nk; ++jp) {
    for (int64_t rv = rv0; rv < mv; ++rv) {
      const int64_t r = rv * LANES;
      const vi a = bf16_lanes(st + 2 * jp * mp + r);
      const vi b = 2 * jp + 1 < nk ? bf16_lanes(st + (2 * jp + 1) * mp + r) : zero_i();
      _mm512_storeu_si512(pt2 + jp * mp + r, pair(a, b));
    }
  }
}

// keys [j0, j0 + nk) as bfloat16 pairs over d: (nk, D / 2)
template <typename E>
TS_TARGET void pack_key_pairs(const E* pool, const int64_t* table, int64_t K, int64_t kh, int64_t BS, int64_t D,
                              int64_t j0, int64_t nk, uint32_t* out) {
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t p = j0 + j;
    const E* src = pool + ((table[p / BS] * K + kh) * BS + p % BS) * D;
    if constexpr (std::is_same_v<E, uint16_t>) {
      std::memcpy(out + j * (D / 2), src, D * sizeof(uint16_t));
    } else {
      for (int64_t i = 0; i < D / 2; ++i) out[j * (D / 2) + i] = bf16_bits(src[2 * i]) | bf16_bits(src[2 * i + 1]) << 16;
    }
  }
}

// values [j0, j0 + nk) as bfloat16 pairs over keys: (nk / 2 up, D), (v[2 jp][d], v[2 jp + 1][d])
template <typename E>
TS_TARGET void pack_value_pairs(const E* pool, const int64_t* table, int64_t K, int64_t kh, int64_t BS, int64_t D,
                                int64_t j0, int64_t nk, uint32_t* out) {
  for (int64_t jp = 0; 2 * jp < nk; ++jp) {
    const int64_t p = j0 + 2 * jp;
    const E* a = pool + ((table[p / BS] * K + kh) * BS + p % BS) * D;
    const E* b = 2 * jp + 1 < nk ? pool + ((table[(p + 1) / BS] * K + kh) * BS + (p + 1) % BS) * D : nullptr;
    for (int64_t i = 0; i < D; i += LANES) {
      _mm512_storeu_si512(out + jp * D + i, pair(bf16_lanes(a + i), b != nullptr ? bf16_lanes(b + i) : zero_i()));
    }
  }
}
#endif

// The online softmax over one tile for row vectors [rv0, mv): scores masked past each row's position
// (pos), the running max m and sum l updated, st turned into the tile's weights, alpha = the factor
// that rescales each row's output so far.
TS_TARGET void softmax_tile(float* st, int64_t mp, int64_t rv0, int64_t mv, int64_t j0, int64_t nk, const float* pos,
                            float* m, float* l, float* alpha) {
  const vf neg_inf = set1(NEG_INF);
  for (int64_t rv = rv0; rv < mv; ++rv) {
    const int64_t r = rv * LANES;
    const vf pv = load(pos + r);
    vf tmax = neg_inf;
    for (int64_t j = 0; j < nk; ++j) {
      const vf s = select_ge(pv, set1(static_cast<float>(j0 + j)), load(st + j * mp + r), neg_inf);
      tmax = max(tmax, s);
    }
    const vf m_old = load(m + r);
    const vf m_new = max(m_old, tmax);
    const vf shift = mul(m_new, set1(-1.0f));
    const vf a = ts::exp(add(m_old, shift));  // exactly 1 where the tile has no key of the row
    vf sum = zero();
    for (int64_t j = 0; j < nk; ++j) {
      const vf e = ts::exp(add(load(st + j * mp + r), shift));
      const vf p = select_ge(pv, set1(static_cast<float>(j0 + j)), e, zero());  // masked: exactly 0
      store(st + j * mp + r, p);
      sum = add(sum, p);
    }
    store(l + r, fmadd(load(l + r), a, sum));
    store(m + r, m_new);
    store(alpha + r, a);
  }
}

// keys [j0, j0 + nk) of key/value head kh of a row, widened to float32, (nk, D)
template <typename E>
TS_TARGET void pack(const E* pool, const int64_t* table, int64_t K, int64_t kh, int64_t BS, int64_t D, int64_t j0,
                    int64_t nk, float* out) {
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t p = j0 + j;
    const E* src = pool + ((table[p / BS] * K + kh) * BS + p % BS) * D;
    for (int64_t i = 0; i < D; i += LANES) store(out + j * D + i, widen(src + i));
  }
}

struct Scratch {
  std::vector<float> qt, st, kp, vp, o, pos, m, l, alpha;
  std::vector<uint32_t> qt2, kp2, vp2, pt2;  // bfloat16 pairs (bf16 products)
};

template <int DV, bool BF, typename E>
TS_TARGET void attend_item(const float* q, int64_t qs_h, int64_t qs_t, const E* k_pool, const E* v_pool,
                           const int64_t* table, int64_t K, int64_t kh, int64_t BS, int64_t G, int64_t t0, int64_t nt,
                           int64_t past, float scale, float* out, int64_t H, Scratch& w) {
  constexpr int64_t D = DV * LANES;
  const int64_t M = nt * G, mv = (M + LANES - 1) / LANES, mp = mv * LANES;
  w.st.resize(BK * mp);
  if constexpr (BF) {
    w.qt2.assign(D / 2 * mp, 0u);
    w.kp2.resize(BK * D / 2);
    w.vp2.resize(BK / 2 * D);
    w.pt2.resize(BK / 2 * mp);
  } else {
    w.qt.assign(D * mp, 0.0f);
    w.kp.resize(BK * D);
    w.vp.resize(BK * D);
  }
  w.o.assign(mp * D, 0.0f);
  w.pos.resize(mp);
  w.m.assign(mp, NEG_INF);
  w.l.assign(mp, 0.0f);
  w.alpha.resize(mp);
  for (int64_t r = 0; r < mp; ++r) {
    const int64_t t = std::min(r, M - 1) / G;  // padding rows: the last row's position (never read back)
    w.pos[r] = static_cast<float>(past + t0 + t);
  }
  for (int64_t r = 0; r < M; ++r) {
    const float* src = q + (kh * G + r % G) * qs_h + (t0 + r / G) * qs_t;
    if constexpr (BF) {
#if defined(TS_BF16)
      for (int64_t i = 0; i < D / 2; ++i)
        w.qt2[i * mp + r] = bf16_bits(src[2 * i] * scale) | bf16_bits(src[2 * i + 1] * scale) << 16;
#endif
    } else {
      for (int64_t d = 0; d < D; ++d) w.qt[d * mp + r] = src[d] * scale;
    }
  }
  const int64_t first = past + t0, last = past + t0 + nt - 1;  // the item's query positions
  for (int64_t j0 = 0; j0 <= last; j0 += BK) {
    const int64_t nk = std::min(BK, last + 1 - j0);
    // rows before position j0 have no key in this tile: left as they are (exactly what it would do)
    const int64_t r_first = j0 > first ? (j0 - first) * G : 0;
    const int64_t rv0 = r_first / LANES;
    if constexpr (BF) {
#if defined(TS_BF16)
      pack_key_pairs(k_pool, table, K, kh, BS, D, j0, nk, w.kp2.data());
      pack_value_pairs(v_pool, table, K, kh, BS, D, j0, nk, w.vp2.data());
      scores<BF16>(w.qt2.data(), mp, rv0, mv, w.kp2.data(), nk, D / 2, w.st.data());
      softmax_tile(w.st.data(), mp, rv0, mv, j0, nk, w.pos.data(), w.m.data(), w.l.data(), w.alpha.data());
      weight_pairs(w.st.data(), mp, rv0, mv, nk, w.pt2.data());
      values<BF16, DV>(w.pt2.data(), mp, rv0 * LANES, M, w.alpha.data(), w.vp2.data(), (nk + 1) / 2, w.o.data());
#endif
    } else {
      pack(k_pool, table, K, kh, BS, D, j0, nk, w.kp.data());
      pack(v_pool, table, K, kh, BS, D, j0, nk, w.vp.data());
      scores<F32>(w.qt.data(), mp, rv0, mv, w.kp.data(), nk, D, w.st.data());
      softmax_tile(w.st.data(), mp, rv0, mv, j0, nk, w.pos.data(), w.m.data(), w.l.data(), w.alpha.data());
      values<F32, DV>(w.st.data(), mp, rv0 * LANES, M, w.alpha.data(), w.vp.data(), nk, w.o.data());
    }
  }
  for (int64_t r = 0; r < M; ++r) {
    const vf inv = set1(1.0f / w.l[r]);
    float* dst = out + ((t0 + r / G) * H + kh * G + r % G) * D;  // (T, H, D) of this row b
    for (int64_t i = 0; i < D; i += LANES) store(dst + i, mul(load(w.o.data() + r * D + i), inv));
  }
}

template <int DV, bool BF, typename E>
void attend_all(const at::Tensor& q, const E* kp, const E* vp, const int64_t* tab, const int64_t* keys, int64_t M,
                int64_t kv_heads, int64_t block, float sc, float* op) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), G = H / kv_heads;
  const int64_t tq = std::max<int64_t>(1, 4 * LANES / G);  // query tokens an item: ~4 row vectors
  const int64_t tiles = (T + tq - 1) / tq;
  const float* qp = q.data_ptr<float>();
  const int64_t sb = q.stride(0), sh = q.stride(1), st = q.stride(2);
  // items of one (row, head) alternate early and late query tiles (light and heavy under the causal
  // mask), so that contiguous ranges of items carry similar work
  at::parallel_for(0, B * kv_heads * tiles, 1, [&](int64_t i0, int64_t i1) {
    Scratch w;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (kv_heads * tiles), kh = i / tiles % kv_heads, z = i % tiles;
      const int64_t tile = z % 2 == 0 ? z / 2 : tiles - 1 - z / 2;
      const int64_t t0 = tile * tq, nt = std::min(tq, T - t0);
      attend_item<DV, BF>(qp + b * sb, sh, st, kp, vp, tab + b * M, kv_heads, kh, block, G, t0, nt, keys[b] - T, sc,
                          op + b * T * H * D, H, w);
    }
  });
}

template <bool BF, typename E>
void attend_dispatch(const at::Tensor& q, const E* kp, const E* vp, const int64_t* tab, const int64_t* keys, int64_t M,
                     int64_t kv_heads, int64_t block, float sc, float* op) {
  switch (q.size(3)) {  // DV vectors of LANES floats a head
    case 32: attend_all<32 / LANES, BF>(q, kp, vp, tab, keys, M, kv_heads, block, sc, op); break;
    case 64: attend_all<64 / LANES, BF>(q, kp, vp, tab, keys, M, kv_heads, block, sc, op); break;
    case 128: attend_all<128 / LANES, BF>(q, kp, vp, tab, keys, M, kv_heads, block, sc, op); break;
    default: TORCH_CHECK(false, "unreachable head dim");
  }
}

template <typename E>
void attend_products(bool bf16_products, const at::Tensor& q, const E* kp, const E* vp, const int64_t* tab,
                     const int64_t* keys, int64_t M, int64_t kv_heads, int64_t block, float sc, float* op) {
  if (bf16_products) {
#if defined(TS_BF16)
    attend_dispatch<true>(q, kp, vp, tab, keys, M, kv_heads, block, sc, op);
#endif
  } else {
    attend_dispatch<false>(q, kp, vp, tab, keys, M, kv_heads, block, sc, op);
  }
}

at::Tensor paged_prompt_op(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& tables, const at::Tensor& keys, int64_t kv_heads, int64_t block,
                           double scale, bool bf16_products) {
#if !defined(TS_BF16)
  TORCH_CHECK(!bf16_products, "bfloat16 products need the AVX512-BF16 build of the kernels; this CPU runs another");
#endif
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.stride(3) == 1, "q must be a (B, H, T, D) float32 tensor with a contiguous last dim");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  TORCH_CHECK(D == 32 || D == 64 || D == 128, "prompt attention takes head dims 32, 64 and 128, got ", D);
  const bool bf16 = k_pool.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || k_pool.scalar_type() == at::kFloat) && v_pool.scalar_type() == k_pool.scalar_type() &&
                  k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.dim() == 2 && k_pool.size(1) == D &&
                  k_pool.sizes() == v_pool.sizes(),
              "the pools must be contiguous (N * K * BS + 1, D) tensors, both float32 or both bfloat16");
  TORCH_CHECK(kv_heads > 0 && H % kv_heads == 0 && block > 0, "H must be a multiple of kv_heads");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.size(0) == B,
              "tables must be a contiguous (B, M) int64 tensor");
  TORCH_CHECK(keys.dim() == 1 && keys.scalar_type() == at::kLong && keys.size(0) == B, "keys must be (B,) int64");
  const int64_t M = tables.size(1), blocks = (k_pool.size(0) - 1) / (kv_heads * block);
  const at::Tensor ks = keys.contiguous();
  const int64_t* kn = ks.data_ptr<int64_t>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(kn[b] >= T && kn[b] <= M * block, "row ", b, " has ", kn[b], " keys for ", T, " queries; its table holds ", M * block);
    for (int64_t j = 0; j < (kn[b] + block - 1) / block; ++j) {
      TORCH_CHECK(tab[b * M + j] >= 0 && tab[b * M + j] < blocks, "row ", b, " names block ", tab[b * M + j], " outside the pool");
    }
  }
  at::Tensor out = at::empty({B, T, H, D}, q.options());
  if (T == 0 || B == 0) return out.permute({0, 2, 1, 3});
  const float sc = static_cast<float>(scale);
  if (bf16) {
    attend_products(bf16_products, q, reinterpret_cast<const uint16_t*>(k_pool.data_ptr()),
                    reinterpret_cast<const uint16_t*>(v_pool.data_ptr()), tab, kn, M, kv_heads, block, sc,
                    out.data_ptr<float>());
  } else {
    attend_products(bf16_products, q, k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), tab, kn, M, kv_heads, block,
                    sc, out.data_ptr<float>());
  }
  return out.permute({0, 2, 1, 3});  // (B, H, T, D) view
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ts_panels, m) {
  m.def("paged_prompt(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor keys, int kv_heads, int block, float scale, bool bf16_products=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(ts_panels, CPU, m) {
  m.impl("paged_prompt", &paged_prompt_op);
}
