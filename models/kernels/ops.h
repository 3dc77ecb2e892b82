// The kernels one source calls from another (block_step.cpp runs the projections and the decode
// attention of panels.cpp and attention.cpp inside one op), with the checks of their torch ops.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace ts {

// How a projection's weights are stored (models/panels.py): float32 panels, or GGUF-style blocks
enum class Kind : int64_t { F32 = 0, Q4_1 = 1, Q8_0 = 2 };

// y (M, n) = x (M, K) W^T + bias, W in `kind`'s layout; parts: the activations' 8-bit parts (blocks)
at::Tensor project(Kind kind, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                   int64_t n, int64_t parts);

// q (B, H, D) against each row's keys in a paged pool -> (B, H, D) (attention.cpp's paged_decode_f32)
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& tables, const at::Tensor& lengths, int64_t kv_heads, int64_t block,
                        double scale);

// q (B, H, D) against the encoder's keys of each row's source: k, v (N, K, S, D) contiguous, sources
// (B, 1) int64 the source of each row, lengths (B,) int64 its real keys (a prefix of S) -> (B, H, D)
at::Tensor sources_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& sources,
                          const at::Tensor& lengths, double scale);

}  // namespace ts
