// A stack of transformer blocks over rows of tokens in one op, stack_step (models/execution/native.py
// calls it for a causal stack's decode step, and for an encoder's forward pass). Each block:
// self-attention (the fused q/k/v projection, rotary positions where the model has them, the new key
// and value written into the paged pool, decode attention over each row's own keys, the output
// projection), cross-attention for an encoder-decoder (the query projection, attention over the
// encoder keys of each row's source, the output projection) and the feed-forward (a fused gate/up
// projection with SiLU(gate) * up, or one up projection with ReLU / GELU / SiLU, then down), each
// sublayer with its residual and norm (RMSNorm or LayerNorm), before it (pre-norm, Llama) or after the
// residual (post-norm, Marian and the original Transformer). Around the blocks, for a decode step: each
// row's token embedding (times the model's scale, plus its absolute position's row) before them and the
// stack's final norm after them, so that a step is one call.
//
// The projections and the attention are the kernels of panels.cpp and attention.cpp (ops.h); what
// this adds is the glue between them, written as plain loops over each row, so a step is one call:
// at a few rows a compiled graph's entry, guards and wrapper per block, an eager block's few dozen
// small ops, or torch ops around each block's call cost as much as the products or more
// (docs/benchmarks-history.md, "One op per layer for decode steps", "One call per decode step").
// Every row is computed on its own, in a fixed order, so a row's result does not depend on what it
// is batched with (bitwise), like the kernels.
//
// Each row attends its own keys in a paged pool through its block table: a decode row its cached keys
// (this step's written first), an encoder's token the keys of its sequence, which occupies one block
// as long as the longest sequence (the keys of every row are written before any row attends).
//
// x (B, C) float32: one token per row (or ids (B,) with the embedding table (V, C), its scale, and the
// position table (P, C) with positions (B,) where the model has one). norms: the sublayers' norm
// weights (self, [cross,] ff) of every layer in turn, norm_biases their biases (LayerNorm; None:
// none). Projections, each as weights, bias, kind (ops.h), outputs, activation parts, every layer's in
// turn: qkv, o, [cross q, cross o,] up (gate_up when gated), down. cos, sin (B, D): each row's rotary
// angles (None: no rotary). k_pools, v_pools: each layer's pool, float32 or bfloat16 (new keys and values
// rounded to nearest even, as torch's conversion). slots (B * K,): the pool row each new
// key/value goes to (row b, head k at b * K + k); tables (B, M) and keys (B,): each row's blocks and
// key count after this step (models/cache/paged.py), the same in every layer; or, for a decode step,
// past (B,): each row's keys before it, from which the op derives slots, key counts and positions. cross_k, cross_v: each
// layer's encoder keys/values (N, K, S, D), one row per source (empty: no cross-attention); sources
// (B, 1): each row's source; source_keys (B,): its real keys. final_norm, final_norm_bias: the norm
// after the last block (None: none).

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using namespace ts;

// the feed-forward's activation (models/layers.py's _ACT and _GATED)
enum class Act : int64_t { SILU = 0, RELU = 1, GELU = 2, GELU_TANH = 3 };
// rows per task of the glue loops (copies, norms, residuals, activations) over rows of `width` floats:
// enough that a task outweighs waking the other threads (a parallel region costs far more than
// normalising a row), so a decode step's few rows stay on one thread
inline int64_t grain(int64_t width) { return std::max<int64_t>(4, 16384 / std::max<int64_t>(width, 1)); }

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

// One block's parameters: its sublayers' norms and its projections (qkv, o, [cross q, cross o,] up,
// down), pointers into the op's lists (a stack's lists hold every layer's, one layer after another)
struct Layer {
  const at::Tensor* weights;
  const Lora* lora;
  const c10::optional<at::Tensor>* biases;
  const int64_t* kinds;
  const int64_t* outs;
  const int64_t* parts;
  const at::Tensor* norms;
  const c10::optional<at::Tensor>* norm_biases;
  float eps;
  bool rms, prenorm;

  // projection `which` of x (B, I) -> (B, O), with each row's adapter (`adapters`: B slots, or null)
  at::Tensor project(size_t which, const at::Tensor& x, const int64_t* adapters) const {
    const Kind kind = static_cast<Kind>(kinds[which]);
    if (adapters == nullptr || !lora[which].a.defined()) {
      return ts::project(kind, x, weights[which], biases[which], outs[which], parts[which]);
    }
    if (lora_fuses(x, lora[which], adapters)) {
      const LoraAfter after(x, lora[which], adapters);
      return ts::project(kind, x, weights[which], biases[which], outs[which], parts[which], &after);
    }
    at::Tensor y = ts::project(kind, x, weights[which], biases[which], outs[which], parts[which]);
    lora_add(x, y, lora[which], adapters);
    return y;
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
      at::parallel_for(0, B, grain(C), [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          std::copy(xp + b * C, xp + (b + 1) * C, hp + b * C);
          normalize(n, hp + b * C, C);
        }
      });
    }
    at::Tensor out = f(in);  // (B, C), a new tensor: the residual goes into it
    check_rows(out, B, C, "a sublayer's output");
    float* op = out.data_ptr<float>();
    at::parallel_for(0, B, grain(C), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        for (int64_t j = 0; j < C; ++j) op[b * C + j] += xp[b * C + j];
        if (!prenorm) normalize(n, op + b * C, C);
      }
    });
    return out;
  }
};

// What every layer of a step shares: the blocks' shape and the step's rows (rotary angles, where the
// new keys go, each row's blocks and key count, each row's source)
struct Step {
  int64_t act;
  bool gated;
  const c10::optional<at::Tensor>& cos;
  const c10::optional<at::Tensor>& sin;
  const at::Tensor& slots;
  const at::Tensor& tables;
  const at::Tensor& keys;
  const c10::optional<at::Tensor>& sources;
  const c10::optional<at::Tensor>& source_keys;
  int64_t heads, kv_heads, block;
  double scale;
  const int64_t* adapters;  // each row's adapter slot, or null: none
};

// the checks of one layer's lists (P projections, P / 2 norms) against the step's shape
void check_layer(const Layer& layer, size_t P, int64_t C, int64_t D, const Step& st) {
  const int64_t H = st.heads, K = st.kv_heads;
  const size_t ff = P == 6 ? 4 : 2;  // the first feed-forward projection
  const int64_t* outs = layer.outs;
  TORCH_CHECK(outs[0] == (H + 2 * K) * D && outs[1] == C && outs[ff + 1] == C && (!st.gated || outs[ff] % 2 == 0),
              "the projections' sizes do not match the heads");
  TORCH_CHECK(P == 4 || (outs[2] == H * D && outs[3] == C), "the cross projections' sizes do not match the heads");
  for (size_t n = 0; n < P / 2; ++n) {
    check_vector(layer.norms[n], C, "a norm's weight");
    check_vector(layer.norm_biases[n], C, "a norm's bias");
  }
}

// the checks of what every layer shares: rows, rotary, slots (the pools' rows: pool_rows)
void check_step(const Step& st, int64_t B, int64_t D, int64_t pool_rows, bool cross) {
  TORCH_CHECK(st.sources.has_value() == cross && st.source_keys.has_value() == cross,
              "cross-attention needs cross keys and values, sources and source_keys together");
  TORCH_CHECK(st.act >= 0 && st.act <= 3, "unknown activation ", st.act);
  TORCH_CHECK(st.kv_heads > 0 && st.heads % st.kv_heads == 0, "H must be a multiple of K");
  TORCH_CHECK(st.cos.has_value() == st.sin.has_value(), "rotary needs cos and sin");
  if (st.cos.has_value()) {
    TORCH_CHECK(D % 2 == 0, "rotary needs an even head dim");
    check_rows(*st.cos, B, D, "cos");
    check_rows(*st.sin, B, D, "sin");
  }
  const int64_t K = st.kv_heads;
  TORCH_CHECK(st.slots.dim() == 1 && st.slots.scalar_type() == at::kLong && st.slots.is_contiguous() &&
                  st.slots.numel() == B * K,
              "slots must be (B * K,) int64");
  const int64_t* slot = st.slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * K; ++i) TORCH_CHECK(slot[i] >= 0 && slot[i] < pool_rows, "slot ", slot[i], " outside the pool");
}

void check_pools(const at::Tensor& k_pool, const at::Tensor& v_pool, int64_t D) {
  TORCH_CHECK((k_pool.scalar_type() == at::kFloat || k_pool.scalar_type() == at::kBFloat16) &&
                  v_pool.scalar_type() == k_pool.scalar_type() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  k_pool.dim() == 2 && k_pool.sizes() == v_pool.sizes() && k_pool.size(1) == D,
              "the pools must be contiguous (N * K * BS + 1, D) tensors, both float32 or both bfloat16");
}

// one new key or value row into a pool of E: float32 as it is, bfloat16 rounded to nearest even (as
// torch's .to(torch.bfloat16), so a prompt's keys written by torch and a step's by this are alike)
inline void put_row(const float* x, int64_t D, float* dst) { std::copy(x, x + D, dst); }
inline void put_row(const float* x, int64_t D, c10::BFloat16* dst) {
  for (int64_t i = 0; i < D; ++i) dst[i] = c10::BFloat16(x[i]);
}

// the step's new keys (rotated) and values of rows [b0, b1) into the pools; qkv rows (B, (H + 2K) D), q (B, H, D)
template <typename E>
void put_keys(const float* qkvp, float* qp, E* kp, E* vp, const int64_t* slot, int64_t b0, int64_t b1, int64_t H,
              int64_t K, int64_t D, const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin) {
  std::vector<float> key(D);
  for (int64_t b = b0; b < b1; ++b) {
    const float* row = qkvp + b * (H + 2 * K) * D;
    if (cos.has_value()) {
      const float* c = cos->data_ptr<float>() + b * D;
      const float* s = sin->data_ptr<float>() + b * D;
      for (int64_t hh = 0; hh < H; ++hh) rotate(row + hh * D, c, s, D, qp + (b * H + hh) * D);
      for (int64_t k = 0; k < K; ++k) {
        rotate(row + (H + k) * D, c, s, D, key.data());
        put_row(key.data(), D, kp + slot[b * K + k] * D);
      }
    } else {
      std::copy(row, row + H * D, qp + b * H * D);
      for (int64_t k = 0; k < K; ++k) put_row(row + (H + k) * D, D, kp + slot[b * K + k] * D);
    }
    for (int64_t k = 0; k < K; ++k) put_row(row + (H + K + k) * D, D, vp + slot[b * K + k] * D);
  }
}

// x (B, C) through one block (checked): self-attention, [cross-attention,] feed-forward
at::Tensor run_layer(const Layer& layer, const at::Tensor& x, size_t P, const Step& st, const at::Tensor& k_pool,
                     const at::Tensor& v_pool, const at::Tensor* cross_k, const at::Tensor* cross_v) {
  const int64_t B = x.size(0), D = k_pool.size(1), H = st.heads, K = st.kv_heads;
  const bool cross = P == 6;
  const size_t ff = cross ? 4 : 2;
  const int64_t* slot = st.slots.data_ptr<int64_t>();
  const c10::optional<at::Tensor>& cos = st.cos;
  const c10::optional<at::Tensor>& sin = st.sin;

  // self-attention: q/k/v, rotary, the new key and value into the pool, then every row's keys
  at::Tensor h = layer.sublayer(0, x, [&](const at::Tensor& in) {
    const at::Tensor qkv = layer.project(0, in, st.adapters);  // (B, (H + 2K) D)
    at::Tensor q = at::empty({B, H, D}, x.options());  // (B, H, D)
    const float* qkvp = qkv.data_ptr<float>();
    float* qp = q.data_ptr<float>();
    const bool bf16 = k_pool.scalar_type() == at::kBFloat16;
    at::parallel_for(0, B, grain((H + 2 * K) * D), [&](int64_t b0, int64_t b1) {
      if (bf16) {
        put_keys(qkvp, qp, k_pool.data_ptr<c10::BFloat16>(), v_pool.data_ptr<c10::BFloat16>(), slot, b0, b1, H, K, D,
                 cos, sin);
      } else {
        put_keys(qkvp, qp, k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), slot, b0, b1, H, K, D, cos, sin);
      }
    });
    const at::Tensor attn = paged_decode(q, k_pool, v_pool, st.tables, st.keys, K, st.block, st.scale).view({B, H * D});  // (B, H D)
    return layer.project(1, attn, st.adapters);  // (B, C)
  });

  // cross-attention: each row's query against its source's encoder keys
  if (cross) {
    h = layer.sublayer(1, h, [&](const at::Tensor& in) {
      const at::Tensor q = layer.project(2, in, st.adapters).view({B, H, D});  // (B, H, D)
      const at::Tensor attn =
          sources_attend(q, *cross_k, *cross_v, *st.sources, *st.source_keys, st.scale).view({B, H * D});  // (B, H D)
      return layer.project(3, attn, st.adapters);  // (B, C)
    });
  }

  // feed-forward: up (or gate/up), the activation, down
  return layer.sublayer(ff / 2, h, [&](const at::Tensor& in) {
    at::Tensor up = layer.project(ff, in, st.adapters);  // (B, F) or (B, 2F)
    const Act fn = static_cast<Act>(st.act);
    const int64_t F = st.gated ? layer.outs[ff] / 2 : layer.outs[ff];
    at::Tensor a = st.gated ? at::empty({B, F}, x.options()) : up;  // (B, F)
    const float* up_p = up.data_ptr<float>();
    float* ap = a.data_ptr<float>();
    at::parallel_for(0, B, grain(F), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        if (st.gated) {
          activate(fn, up_p + b * 2 * F, up_p + b * 2 * F + F, F, ap + b * F);
        } else {
          activate(fn, ap + b * F, nullptr, F, ap + b * F);
        }
      }
    });
    return layer.project(ff + 1, a, st.adapters);  // (B, C)
  });
}

// block i of a stack's parameters
Layer layer_of(const Blocks& bs, size_t i) {
  const size_t P = bs.P;
  return Layer{bs.weights.data() + i * P, bs.lora.data() + i * P, bs.biases.data() + i * P, bs.kinds.data() + i * P, bs.outs.data() + i * P,
               bs.parts.data() + i * P, bs.norms.data() + i * P / 2, bs.norm_biases.data() + i * P / 2,
               static_cast<float>(bs.eps), bs.rms, bs.prenorm};
}

}  // namespace

ts::Blocks::Blocks(std::vector<at::Tensor> norms_, std::vector<c10::optional<at::Tensor>> norm_biases_, double eps_,
                   bool rms_, bool prenorm_, std::vector<at::Tensor> weights_,
                   std::vector<c10::optional<at::Tensor>> biases_, std::vector<int64_t> kinds_,
                   std::vector<int64_t> outs_, std::vector<int64_t> parts_, int64_t act_, bool gated_, int64_t heads_,
                   int64_t kv_heads_, double scale_, int64_t layers_, bool cross)
    : norms(std::move(norms_)), norm_biases(std::move(norm_biases_)), weights(std::move(weights_)),
      biases(std::move(biases_)), kinds(std::move(kinds_)), outs(std::move(outs_)), parts(std::move(parts_)),
      eps(eps_), rms(rms_), prenorm(prenorm_), act(act_), gated(gated_), heads(heads_), kv_heads(kv_heads_),
      scale(scale_), layers(static_cast<size_t>(layers_)), P(cross ? 6 : 4), lora(layers * P) {
  TORCH_CHECK(layers_ >= 1, "a stack has at least one layer");
  TORCH_CHECK(weights.size() == layers * P && biases.size() == layers * P && kinds.size() == layers * P &&
                  outs.size() == layers * P && parts.size() == layers * P,
              P, " projections per layer: qkv, o, ", cross ? "cross q, cross o, " : "", "up, down");
  TORCH_CHECK(norms.size() == layers * P / 2 && norm_biases.size() == layers * P / 2, P / 2, " norms per layer");
  TORCH_CHECK(act >= 0 && act <= 3, "unknown activation ", act);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "H must be a multiple of K");
}

void ts::Blocks::set_lora(int64_t index, at::Tensor a, at::Tensor bt, at::Tensor ranks, std::vector<int64_t> bounds,
                          int64_t rank, at::Tensor scales) {
  TORCH_CHECK(index >= 0 && static_cast<size_t>(index) < lora.size(), "projection ", index, " outside the stack");
  lora[index] = make_lora(std::move(a), std::move(bt), std::move(ranks), std::move(bounds), rank, std::move(scales),
                          outs[index]);
}

// A causal stack's whole decode step in one call: each row's token embedding (scaled, plus its
// absolute position's row when the model has a table; rows of the input x instead when given), every
// layer's block (one pool and, with cross-attention, one encoder key/value pair per layer), then the
// final norm (if any). The same arithmetic, in the same order, as Embeddings.forward, the blocks one
// after another and the norm; then, when given, the model's output projection (its logits returned).
at::Tensor ts::stack_step(const Blocks& bs, const StepArgs& a) {
  const auto& [x, ids, embed, pos_table, positions, cos, sin, embed_scale, k_pools, v_pools, slots, keys, tables, past,
               block, cross_k, cross_v, sources, source_keys, final_norm, final_norm_bias, final_eps, final_rms, head,
               head_bias, head_kind, head_n, head_parts, adapters] = a;

  const size_t L = bs.layers, P = bs.P;
  const bool cross = P == 6;
  TORCH_CHECK(k_pools.size() == L && v_pools.size() == L, "one key pool and one value pool per layer");
  TORCH_CHECK(cross ? (cross_k.size() == L && cross_v.size() == L) : (cross_k.empty() && cross_v.empty()),
              cross ? "one cross key/value pair per layer" : "these blocks have no cross-attention");
  const int64_t D = k_pools[0].size(1);
  // a decode step's rows by their past lengths (`past`): each new key's slot through the row's table,
  // its key count and its position, as PagedCacheView.begin(1) computes them on the host
  at::Tensor slot_t, key_t;
  if (!past.empty()) {
    TORCH_CHECK(!slots.has_value() && !keys.has_value(), "give past lengths or slots and keys, not both");
    TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous(),
                "tables must be a contiguous (B, M) int64 tensor");
    const int64_t R = static_cast<int64_t>(past.size()), K = bs.kv_heads, M = tables.size(1);
    TORCH_CHECK(tables.size(0) == R && block > 0, "one table per row");
    slot_t = at::empty({R * K}, tables.options());
    key_t = at::empty({R}, tables.options());
    const int64_t* tab = tables.data_ptr<int64_t>();
    int64_t* sp = slot_t.data_ptr<int64_t>();
    int64_t* kp = key_t.data_ptr<int64_t>();
    for (int64_t b = 0; b < R; ++b) {
      const int64_t n = past[b];
      TORCH_CHECK(n >= 0 && n / block < M, "row ", b, " holds ", n, " keys; its table has ", M, " blocks");
      for (int64_t k = 0; k < K; ++k) sp[b * K + k] = (tab[b * M + n / block] * K + k) * block + n % block;
      kp[b] = n + 1;
    }
  } else {
    TORCH_CHECK(slots.has_value() && keys.has_value(), "give past lengths or slots and keys");
    slot_t = *slots;
    key_t = *keys;
  }

  // the input rows: given, or each row's token embedding
  at::Tensor h;
  if (x.has_value()) {
    TORCH_CHECK(!ids.has_value(), "give x or ids, not both");
    h = *x;
    TORCH_CHECK(h.dim() == 2, "x must be (B, C)");
    check_rows(h, h.size(0), h.size(1), "x");
  } else {
    TORCH_CHECK(ids.has_value() && embed.has_value(), "ids need the embedding table");
    const at::Tensor& table = *embed;
    TORCH_CHECK(ids->dim() == 1 && ids->scalar_type() == at::kLong && ids->is_contiguous(), "ids must be (B,) int64");
    TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kFloat && table.is_contiguous(),
                "the embedding table must be a contiguous (V, C) float32 tensor");
    const int64_t B = ids->size(0), C = table.size(1), V = table.size(0);
    TORCH_CHECK(!pos_table.has_value() || positions.has_value() || !past.empty(), "a position table needs positions");
    TORCH_CHECK(!positions.has_value() || pos_table.has_value(), "positions need a position table");
    const int64_t* id = ids->data_ptr<int64_t>();
    // a row's position: given, or its past length
    const int64_t* pos = positions.has_value() ? positions->data_ptr<int64_t>() : past.empty() ? nullptr : past.data();
    if (pos_table.has_value()) {
      TORCH_CHECK(positions.has_value() ? (positions->dim() == 1 && positions->numel() == B &&
                                           positions->scalar_type() == at::kLong && positions->is_contiguous())
                                        : static_cast<int64_t>(past.size()) == B,
                  "positions must be (B,) int64");
      check_rows(*pos_table, pos_table->size(0), C, "the position table");
      for (int64_t b = 0; b < B; ++b) {
        TORCH_CHECK(pos[b] >= 0 && pos[b] < pos_table->size(0), "position ", pos[b], " outside the table");
      }
    }
    for (int64_t b = 0; b < B; ++b) TORCH_CHECK(id[b] >= 0 && id[b] < V, "token ", id[b], " outside the vocabulary");
    h = at::empty({B, C}, table.options());  // (B, C)
    const float* w = table.data_ptr<float>();
    const float* pt = pos_table.has_value() ? pos_table->data_ptr<float>() : nullptr;
    float* hp = h.data_ptr<float>();
    const float sc = static_cast<float>(embed_scale);
    for (int64_t b = 0; b < B; ++b) {
      const float* row = w + id[b] * C;
      float* out = hp + b * C;
      // as Embeddings.forward: the row, times the scale (unless 1), plus the position's row: one rounding each
      for (int64_t j = 0; j < C; ++j) out[j] = sc != 1.0f ? row[j] * sc : row[j];
      if (pt != nullptr) {
        const float* p = pt + pos[b] * C;
        for (int64_t j = 0; j < C; ++j) out[j] += p[j];
      }
    }
  }
  const int64_t B = h.size(0), C = h.size(1);
  const int64_t* row_adapters = nullptr;
  if (adapters.has_value()) {
    const at::Tensor& ad = *adapters;
    TORCH_CHECK(ad.dim() == 1 && ad.scalar_type() == at::kLong && ad.is_contiguous() && ad.size(0) == B,
                "adapters must be a contiguous (B,) int64 tensor");
    row_adapters = ad.data_ptr<int64_t>();
  }
  const Step st{bs.act, bs.gated, cos, sin, slot_t, tables, key_t, sources, source_keys, bs.heads, bs.kv_heads, block,
                bs.scale, row_adapters};
  for (size_t i = 0; i < L; ++i) {
    check_pools(k_pools[i], v_pools[i], D);
    TORCH_CHECK(k_pools[i].size(0) == k_pools[0].size(0), "every layer's pool has the same rows");
  }
  check_step(st, B, D, k_pools[0].size(0), cross);
  for (size_t i = 0; i < L; ++i) check_layer(layer_of(bs, i), P, C, D, st);
  for (size_t i = 0; i < L; ++i) {
    h = run_layer(layer_of(bs, i), h, P, st, k_pools[i], v_pools[i], cross ? &cross_k[i] : nullptr,
                  cross ? &cross_v[i] : nullptr);  // (B, C)
  }
  if (final_norm.has_value()) {
    check_vector(final_norm, C, "the final norm's weight");
    check_vector(final_norm_bias, C, "the final norm's bias");
    const at::Tensor fn[1] = {*final_norm};
    const c10::optional<at::Tensor> fb[1] = {final_norm_bias};
    const Layer norm{nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, fn, fb, static_cast<float>(final_eps), final_rms, true};
    at::Tensor out = at::empty_like(h);  // (B, C)
    const float* hp = h.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, B, grain(C), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        std::copy(hp + b * C, hp + (b + 1) * C, op + b * C);
        norm.normalize(0, op + b * C, C);
      }
    });
    h = out;
  }
  if (head.has_value()) {  // the model's output projection: logits (B, V)
    return project(static_cast<Kind>(head_kind), h, *head, head_bias, head_n, head_parts);
  }
  return h;
}
