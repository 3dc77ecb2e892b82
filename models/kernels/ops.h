// The kernels one source calls from another (block_step.cpp runs the projections and the decode
// attention of panels.cpp and attention.cpp inside one op), with the checks of their torch ops, and the
// stack step that module.cpp binds for Python.

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace ts {

// How a projection's weights are stored (models/projections/panels.py): float32 panels, GGUF-style blocks,
// or bfloat16 panels (builds with AVX512-BF16; x is rounded to bfloat16 first)
enum class Kind : int64_t { F32 = 0, Q4_1 = 1, Q8_0 = 2, BF16 = 3 };

// Work on a projection's outputs once they are computed, inside the projection's own parallel region:
// called on each thread with y (M, n) and the range of outputs [o0, o1) that thread computed
struct After {
  virtual void operator()(float* y, int64_t o0, int64_t o1) const = 0;
  virtual ~After() = default;
};

// y (M, n) = x (M, K) W^T + bias, W in `kind`'s layout; parts: the activations' 8-bit parts (blocks);
// `after` (or null) on each thread's outputs
at::Tensor project(Kind kind, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                   int64_t n, int64_t parts, const After* after = nullptr);

// q (B, H, D) float32 against each row's keys in a paged pool (float32 or bfloat16) -> (B, H, D) (attention.cpp)
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& tables, const at::Tensor& lengths, int64_t kv_heads, int64_t block,
                        double scale);

// q (B, H, D) against the encoder's keys of each row's source: k, v (N, K, S, D) contiguous, sources
// (B, 1) int64 the source of each row, lengths (B,) int64 its real keys (a prefix of S) -> (B, H, D)
at::Tensor sources_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& sources,
                          const at::Tensor& lengths, double scale);

// A beam search step's k best candidates of each group of beams (select.cpp): logp (G * rows, V) and
// scores (G, rows) float32 -> values (G, k) float32 and flat indices (G, k) int64, best first
std::tuple<at::Tensor, at::Tensor> beam_top(const at::Tensor& logp, const at::Tensor& scores, int64_t k);

// One request's candidates: values, source beams, tokens (best first; a greedy request's one argmax)
using Candidates = std::tuple<std::vector<double>, std::vector<int64_t>, std::vector<int64_t>>;

// A search step's candidates from the decoder's logits (R, V) float32 (select.cpp): log-softmax (torch's),
// `banned` tokens at -inf, each `forced` request's rows only the end token `eos`, then per request (its
// `rows` in order, beam size `beams`, running `scores`) its argmax (beam 1) or its 2n best candidates
std::vector<Candidates> search_select(const at::Tensor& logits, const std::vector<int64_t>& banned, int64_t eos,
                                      const std::vector<int64_t>& rows, const std::vector<int64_t>& beams,
                                      const std::vector<bool>& forced, const std::vector<std::vector<double>>& scores);

// Block dst[i] of a paged pool (2, L, rows, D) becomes a copy of block src[i] (block_rows rows each) in
// every layer's keys and values (pool.cpp); no destination may be a source
void copy_blocks(const at::Tensor& pool, const std::vector<int64_t>& src, const std::vector<int64_t>& dst,
                 int64_t block_rows);

// One projection's adapter slots (models/adapters/lora.py's LoraLinear): a (N, P r, I) and bt (N, P r, O)
// float32, bfloat16 or int8, ranks (N, P) int64 the ranks each part of a slot uses, bounds (P + 1,) the parts'
// outputs, r (`rank`) ranks a part; int8 factors have `scales` (N, P r) float32, a rank's first product's
// scale times its second's (empty otherwise). Undefined `a`: the projection carries no adapters. Built by
// make_lora (the checks), which also keeps the raw views the kernels read: the tensors are written in place
// when a slot is loaded, never reallocated.
struct Lora {
  at::Tensor a, bt, ranks, scales;
  std::vector<int64_t> bounds;
  int64_t rank = 0;
  at::ScalarType dtype = at::kFloat;
  const void* ap = nullptr;
  const void* btp = nullptr;
  const int64_t* rp = nullptr;  // ranks
  const float* sp = nullptr;    // scales, or null for float factors
  int64_t N = 0, PR = 0, I = 0, O = 0, P = 0;
};
// a Lora over these tensors, checked (shapes, dtypes, layout); `outputs` the projection's
Lora make_lora(at::Tensor a, at::Tensor bt, at::Tensor ranks, std::vector<int64_t> bounds, int64_t rank,
               at::Tensor scales, int64_t outputs);

// y (R, O) += each row's adapter update from x (R, I), slots[b] the row's slot (-1: none) (lora.cpp)
void lora_add(const at::Tensor& x, at::Tensor& y, const Lora& lora, const int64_t* slots);

// The same updates as an After of the projection (lora.cpp): each thread computes the first products of
// the parts its outputs fall in (all of them where two threads share a part) and adds its outputs'
// updates, the same bits as lora_add, with no parallel region of their own. For a few rows
// (lora_fuses), where that region and its barrier cost more than the repeated first products.
struct LoraAfter : After {
  const at::Tensor& x;
  const Lora& lora;
  const int64_t* slots;
  LoraAfter(const at::Tensor& x_, const Lora& lora_, const int64_t* slots_) : x(x_), lora(lora_), slots(slots_) {}
  void operator()(float* y, int64_t o0, int64_t o1) const override;
};
// whether a projection of x (R, I) takes its rows' updates as a LoraAfter: one or two rows have an adapter
// (the checks of lora_add first)
bool lora_fuses(const at::Tensor& x, const Lora& lora, const int64_t* slots);

// A stack's parameters, held once (models/execution/native.py builds one per stack, through module.cpp):
// each block's norms and projections in turn (qkv, o, [cross q, cross o,] up or gate/up, down; the
// sublayers' norms self, [cross,] ff), and what every block shares. A step passes this one object.
struct Blocks {
  std::vector<at::Tensor> norms;
  std::vector<c10::optional<at::Tensor>> norm_biases;
  std::vector<at::Tensor> weights;
  std::vector<c10::optional<at::Tensor>> biases;
  std::vector<int64_t> kinds, outs, parts;
  double eps;
  bool rms, prenorm;
  int64_t act;  // block_step.cpp's Act
  bool gated;
  int64_t heads, kv_heads;
  double scale;
  size_t layers, P;  // projections a layer: 4, or 6 with cross-attention
  std::vector<Lora> lora;  // each projection's adapter slots, in the order of `weights` (set_lora)

  Blocks(std::vector<at::Tensor> norms, std::vector<c10::optional<at::Tensor>> norm_biases, double eps, bool rms,
         bool prenorm, std::vector<at::Tensor> weights, std::vector<c10::optional<at::Tensor>> biases,
         std::vector<int64_t> kinds, std::vector<int64_t> outs, std::vector<int64_t> parts, int64_t act, bool gated,
         int64_t heads, int64_t kv_heads, double scale, int64_t layers, bool cross);

  // projection `index` (of `weights`) carries adapter slots: a, bt, ranks, bounds and scales as Lora's
  void set_lora(int64_t index, at::Tensor a, at::Tensor bt, at::Tensor ranks, std::vector<int64_t> bounds,
                int64_t rank, at::Tensor scales);
};

// What one stack_step computes besides the stack itself, by name (module.cpp binds each field; Python sets
// those it uses). The input rows: x (B, C), or each row's token `ids` (B,) embedded from `embed` (V, C)
// times `embed_scale`, plus its row of `pos_table` at `positions` (B,) (or at its past length). Rotary
// `cos`, `sin` (B, D). Each layer's key and value pool; the new keys' `slots` (B * K,) and each row's key
// count `keys` (B,), or each row's `past` length (a decode step: the op derives both, and the position,
// through the row's `tables` (B, M) of `block`-token blocks). With cross-attention, each layer's encoder
// keys and values (N, K, S, D) and each row's source (B, 1) with its key count. Then the final norm and
// the output projection `head` (its `head_kind` layout, `head_n` outputs) when given. `adapters` (B,)
// int64: each row's adapter slot (-1: none) in the projections that carry them (Blocks::set_lora).
struct StepArgs {
  c10::optional<at::Tensor> x, ids, embed, pos_table, positions, cos, sin;
  double embed_scale = 1.0;
  std::vector<at::Tensor> k_pools, v_pools;
  c10::optional<at::Tensor> slots, keys;
  at::Tensor tables;
  std::vector<int64_t> past;
  int64_t block = 0;
  std::vector<at::Tensor> cross_k, cross_v;
  c10::optional<at::Tensor> sources, source_keys;
  c10::optional<at::Tensor> final_norm, final_norm_bias;
  double final_eps = 0.0;
  bool final_rms = true;
  c10::optional<at::Tensor> head, head_bias;
  int64_t head_kind = 0, head_n = 0, head_parts = 1;
  c10::optional<at::Tensor> adapters;
};

// One step of a stack (block_step.cpp): the rows through every block, then the final norm and the head
at::Tensor stack_step(const Blocks& blocks, const StepArgs& args);

}  // namespace ts
