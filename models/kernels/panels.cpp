// Projections y = x W^T + b for CPU inference, weights repacked once into panels of 32 outputs.
//
// A panel holds 32 consecutive output channels with the input dimension outermost. One pass over a
// panel computes a few rows of x against those 32 outputs: the panel's weights are loaded (or
// unpacked from their blocks) once per step of k and multiplied with each row's inputs (an
// outer-product micro-kernel). At one row the weights stream from memory in the order they are
// stored; at many rows a panel stays in L2 while the rows pass over it, and the passes fetch the next
// panel meanwhile (Ahead). Every output is summed over k in the same order whatever the number of
// rows, and a row's activations are quantized on their own, so a row's result does not depend on
// what it is batched with (bitwise).
//
// Weight formats (models/projections/panels.py packs them):
//   f32   w (P, K, 32) float32: element (k, j) of panel p is W[32 p + j, k]; activations float32.
//   bf16  w (P, K / 2, 32) pairs of bfloat16 (W[32 p + j, 2 k2] and W[32 p + j, 2 k2 + 1] in one 32-bit
//         element); activations bfloat16, the products summed in float32 by vdpbf16ps (AVX512-BF16
//         builds only).
//   q8_0  (P, K / 32, 1088) uint8 records, GGUF's Q8_0 (w = q * d per group of 32 inputs):
//   q4_1  (P, K / 32, 640) uint8 records, GGUF's Q4_1 (w = q * d + mn per group of 32):
//         one record per panel and group of 32 inputs, read as one stream: 8 steps of 4 inputs, in
//         the operand order of an 8-bit dot-product instruction (int32 lane j sums bytes 4 j .. 4 j + 3:
//         input 4 t + i of output j), then the group's 32 float16 scales (and, for q4_1, 32 minima).
//         A q8_0 step is 128 bytes, outputs 0-15 then 16-31, each code stored + 128 (unsigned); a
//         q4_1 step is 64 bytes, output j in the low nibble and output 16 + j in the high one.
//         Activations are quantized per row and group of 32 in two 8-bit parts (or, parts = 1, in
//         one, as llama.cpp computes these formats: its Q8_1 / Q8_0): x = dx qx + dr rx; the
//         products are summed exactly in int32 (AVX512-VNNI's vpdpbusd where the CPU has it,
//         AVX512-BW or AVX2 multiply-adds otherwise: the same integers) and each group adds, per part,
//         d dx sum(q qx) (+ mn dx sum(qx) for q4_1).
// The vector code is written once on simd.h's operations and built per instruction set (AVX-512,
// AVX-512 with VNNI, AVX2): models/kernels/native.py builds and loads the one this CPU runs. Each
// build computes the same bits: the integer sums are exact and the float operations lane-wise.

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

constexpr int64_t NR = 32;  // outputs per panel
constexpr int NV = NR / LANES;  // vectors per panel row: 2 (AVX-512), 4 (AVX2)
constexpr int64_t GROUP = 32;  // inputs per quantization group
constexpr int64_t STEPS = GROUP / 4;  // steps of 4 inputs per group
// rows per pass, as many as the registers hold: 32 (AVX-512) or 16 (AVX2) vector registers
constexpr int MR = LANES == 16 ? 8 : 3;  // float activations: NV accumulators a row
constexpr int MR8 = LANES == 16 ? 4 : 2;  // block formats: up to 2 NV accumulators a row

// The next panel's weights, fetched into L2 while a pass that does not need the memory bus computes:
// with more rows than one pass takes, the passes after a panel's first find it in L2, so each pass
// fetches its share of the next panel, `per` cache lines at every step of its loop (run() sets the
// range; an empty one fetches nothing). At one pass a panel streams as it is read (the hardware
// prefetcher, and the block formats' own look-ahead), and nothing is fetched ahead.
struct Ahead {
  const char* at = nullptr;
  const char* end = nullptr;
  int64_t per = 0;
  TS_TARGET inline void step() {
    for (int64_t i = 0; i < per && at < end; ++i, at += 64) _mm_prefetch(at, _MM_HINT_T1);
  }
};

template <int R>
TS_TARGET inline void store_rows(vf (&acc)[R][NV], float* y, int64_t ldy, const float* bias, int64_t nvalid) {
  for (int m = 0; m < R; ++m) {
    if (nvalid == NR) {
      for (int v = 0; v < NV; ++v) {
        store(y + m * ldy + v * LANES, bias != nullptr ? add(acc[m][v], load(bias + v * LANES)) : acc[m][v]);
      }
    } else {
      alignas(64) float buf[NR];
      for (int v = 0; v < NV; ++v) store(buf + v * LANES, acc[m][v]);
      for (int64_t j = 0; j < nvalid; ++j) y[m * ldy + j] = buf[j] + (bias != nullptr ? bias[j] : 0.0f);
    }
  }
}

// Every kernel holds its weights and its activations and computes R rows from row m against panel p:
// tile<R>(p, m, y, ldy, bias, nvalid, ahead); ROWS is its widest pass; a panel's weights are
// panel_bytes() bytes from panel(p), and a pass's loop has steps() steps (for Ahead).
// Panels of float lanes: each step of k loads a panel row's NV vectors and multiply-adds them with
// every row's element k, broadcast (an outer product). Op says what an element is: a float32 (fmadd)
// or a pair of bfloat16 (vdpbf16ps, whose lanes sum a pair's two products into float32).
template <typename Op>
struct Panels {
  static constexpr int ROWS = Op::ROWS;
  const typename Op::Elem* w;  // (P, K, 32)
  const typename Op::Elem* x;  // (M, K)
  int64_t K;  // elements a row: inputs, or input pairs
  const char* panel(int64_t p) const { return reinterpret_cast<const char*>(w + p * K * NR); }
  int64_t panel_bytes() const { return K * NR * static_cast<int64_t>(sizeof(typename Op::Elem)); }
  int64_t steps() const { return K; }
  template <int R>
  TS_TARGET void tile(int64_t p, int64_t m, float* y, int64_t ldy, const float* bias, int64_t nvalid,
                      Ahead& ahead) const {
    vf acc[R][NV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = zero();
    const typename Op::Elem* wp = w + p * K * NR;
    const typename Op::Elem* xm = x + m * K;
    for (int64_t k = 0; k < K; ++k) {
      ahead.step();
      typename Op::Vec wk[NV];
      for (int v = 0; v < NV; ++v) wk[v] = Op::load(wp + k * NR + v * LANES);
      for (int r = 0; r < R; ++r) {
        const typename Op::Vec xb = Op::broadcast(xm[r * K + k]);
        for (int v = 0; v < NV; ++v) acc[r][v] = Op::madd(acc[r][v], xb, wk[v]);
      }
    }
    store_rows<R>(acc, y, ldy, bias, nvalid);
  }
};

// float32 panels: w (P, K, 32), x (M, K) float32
struct F32Op {
  static constexpr int ROWS = MR;
  using Elem = float;
  using Vec = vf;
  TS_TARGET static vf load(const float* p) { return ts::load(p); }
  TS_TARGET static vf broadcast(float x) { return set1(x); }
  TS_TARGET static vf madd(vf acc, vf x, vf w) { return fmadd(w, x, acc); }
};
using F32 = Panels<F32Op>;

#if defined(TS_BF16)
// bfloat16 panels (AVX512-BF16): w (P, K / 2, 32) pairs of bfloat16, element (k2, j) of panel p holds
// W[32 p + j, 2 k2] in its low half and W[32 p + j, 2 k2 + 1] in its high one; x (M, K / 2) pairs of
// bfloat16 activations. Each output sums its pairs in order of k, alone or in a batch.
struct BF16Op {
  static constexpr int ROWS = 12;  // 2 accumulators a row: 24 of the 32 registers
  using Elem = uint32_t;
  using Vec = vi;
  TS_TARGET static vi load(const uint32_t* p) { return load_i(p); }
  TS_TARGET static vi broadcast(uint32_t x) { return set1_i32(static_cast<int32_t>(x)); }
  TS_TARGET static vf madd(vf acc, vi x, vi w) { return dot_bf16(acc, x, w); }
};
using BF16 = Panels<BF16Op>;
#endif

// Activations in two 8-bit parts per group of 32 inputs: x = dx q + dr r + (a remainder of at most
// dr / 2): q = round(x / dx) to nearest even with dx = max |x| / 127 (llama.cpp's Q8_1 /
// Q8_0), then r the same of what q leaves, x - dx q. One part alone flips close calls that the
// float model makes (SmolLM2's greedy answer to "the capital of France", as llama.cpp's Q4_1 does);
// two carry ~16 bits, and the second costs little where the weights stream from memory.
struct Rows8 {
  const int8_t* q;  // (M, K) each
  const int8_t* r;
  const float* dx;  // (M, K / 32) each
  const float* dr;
  const int32_t* sq;  // (M, K / 32) each: sum(q), sum(r)
  const int32_t* sr;
};

// 32 floats -> 32 int8 = round(v / d), d = max |v| / 127 (0 for zeros); the codes also come back as int32
TS_TARGET inline void part(const vf (&x)[NV], int8_t* q, float* d, int32_t* sum, vi (&codes)[NV]) {
  vf amax = abs(x[0]);
  for (int v = 1; v < NV; ++v) amax = max(amax, abs(x[v]));
  const float step = reduce_max(amax) / 127.0f;
  const vf inv = set1(step != 0.0f ? 1.0f / step : 0.0f);
  vi total = zero_i();
  for (int v = 0; v < NV; ++v) {
    codes[v] = round_i32(mul(x[v], inv));
    total = add_i32(total, codes[v]);
  }
  narrow_i8(codes, q);
  *d = step;
  *sum = reduce_add_i32(total);
}

TS_TARGET void quantize_group(const float* x, bool fine, int8_t* q, int8_t* r, float* dx, float* dr, int32_t* sq,
                              int32_t* sr) {
  vf a[NV];
  for (int v = 0; v < NV; ++v) a[v] = load(x + v * LANES);
  vi codes[NV];
  part(a, q, dx, sq, codes);
  if (!fine) return;
  const vf step = set1(*dx);
  vf left[NV];
  for (int v = 0; v < NV; ++v) left[v] = fnmadd(to_float(codes[v]), step, a[v]);
  part(left, r, dr, sr, codes);
}

// x (M, K) -> the calling thread's scratch, group by group (no allocation per call; a pass only reads it)
Rows8 quantize_activations(const float* x, int64_t M, int64_t K, bool fine) {
  thread_local std::vector<int8_t> codes;  // q, then r
  thread_local std::vector<float> steps;  // dx, then dr
  thread_local std::vector<int32_t> sums;  // sum(q), then sum(r)
  const int64_t groups = M * (K / GROUP);
  codes.resize(2 * M * K);
  steps.resize(2 * groups);
  sums.resize(2 * groups);
  int8_t* q = codes.data();
  int8_t* r = q + M * K;
  float* dx = steps.data();
  float* dr = dx + groups;
  int32_t* sq = sums.data();
  int32_t* sr = sq + groups;
  at::parallel_for(0, groups, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      quantize_group(x + i * GROUP, fine, q + i * GROUP, r + i * GROUP, dx + i, dr + i, sq + i, sr + i);
    }
  });
  return {q, r, dx, dr, sq, sr};
}

// One activation part's integer sums over a group: sum(w q) per output (a format's partials while
// its steps run, then int32): outputs 0-15, 16-31 (AVX2: 0-7, 8-15, 16-23, 24-31)
using Sums = vi[NV];

// The two block formats: a record's step t as unsigned bytes (w[v]: outputs v LANES .. (v + 1) LANES - 1),
// and what a group adds to the outputs once its integer sums are done: (q, dx) and (r, dr) are the
// activations' two parts.
struct Q80Format {
  static constexpr int64_t RECORD = STEPS * 2 * 64 + NR * 2;
  TS_TARGET static void step(const uint8_t* rec, int64_t t, vi (&w)[NV]) {
    for (int v = 0; v < NV; ++v) w[v] = load_i(rec + t * 128 + v * LANES * 4);
  }
  // a group's integer sums, step by step: partials, then the int32 sums
  TS_TARGET static vi dot(vi partial, vi w, vi x) { return dot4(partial, w, x); }
  TS_TARGET static vi sum(vi partial) { return partial; }
  // codes + 128 were summed: subtract 128 sum(x codes) (exact); y += d (dx sum(w q) + dr sum(w r))
  TS_TARGET static void add_to(const uint8_t* rec, const Sums& q, const Sums& r, float dx, float dr, int32_t sq,
                               int32_t sr, vf (&acc)[NV]) {
    const uint8_t* d = rec + STEPS * 128;
    const vi oq = set1_i32(128 * sq), orr = set1_i32(128 * sr);
    const vf sdx = set1(dx), sdr = set1(dr);
    for (int v = 0; v < NV; ++v) {
      const vf x = fmadd(to_float(sub_i32(r[v], orr)), sdr, mul(to_float(sub_i32(q[v], oq)), sdx));
      acc[v] = fmadd(x, halves(d + v * LANES * 2), acc[v]);
    }
  }
};

struct Q41Format {
  static constexpr int64_t RECORD = STEPS * 64 + 2 * NR * 2;
  // a step's 64 bytes: byte 4 j + i holds input i of output j (low nibble) and of output 16 + j (high)
  TS_TARGET static void step(const uint8_t* rec, int64_t t, vi (&w)[NV]) {
    const vi low = set1_i8(0x0F);
    for (int c = 0; c < NV / 2; ++c) {
      const vi b = load_i(rec + t * 64 + c * LANES * 4);
      w[c] = and_i(b, low);
      w[c + NV / 2] = and_i(srli_i16(b, 4), low);
    }
  }
  TS_TARGET static vi dot(vi partial, vi w, vi x) { return nibbles_step(partial, w, x); }
  TS_TARGET static vi sum(vi partial) { return nibbles_sum(partial); }
  // y += d (dx sum(w q) + dr sum(w r)) + mn (dx sum(q) + dr sum(r))
  TS_TARGET static void add_to(const uint8_t* rec, const Sums& q, const Sums& r, float dx, float dr, int32_t sq,
                               int32_t sr, vf (&acc)[NV]) {
    const uint8_t* d = rec + STEPS * 64;
    const vf sdx = set1(dx), sdr = set1(dr);
    const vf sum = set1(dx * static_cast<float>(sq) + dr * static_cast<float>(sr));
    for (int v = 0; v < NV; ++v) {
      const vf x = fmadd(to_float(r[v]), sdr, mul(to_float(q[v]), sdx));
      acc[v] = fmadd(halves(d + 64 + v * LANES * 2), sum, fmadd(x, halves(d + v * LANES * 2), acc[v]));
    }
  }
};

// Records a pass reads ahead of the one it computes: a panel's records, and the next panel's after
// them, lie one after another, but at one row the hardware prefetcher alone lets the first groups of
// every panel wait on memory (cold weights streamed at a fraction of the rate of warm ones). Past
// the end of the weights it fetches nothing (a prefetch never faults).
constexpr int64_t AHEAD = 8;
template <int64_t BYTES>
TS_TARGET inline void prefetch_record(const uint8_t* rec) {
  for (int64_t line = 0; line < BYTES; line += 64) _mm_prefetch(reinterpret_cast<const char*>(rec + line), _MM_HINT_T0);
}

template <typename Format, bool FINE>
struct Blocks {
  static constexpr int ROWS = MR8;
  const uint8_t* q;  // (P, K / 32, Format::RECORD)
  Rows8 x;
  int64_t K;
  const char* panel(int64_t p) const { return reinterpret_cast<const char*>(q + p * (K / GROUP) * Format::RECORD); }
  int64_t panel_bytes() const { return (K / GROUP) * Format::RECORD; }
  int64_t steps() const { return K / GROUP; }
  template <int R>
  TS_TARGET void tile(int64_t p, int64_t m, float* y, int64_t ldy, const float* bias, int64_t nvalid,
                      Ahead& ahead) const {
    const int64_t G = K / GROUP;
    vf acc[R][NV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = zero();
    for (int64_t g = 0; g < G; ++g) {
      ahead.step();
      const uint8_t* rec = q + (p * G + g) * Format::RECORD;
      prefetch_record<Format::RECORD>(rec + AHEAD * Format::RECORD);
      vi coarse[R][NV], fine[R][NV];  // the activations' two parts
      for (int i = 0; i < R; ++i)
        for (int v = 0; v < NV; ++v) coarse[i][v] = fine[i][v] = zero_i();
      const int64_t at = m * G + g;
      // unrolled: a loop over the steps made the compiler copy every accumulator through another
      // register at each step (and spill some), twice the instructions of the products themselves
#pragma GCC unroll 8
      for (int64_t t = 0; t < STEPS; ++t) {
        vi w[NV];
        Format::step(rec, t, w);
        for (int i = 0; i < R; ++i) {
          const int64_t k = (m + i) * K + g * GROUP + 4 * t;
          int32_t four;
          std::memcpy(&four, x.q + k, 4);
          const vi bq = set1_i32(four);
          for (int v = 0; v < NV; ++v) coarse[i][v] = Format::dot(coarse[i][v], w[v], bq);
          if constexpr (FINE) {
            std::memcpy(&four, x.r + k, 4);
            const vi br = set1_i32(four);
            for (int v = 0; v < NV; ++v) fine[i][v] = Format::dot(fine[i][v], w[v], br);
          }
        }
      }
      for (int i = 0; i < R; ++i) {  // one part: the fine sums stay 0 (adding exact zeros: the same bits)
        for (int v = 0; v < NV; ++v) {
          coarse[i][v] = Format::sum(coarse[i][v]);
          if constexpr (FINE) fine[i][v] = Format::sum(fine[i][v]);
        }
        const int64_t j = at + i * G;
        Format::add_to(rec, coarse[i], fine[i], x.dx[j], FINE ? x.dr[j] : 0.0f, x.sq[j], FINE ? x.sr[j] : 0, acc[i]);
      }
    }
    store_rows<R>(acc, y, ldy, bias, nvalid);
  }
};

// the last M % ROWS rows of a panel, in one pass of exactly that many
template <int R, typename Kernel>
void rest(const Kernel& kernel, int64_t left, int64_t p, int64_t m, float* y, int64_t N, const float* bias,
          int64_t nvalid, Ahead& ahead) {
  if constexpr (R > 0) {
    if (left == R) return kernel.template tile<R>(p, m, y, N, bias, nvalid, ahead);
    rest<R - 1>(kernel, left, p, m, y, N, bias, nvalid, ahead);
  }
}

// y (M, N) against P panels; parallel over panels, rows in passes of up to Kernel::ROWS; `after` (or
// null) on each thread's outputs once its panels are done
template <typename Kernel>
at::Tensor run(const Kernel& kernel, const at::Tensor& x, int64_t P, int64_t N, const c10::optional<at::Tensor>& bias,
               const After* after = nullptr) {
  constexpr int R = Kernel::ROWS;
  const int64_t M = x.size(0);
  TORCH_CHECK(N <= P * NR && N > (P - 1) * NR, "N does not match the number of panels");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bad bias");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const int64_t passes = (M + R - 1) / R;
  const int64_t lines = (kernel.panel_bytes() + 63) / 64;
  // each pass fetches its share of the next panel's lines, spread over the pass's loop
  const int64_t per = passes > 1 ? ((lines + passes - 1) / passes + kernel.steps() - 1) / kernel.steps() : 0;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t nvalid = std::min<int64_t>(NR, N - p * NR);
      const float* bp = b == nullptr ? nullptr : b + p * NR;
      float* yo = yp + p * NR;
      Ahead ahead;
      if (per > 0 && p + 1 < p1) {
        ahead.at = kernel.panel(p + 1);
        ahead.end = ahead.at + kernel.panel_bytes();
        ahead.per = per;
      }
      int64_t m = 0;
      for (; m + R <= M; m += R) kernel.template tile<R>(p, m, yo + m * N, N, bp, nvalid, ahead);
      rest<R - 1>(kernel, M - m, p, m, yo + m * N, N, bp, nvalid, ahead);
    }
    if (after != nullptr) (*after)(yp, p0 * NR, std::min(N, p1 * NR));
  });
  return y;
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous float32 matrix");
}

void check_panels(const at::Tensor& t, int64_t K, at::ScalarType dtype, int64_t inner, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.dim() == 3 && t.size(1) == K && t.size(2) == inner,
              name, " has the wrong dtype, layout or shape");
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t n,
                      const After* after = nullptr) {
  check_x(x);
  check_panels(w, x.size(1), at::kFloat, NR, "w");
  return run(F32{w.data_ptr<float>(), x.data_ptr<float>(), x.size(1)}, x, w.size(0), n, bias, after);
}

// x (M, K) bfloat16, w (P, K / 2, 32) int32 (bfloat16 pairs) -> (M, n) float32
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t n,
                       const After* after = nullptr) {
#if defined(TS_BF16)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.size(1) % 2 == 0,
              "x must be a contiguous bfloat16 matrix of an even width");
  check_panels(w, x.size(1) / 2, at::kInt, NR, "w");
  const BF16 kernel{reinterpret_cast<const uint32_t*>(w.data_ptr<int32_t>()),
                    reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>()), x.size(1) / 2};
  return run(kernel, x, w.size(0), n, bias, after);
#else
  TORCH_CHECK(false, "this build of the kernels has no bfloat16 panels (they need AVX512-BF16)");
#endif
}

template <typename Format>
at::Tensor linear_blocks(const at::Tensor& x, const at::Tensor& q, const c10::optional<at::Tensor>& bias, int64_t n,
                         int64_t parts, const After* after = nullptr) {
  check_x(x);
  const int64_t K = x.size(1);
  TORCH_CHECK(K % GROUP == 0, "block formats need the input size to be a multiple of 32");
  TORCH_CHECK(parts == 1 || parts == 2, "activations come in 1 or 2 parts of 8 bits");
  check_panels(q, K / GROUP, at::kByte, Format::RECORD, "q");
  const Rows8 rows = quantize_activations(x.data_ptr<float>(), x.size(0), K, parts == 2);
  if (parts == 2) return run(Blocks<Format, true>{q.data_ptr<uint8_t>(), rows, K}, x, q.size(0), n, bias, after);
  return run(Blocks<Format, false>{q.data_ptr<uint8_t>(), rows, K}, x, q.size(0), n, bias, after);
}

}  // namespace

at::Tensor ts::project(Kind kind, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                       int64_t n, int64_t parts, const After* after) {
  switch (kind) {
    case Kind::F32:
      return linear_f32(x, w, bias, n, after);
    case Kind::Q4_1:
      return linear_blocks<Q41Format>(x, w, bias, n, parts, after);
    case Kind::Q8_0:
      return linear_blocks<Q80Format>(x, w, bias, n, parts, after);
    case Kind::BF16:
      return linear_bf16(x.scalar_type() == at::kBFloat16 ? x : x.to(at::kBFloat16), w, bias, n, after);
  }
  TORCH_CHECK(false, "unknown projection kind ", static_cast<int64_t>(kind));
}

TORCH_LIBRARY(ts_panels, m) {
  m.def("linear_f32(Tensor x, Tensor w, Tensor? bias, int n) -> Tensor");
  m.def("linear_q4_1(Tensor x, Tensor q, Tensor? bias, int n, int parts) -> Tensor");
  m.def("linear_q8_0(Tensor x, Tensor q, Tensor? bias, int n, int parts) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(ts_panels, CPU, m) {
  m.impl("linear_f32", [](const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                          int64_t n) { return linear_f32(x, w, bias, n); });
  m.impl("linear_q4_1", [](const at::Tensor& x, const at::Tensor& q, const c10::optional<at::Tensor>& bias, int64_t n,
                           int64_t parts) { return linear_blocks<Q41Format>(x, q, bias, n, parts); });
  m.impl("linear_q8_0", [](const at::Tensor& x, const at::Tensor& q, const c10::optional<at::Tensor>& bias, int64_t n,
                           int64_t parts) { return linear_blocks<Q80Format>(x, q, bias, n, parts); });
  m.impl("linear_bf16", [](const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                           int64_t n) { return linear_bf16(x, w, bias, n); });
}
