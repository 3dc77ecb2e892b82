// A transformer block over rows of tokens in one op (models/native_blocks.py calls it for every layer
// of a causal stack's decode step, and of an encoder's forward pass): self-attention (the fused q/k/v projection, rotary positions where the model
// has them, the new key and value written into the paged pool, decode attention over each row's own
// keys, the output projection), cross-attention for an encoder-decoder (the query projection,
// attention over the encoder keys of each row's source, the output projection) and the feed-forward
// (a fused gate/up projection with SiLU(gate) * up, or one up projection with ReLU / GELU / SiLU,
// then down), each sublayer with its residual and norm (RMSNorm or LayerNorm), before it (pre-norm,
// Llama) or after the residual (post-norm, Marian and the original Transformer).
//
// The projections and the attention are the kernels of panels.cpp and attention.cpp (ops.h); what
// this adds is the glue between them, written as plain loops over each row, so a step costs one
// call per layer instead of a compiled graph's entry, guards and wrapper, or an eager block's few
// dozen small ops (at a few rows either took more time than the products: docs/benchmarks.md).
// Every row is computed on its own, in a fixed order, so a row's result does not depend on what it
// is batched with (bitwise), like the kernels.
//
// Each row attends its own keys in a paged pool through its block table: a decode row its cached keys
// (this step's written first), an encoder's token the keys of its sequence, which occupies one block
// as long as the longest sequence (the keys of every row are written before any row attends).
//
// x (B, C) float32: one token per row. norms: the sublayers' norm weights (self, [cross,] ff),
// norm_biases their biases (LayerNorm; None: none). Projections, each as weights, bias, kind (ops.h),
// outputs, activation parts: qkv, o, [cross q, cross o,] up (gate_up when gated), down. cos, sin
// (B, D): each row's rotary angles (None: no rotary). slots (B * K,): the pool row each new key/value
// goes to (row b, head k at b * K + k); tables (B, M) and keys (B,): each row's blocks and key count
// after this step (models/paged_cache.py). cross_k, cross_v (N, K, S, D): the encoder's keys/values,
// one row per source; sources (B, 1): each row's source; source_keys (B,): its real keys.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using namespace ts;

// the feed-forward's activation (models/layers.py's _ACT and _GATED)
enum class Act : int64_t { SILU = 0, RELU = 1, GELU = 2, GELU_TANH = 3 };
constexpr int64_t GRAIN = 4;  // rows per task of the glue loops

// y = w * (x / sqrt(mean(x^2) + eps)), as RMSNorm (models/norms.py) computes it in float32; y may be x
TS_TARGET void rms_norm(const float* x, const float* w, float eps, int64_t C, float* y) {
  vf acc = zero();
  int64_t i = 0;
  for (; i + LANES <= C; i += LANES) acc = fmadd(load(x + i), load(x + i), acc);
  float ss = reduce_add(acc);
  for (; i < C; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(C) + eps);
  for (int64_t j = 0; j < C; ++j) y[j] = w[j] * (x[j] * r);
}

// y = (x - mean) / sqrt(var + eps) * w + b (b may be null), the biased variance, as nn.LayerNorm: the
// moments in float32 lane by lane, then across lanes (torch's differ in the last bits); y may be x
TS_TARGET void layer_norm(const float* x, const float* w, const float* b, float eps, int64_t C, float* y) {
  vf acc = zero();
  int64_t i = 0;
  for (; i + LANES <= C; i += LANES) acc = add(acc, load(x + i));
  float sum = reduce_add(acc);
  for (; i < C; ++i) sum += x[i];
  const float mean = sum / static_cast<float>(C);
  const vf m = set1(mean);
  acc = zero();
  for (i = 0; i + LANES <= C; i += LANES) {
    const vf d = fnmadd(m, set1(1.0f), load(x + i));  // x - mean
    acc = fmadd(d, d, acc);
  }
  float ss = reduce_add(acc);
  for (; i < C; ++i) ss += (x[i] - mean) * (x[i] - mean);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(C) + eps);
  for (int64_t j = 0; j < C; ++j) y[j] = (x[j] - mean) * r * w[j] + (b != nullptr ? b[j] : 0.0f);
}

// y[j] = act(x[j]) (* up[j] when gated: up non-null), lane by lane on simd.h's exp and erf (torch's
// vectorised functions differ in the last bits); y may be x
TS_TARGET void activate(Act act, const float* x, const float* up, int64_t n, float* y) {
  auto one = [act](vf v) {
    switch (act) {
      case Act::SILU: return div(v, add(set1(1.0f), ts::exp(mul(v, set1(-1.0f)))));
      case Act::RELU: return max(v, zero());
      case Act::GELU: return mul(mul(set1(0.5f), v), add(set1(1.0f), ts::erf(mul(v, set1(0.7071067811865476f)))));
      case Act::GELU_TANH: {  // 0.5 v (1 + tanh(u)), tanh(u) = 1 - 2 / (exp(2u) + 1)
        const vf u = mul(set1(0.7978845608028654f), fmadd(mul(set1(0.044715f), v), mul(v, v), v));
        const vf th = fnmadd(set1(2.0f), div(set1(1.0f), add(ts::exp(add(u, u)), set1(1.0f))), set1(1.0f));
        return mul(mul(set1(0.5f), v), add(set1(1.0f), th));
      }
    }
    return v;
  };
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES) {
    const vf a = one(load(x + j));
    store(y + j, up != nullptr ? mul(a, load(up + j)) : a);
  }
  if (j < n) {
    alignas(64) float buf[LANES] = {};
    std::copy(x + j, x + n, buf);
    store(buf, one(load(buf)));
    for (int64_t i = 0; i < n - j; ++i) y[j + i] = up != nullptr ? buf[i] * up[j + i] : buf[i];
  }
}

// rotary positions on one head (apply_rotary in models/positions.py): x cos + rotate_half(x) sin
inline void rotate(const float* x, const float* cos, const float* sin, int64_t D, float* y) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) y[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
  for (int64_t i = half; i < D; ++i) y[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

void check_rows(const at::Tensor& t, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.is_contiguous() && t.size(0) == rows &&
                  t.size(1) == cols,
              name, " must be a contiguous (", rows, ", ", cols, ") float32 tensor");
}

void check_vector(const c10::optional<at::Tensor>& t, int64_t n, const char* name) {
  TORCH_CHECK(!t.has_value() || (t->numel() == n && t->scalar_type() == at::kFloat && t->is_contiguous()), name,
              " must be a contiguous float32 (", n, ",) tensor");
}

struct Layer {
  const std::vector<at::Tensor>& weights;
  const std::vector<c10::optional<at::Tensor>>& biases;
  const std::vector<int64_t>& kinds;
  const std::vector<int64_t>& outs;
  const std::vector<int64_t>& parts;
  const std::vector<at::Tensor>& norms;
  const std::vector<c10::optional<at::Tensor>>& norm_biases;
  float eps;
  bool rms, prenorm;

  at::Tensor project(size_t which, const at::Tensor& x) const {
    return ts::project(static_cast<Kind>(kinds[which]), x, weights[which], biases[which], outs[which], parts[which]);
  }

  // row of C floats -> its norm n, in place
  void normalize(size_t n, float* row, int64_t C) const {
    const float* w = norms[n].data_ptr<float>();
    if (rms) {
      rms_norm(row, w, eps, C, row);
    } else {
      layer_norm(row, w, norm_biases[n].has_value() ? norm_biases[n]->data_ptr<float>() : nullptr, eps, C, row);
    }
  }

  // one sublayer with its residual: pre-norm x + f(norm(x)), post-norm norm(x + f(x))
  template <typename F>
  at::Tensor sublayer(size_t n, const at::Tensor& x, F&& f) const {
    const int64_t B = x.size(0), C = x.size(1);
    const float* xp = x.data_ptr<float>();
    at::Tensor in = x;
    if (prenorm) {
      in = at::empty_like(x);
      float* hp = in.data_ptr<float>();
      at::parallel_for(0, B, GRAIN, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          std::copy(xp + b * C, xp + (b + 1) * C, hp + b * C);
          normalize(n, hp + b * C, C);
        }
      });
    }
    at::Tensor out = f(in);  // (B, C), a new tensor: the residual goes into it
    check_rows(out, B, C, "a sublayer's output");
    float* op = out.data_ptr<float>();
    at::parallel_for(0, B, GRAIN, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        for (int64_t j = 0; j < C; ++j) op[b * C + j] += xp[b * C + j];
        if (!prenorm) normalize(n, op + b * C, C);
      }
    });
    return out;
  }
};

at::Tensor block_step(const at::Tensor& x, std::vector<at::Tensor> norms,
                        std::vector<c10::optional<at::Tensor>> norm_biases, double eps, bool rms, bool prenorm,
                        std::vector<at::Tensor> weights, std::vector<c10::optional<at::Tensor>> biases,
                        std::vector<int64_t> kinds, std::vector<int64_t> outs, std::vector<int64_t> parts,
                        int64_t act, bool gated, const c10::optional<at::Tensor>& cos,
                        const c10::optional<at::Tensor>& sin, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& keys,
                        const c10::optional<at::Tensor>& cross_k, const c10::optional<at::Tensor>& cross_v,
                        const c10::optional<at::Tensor>& sources, const c10::optional<at::Tensor>& source_keys,
                        int64_t heads, int64_t kv_heads, int64_t block, double scale) {
  TORCH_CHECK(x.dim() == 2, "x must be (B, C)");
  const int64_t B = x.size(0), C = x.size(1), D = k_pool.size(1), H = heads, K = kv_heads;
  const bool cross = cross_k.has_value();
  TORCH_CHECK(cross_v.has_value() == cross && sources.has_value() == cross && source_keys.has_value() == cross,
              "cross-attention needs cross_k, cross_v, sources and source_keys together");
  const size_t P = cross ? 6 : 4, ff = cross ? 4 : 2;  // projections; the first feed-forward one
  TORCH_CHECK(weights.size() == P && biases.size() == P && kinds.size() == P && outs.size() == P && parts.size() == P,
              P, " projections: qkv, o, ", cross ? "cross q, cross o, " : "", "up, down");
  TORCH_CHECK(norms.size() == P / 2 && norm_biases.size() == P / 2, P / 2, " norms, one per sublayer");
  TORCH_CHECK(act >= 0 && act <= 3, "unknown activation ", act);
  TORCH_CHECK(outs[0] == (H + 2 * K) * D && outs[1] == C && outs[ff + 1] == C && (!gated || outs[ff] % 2 == 0),
              "the projections' sizes do not match the heads");
  TORCH_CHECK(!cross || (outs[2] == H * D && outs[3] == C), "the cross projections' sizes do not match the heads");
  TORCH_CHECK(H % K == 0, "H must be a multiple of K");
  check_rows(x, B, C, "x");
  TORCH_CHECK(cos.has_value() == sin.has_value(), "rotary needs cos and sin");
  if (cos.has_value()) {
    TORCH_CHECK(D % 2 == 0, "rotary needs an even head dim");
    check_rows(*cos, B, D, "cos");
    check_rows(*sin, B, D, "sin");
  }
  for (size_t n = 0; n < norms.size(); ++n) {
    check_vector(norms[n], C, "a norm's weight");
    check_vector(norm_biases[n], C, "a norm's bias");
  }
  TORCH_CHECK(k_pool.scalar_type() == at::kFloat && v_pool.scalar_type() == at::kFloat && k_pool.is_contiguous() &&
                  v_pool.is_contiguous() && k_pool.dim() == 2 && k_pool.sizes() == v_pool.sizes(),
              "the pools must be contiguous (N * K * BS + 1, D) float32 tensors");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == B * K,
              "slots must be (B * K,) int64");
  const int64_t pool_rows = k_pool.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * K; ++i) TORCH_CHECK(slot[i] >= 0 && slot[i] < pool_rows, "slot ", slot[i], " outside the pool");
  const Layer layer{weights, biases, kinds, outs, parts, norms, norm_biases, static_cast<float>(eps), rms, prenorm};

  // self-attention: q/k/v, rotary, the new key and value into the pool, then every row's keys
  at::Tensor h = layer.sublayer(0, x, [&](const at::Tensor& in) {
    const at::Tensor qkv = layer.project(0, in);  // (B, (H + 2K) D)
    at::Tensor q = at::empty({B, H, D}, x.options());
    const float* qkvp = qkv.data_ptr<float>();
    float* qp = q.data_ptr<float>();
    float* kp = k_pool.data_ptr<float>();
    float* vp = v_pool.data_ptr<float>();
    at::parallel_for(0, B, GRAIN, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const float* row = qkvp + b * (H + 2 * K) * D;
        if (cos.has_value()) {
          const float* c = cos->data_ptr<float>() + b * D;
          const float* s = sin->data_ptr<float>() + b * D;
          for (int64_t hh = 0; hh < H; ++hh) rotate(row + hh * D, c, s, D, qp + (b * H + hh) * D);
          for (int64_t k = 0; k < K; ++k) rotate(row + (H + k) * D, c, s, D, kp + slot[b * K + k] * D);
        } else {
          std::copy(row, row + H * D, qp + b * H * D);
          for (int64_t k = 0; k < K; ++k) std::copy(row + (H + k) * D, row + (H + k + 1) * D, kp + slot[b * K + k] * D);
        }
        for (int64_t k = 0; k < K; ++k) std::copy(row + (H + K + k) * D, row + (H + K + k + 1) * D, vp + slot[b * K + k] * D);
      }
    });
    const at::Tensor attn = paged_decode(q, k_pool, v_pool, tables, keys, K, block, scale).view({B, H * D});
    return layer.project(1, attn);  // (B, C)
  });

  // cross-attention: each row's query against its source's encoder keys
  if (cross) {
    h = layer.sublayer(1, h, [&](const at::Tensor& in) {
      const at::Tensor q = layer.project(2, in).view({B, H, D});
      const at::Tensor attn = sources_attend(q, *cross_k, *cross_v, *sources, *source_keys, scale).view({B, H * D});
      return layer.project(3, attn);  // (B, C)
    });
  }

  // feed-forward: up (or gate/up), the activation, down
  return layer.sublayer(ff / 2, h, [&](const at::Tensor& in) {
    at::Tensor up = layer.project(ff, in);  // (B, F) or (B, 2F)
    const Act fn = static_cast<Act>(act);
    const int64_t F = gated ? outs[ff] / 2 : outs[ff];
    at::Tensor a = gated ? at::empty({B, F}, x.options()) : up;
    const float* up_p = up.data_ptr<float>();
    float* ap = a.data_ptr<float>();
    at::parallel_for(0, B, GRAIN, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        if (gated) {
          activate(fn, up_p + b * 2 * F, up_p + b * 2 * F + F, F, ap + b * F);
        } else {
          activate(fn, ap + b * F, nullptr, F, ap + b * F);
        }
      }
    });
    return layer.project(ff + 1, a);  // (B, C)
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ts_panels, m) {
  m.def("block_step(Tensor x, Tensor[] norms, Tensor?[] norm_biases, float eps, bool rms, bool prenorm, "
        "Tensor[] weights, Tensor?[] biases, int[] kinds, int[] outs, int[] parts, int act, bool gated, "
        "Tensor? cos, Tensor? sin, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots, Tensor tables, Tensor keys, "
        "Tensor? cross_k, Tensor? cross_v, Tensor? sources, Tensor? source_keys, int heads, int kv_heads, int block, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ts_panels, CPU, m) {
  m.impl("block_step", &block_step);
}
