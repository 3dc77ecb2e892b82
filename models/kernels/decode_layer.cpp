// One decode step of a pre-norm Llama-style block in one op (models/native_decode.py calls it for
// every layer of a causal stack): RMSNorm, the fused q/k/v projection, rotary positions, the new
// key and value written into the paged pool, decode attention over each row's own keys, the output
// projection and residual, RMSNorm, the fused gate/up projection, SiLU(gate) * up, the down
// projection and residual.
//
// The projections and the attention are the kernels of panels.cpp and attention.cpp (ops.h); what
// this adds is the glue between them, written as plain loops over each row, so a step costs one
// call per layer instead of a compiled graph's entry, guards and wrapper (at one row those took
// more time than the products: docs/benchmarks.md). Every row is computed on its own, in a fixed
// order, so a row's result does not depend on what it is batched with (bitwise), like the kernels.
//
// x (B, C) float32: one new token per row. cos, sin (B, D): each row's rotary angles. slots (B * K,):
// the pool row each new key/value goes to (row b, head k at b * K + k); tables (B, M) and keys (B,):
// each row's blocks and key count after this step (models/paged_cache.py). Projections: qkv, o,
// gate_up, down, each as weights, bias, kind (ops.h), outputs, activation parts.

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

// y = w * (x / sqrt(mean(x^2) + eps)), as RMSNorm (models/norms.py) computes it in float32
TS_TARGET void rms_norm(const float* x, const float* w, float eps, int64_t C, float* y) {
  vf acc = zero();
  int64_t i = 0;
  for (; i + LANES <= C; i += LANES) acc = fmadd(load(x + i), load(x + i), acc);
  float ss = reduce_add(acc);
  for (; i < C; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(C) + eps);
  for (int64_t j = 0; j < C; ++j) y[j] = w[j] * (x[j] * r);
}

// rotary positions on one head (apply_rotary in models/positions.py): x cos + rotate_half(x) sin
inline void rotate(const float* x, const float* cos, const float* sin, int64_t D, float* y) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) y[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
  for (int64_t i = half; i < D; ++i) y[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

at::Tensor project(const std::vector<at::Tensor>& weights, const std::vector<c10::optional<at::Tensor>>& biases,
                   const std::vector<int64_t>& kinds, const std::vector<int64_t>& outs,
                   const std::vector<int64_t>& parts, int which, const at::Tensor& x) {
  return ts::project(static_cast<Kind>(kinds[which]), x, weights[which], biases[which], outs[which], parts[which]);
}

void check_rows(const at::Tensor& t, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.is_contiguous() && t.size(0) == rows &&
                  t.size(1) == cols,
              name, " must be a contiguous (", rows, ", ", cols, ") float32 tensor");
}

at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& self_norm, const at::Tensor& ff_norm, double eps,
                        std::vector<at::Tensor> weights, std::vector<c10::optional<at::Tensor>> biases,
                        std::vector<int64_t> kinds, std::vector<int64_t> outs, std::vector<int64_t> parts,
                        const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
                        const at::Tensor& v_pool, const at::Tensor& slots, const at::Tensor& tables,
                        const at::Tensor& keys, int64_t heads, int64_t kv_heads, int64_t block, double scale) {
  TORCH_CHECK(x.dim() == 2, "x must be (B, C)");
  const int64_t B = x.size(0), C = x.size(1), D = k_pool.size(1), H = heads, K = kv_heads;
  TORCH_CHECK(weights.size() == 4 && biases.size() == 4 && kinds.size() == 4 && outs.size() == 4 && parts.size() == 4,
              "four projections: qkv, o, gate_up, down");
  TORCH_CHECK(outs[0] == (H + 2 * K) * D && outs[1] == C && outs[2] % 2 == 0 && outs[3] == C,
              "the projections' sizes do not match the heads");
  TORCH_CHECK(D % 2 == 0 && H % K == 0, "an even head dim and H a multiple of K");
  check_rows(x, B, C, "x");
  check_rows(cos, B, D, "cos");
  check_rows(sin, B, D, "sin");
  TORCH_CHECK(self_norm.numel() == C && ff_norm.numel() == C && self_norm.scalar_type() == at::kFloat &&
                  ff_norm.scalar_type() == at::kFloat && self_norm.is_contiguous() && ff_norm.is_contiguous(),
              "the norms' weights must be contiguous float32 (C,)");
  TORCH_CHECK(k_pool.scalar_type() == at::kFloat && v_pool.scalar_type() == at::kFloat && k_pool.is_contiguous() &&
                  v_pool.is_contiguous() && k_pool.dim() == 2 && k_pool.sizes() == v_pool.sizes(),
              "the pools must be contiguous (N * K * BS + 1, D) float32 tensors");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == B * K,
              "slots must be (B * K,) int64");
  const int64_t pool_rows = k_pool.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * K; ++i) TORCH_CHECK(slot[i] >= 0 && slot[i] < pool_rows, "slot ", slot[i], " outside the pool");
  const float fe = static_cast<float>(eps);
  const int64_t F = outs[2] / 2;
  constexpr int64_t GRAIN = 4;  // rows per task of the glue loops

  // attention: norm, q/k/v, rotary, the new key and value into the pool, then every row's keys
  at::Tensor h = at::empty({B, C}, x.options());
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, B, GRAIN, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) rms_norm(xp + b * C, self_norm.data_ptr<float>(), fe, C, h.data_ptr<float>() + b * C);
  });
  const at::Tensor qkv = project(weights, biases, kinds, outs, parts, 0, h);  // (B, (H + 2K) D)
  at::Tensor q = at::empty({B, H, D}, x.options());
  const float* qkvp = qkv.data_ptr<float>();
  float* kp = k_pool.data_ptr<float>();
  float* vp = v_pool.data_ptr<float>();
  at::parallel_for(0, B, GRAIN, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = qkvp + b * (H + 2 * K) * D;
      const float* c = cos.data_ptr<float>() + b * D;
      const float* s = sin.data_ptr<float>() + b * D;
      for (int64_t hh = 0; hh < H; ++hh) rotate(row + hh * D, c, s, D, q.data_ptr<float>() + (b * H + hh) * D);
      for (int64_t k = 0; k < K; ++k) {
        const int64_t at = slot[b * K + k];
        rotate(row + (H + k) * D, c, s, D, kp + at * D);
        std::copy(row + (H + K + k) * D, row + (H + K + k + 1) * D, vp + at * D);
      }
    }
  });
  const at::Tensor attn = paged_decode(q, k_pool, v_pool, tables, keys, K, block, scale).view({B, H * D});
  const at::Tensor o = project(weights, biases, kinds, outs, parts, 1, attn);  // (B, C)

  // feed-forward: residual, norm, gate/up, SiLU(gate) * up, down, residual
  at::Tensor mid = at::empty({B, C}, x.options());
  const float* op = o.data_ptr<float>();
  float* midp = mid.data_ptr<float>();
  at::parallel_for(0, B, GRAIN, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t j = 0; j < C; ++j) midp[b * C + j] = xp[b * C + j] + op[b * C + j];
      rms_norm(midp + b * C, ff_norm.data_ptr<float>(), fe, C, h.data_ptr<float>() + b * C);
    }
  });
  const at::Tensor gate_up = project(weights, biases, kinds, outs, parts, 2, h);  // (B, 2F)
  at::Tensor act = at::empty({B, F}, x.options());
  const float* gup = gate_up.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  at::parallel_for(0, B, GRAIN, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t j = 0; j < F; ++j) {
        const float g = gup[b * 2 * F + j];
        ap[b * F + j] = g / (1.0f + std::exp(-g)) * gup[b * 2 * F + F + j];
      }
    }
  });
  at::Tensor out = project(weights, biases, kinds, outs, parts, 3, act);  // (B, C)
  float* outp = out.data_ptr<float>();
  for (int64_t i = 0; i < B * C; ++i) outp[i] += midp[i];
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ts_panels, m) {
  m.def("decode_layer(Tensor x, Tensor self_norm, Tensor ff_norm, float eps, Tensor[] weights, Tensor?[] biases, "
        "int[] kinds, int[] outs, int[] parts, Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, "
        "Tensor slots, Tensor tables, Tensor keys, int heads, int kv_heads, int block, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ts_panels, CPU, m) {
  m.impl("decode_layer", &decode_layer);
}
