// Projections y = x W^T + b for CPU inference, weights repacked once into panels of 32 outputs.
//
// A panel holds 32 consecutive output channels with the input dimension outermost. One pass over a
// panel computes a few rows of x against those 32 outputs: the panel's weights are loaded (or
// unpacked from their blocks) once per step of k and multiplied with each row's inputs (an
// outer-product micro-kernel). At one row the weights stream from memory in the order they are
// stored; at many rows a panel stays in L2 while the rows pass over it. Every output is summed over
// k in the same order whatever the number of rows, and a row's activations are quantized on their
// own, so a row's result does not depend on what it is batched with (bitwise).
//
// Weight formats (models/panels.py packs them):
//   f32   w (P, K, 32) float32: element (k, j) of panel p is W[32 p + j, k]; activations float32.
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
//         AVX512-BW multiply-adds otherwise: the same integers) and each group adds, per part,
//         d dx sum(q qx) (+ mn dx sum(qx) for q4_1).
// The AVX-512 code is compiled for that target only and called only where the CPU has it
// (models/kernels/native.py checks, and defines TS_VNNI where it has AVX512-VNNI).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t NR = 32;  // outputs per panel
constexpr int64_t GROUP = 32;  // inputs per quantization group
constexpr int64_t STEPS = GROUP / 4;  // steps of 4 inputs per group
constexpr int MR = 8;  // rows per pass (float activations)
constexpr int MR8 = 4;  // rows per pass (block formats: up to 6 accumulators a row)

#ifdef TS_VNNI
#define TS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512vnni")))
#else
#define TS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#endif

template <int R>
TS_AVX512 inline void store(__m512 (&acc)[R][2], float* y, int64_t ldy, const float* bias, int64_t nvalid) {
  for (int m = 0; m < R; ++m) {
    __m512 a0 = acc[m][0], a1 = acc[m][1];
    if (bias != nullptr && nvalid == NR) {
      a0 = _mm512_add_ps(a0, _mm512_loadu_ps(bias));
      a1 = _mm512_add_ps(a1, _mm512_loadu_ps(bias + 16));
    }
    if (nvalid == NR) {
      _mm512_storeu_ps(y + m * ldy, a0);
      _mm512_storeu_ps(y + m * ldy + 16, a1);
    } else {
      alignas(64) float buf[NR];
      _mm512_store_ps(buf, a0);
      _mm512_store_ps(buf + 16, a1);
      for (int64_t j = 0; j < nvalid; ++j) y[m * ldy + j] = buf[j] + (bias != nullptr ? bias[j] : 0.0f);
    }
  }
}

// Every kernel holds its weights and its activations and computes R rows from row m against panel p:
// tile<R>(p, m, y, ldy, bias, nvalid); ROWS is its widest pass.
struct F32 {
  static constexpr int ROWS = MR;
  const float* w;  // (P, K, 32)
  const float* x;  // (M, K)
  int64_t K;
  template <int R>
  TS_AVX512 void tile(int64_t p, int64_t m, float* y, int64_t ldy, const float* bias, int64_t nvalid) const {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const float* wp = w + p * K * NR;
    const float* xm = x + m * K;
    for (int64_t k = 0; k < K; ++k) {
      const __m512 w0 = _mm512_loadu_ps(wp + k * NR), w1 = _mm512_loadu_ps(wp + k * NR + 16);
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(xm[r * K + k]);
        acc[r][0] = _mm512_fmadd_ps(w0, xb, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(w1, xb, acc[r][1]);
      }
    }
    store<R>(acc, y, ldy, bias, nvalid);
  }
};

TS_AVX512 inline __m512 halves(const uint8_t* h) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));  // 16 float16 -> float32
}

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

// 32 floats -> 32 int8 = round(v / d), d = max |v| / 127 (0 for zeros); returns the codes as int32
TS_AVX512 inline void part(__m512 a, __m512 b, int8_t* q, float* d, int32_t* sum, __m512i& qa, __m512i& qb) {
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float step = amax / 127.0f;
  const __m512 inv = _mm512_set1_ps(step != 0.0f ? 1.0f / step : 0.0f);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  qa = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, inv), kNearest);
  qb = _mm512_cvt_roundps_epi32(_mm512_mul_ps(b, inv), kNearest);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  *d = step;
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}

TS_AVX512 void quantize_group(const float* x, bool fine, int8_t* q, int8_t* r, float* dx, float* dr, int32_t* sq,
                              int32_t* sr) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  __m512i qa, qb;
  part(a, b, q, dx, sq, qa, qb);
  if (!fine) return;
  const __m512 step = _mm512_set1_ps(*dx);
  part(_mm512_fnmadd_ps(_mm512_cvtepi32_ps(qa), step, a), _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qb), step, b), r, dr,
       sr, qa, qb);
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

// acc += sum over i < 4 of u[4 j + i] * s[4 j + i] in each int32 lane j (unsigned x signed bytes)
TS_AVX512 inline __m512i dot4(__m512i acc, __m512i u, __m512i s) {
#ifdef TS_VNNI
  return _mm512_dpbusd_epi32(acc, u, s);
#else  // even and odd bytes widened to int16, multiplied and added in pairs to int32: exact for any u8
  const __m512i even = _mm512_madd_epi16(_mm512_and_si512(u, _mm512_set1_epi16(0xFF)),
                                         _mm512_srai_epi16(_mm512_slli_epi16(s, 8), 8));
  const __m512i odd = _mm512_madd_epi16(_mm512_srli_epi16(u, 8), _mm512_srai_epi16(s, 8));
  return _mm512_add_epi32(acc, _mm512_add_epi32(even, odd));
#endif
}

// One activation part's integer sums over a group: sum(w q) per output, in int32
struct Sums {
  __m512i dot[2];  // outputs 0-15, 16-31
};

// The two block formats: a record's step t as unsigned bytes (w0: outputs 0-15, w1: 16-31), and
// what a group adds to the outputs once its integer sums are done: (q, dx) and (r, dr) are the
// activations' two parts.
struct Q80Format {
  static constexpr int64_t RECORD = STEPS * 2 * 64 + NR * 2;
  TS_AVX512 static void step(const uint8_t* rec, int64_t t, __m512i& w0, __m512i& w1) {
    w0 = _mm512_loadu_si512(rec + t * 128);
    w1 = _mm512_loadu_si512(rec + t * 128 + 64);
  }
  // codes + 128 were summed: subtract 128 sum(x codes) (exact); y += d (dx sum(w q) + dr sum(w r))
  TS_AVX512 static void add(const uint8_t* rec, const Sums& q, const Sums& r, float dx, float dr, int32_t sq,
                            int32_t sr, __m512 (&acc)[2]) {
    const uint8_t* d = rec + STEPS * 128;
    const __m512i oq = _mm512_set1_epi32(128 * sq), orr = _mm512_set1_epi32(128 * sr);
    const __m512 sdx = _mm512_set1_ps(dx), sdr = _mm512_set1_ps(dr);
    for (int h = 0; h < 2; ++h) {
      const __m512 x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(r.dot[h], orr)), sdr,
                                       _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q.dot[h], oq)), sdx));
      acc[h] = _mm512_fmadd_ps(x, halves(d + 32 * h), acc[h]);
    }
  }
};

struct Q41Format {
  static constexpr int64_t RECORD = STEPS * 64 + 2 * NR * 2;
  TS_AVX512 static void step(const uint8_t* rec, int64_t t, __m512i& w0, __m512i& w1) {
    const __m512i b = _mm512_loadu_si512(rec + t * 64), low = _mm512_set1_epi8(0x0F);
    w0 = _mm512_and_si512(b, low);
    w1 = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
  }
  // y += d (dx sum(w q) + dr sum(w r)) + mn (dx sum(q) + dr sum(r))
  TS_AVX512 static void add(const uint8_t* rec, const Sums& q, const Sums& r, float dx, float dr, int32_t sq,
                            int32_t sr, __m512 (&acc)[2]) {
    const uint8_t* d = rec + STEPS * 64;
    const __m512 sdx = _mm512_set1_ps(dx), sdr = _mm512_set1_ps(dr);
    const __m512 sum = _mm512_set1_ps(dx * static_cast<float>(sq) + dr * static_cast<float>(sr));
    for (int h = 0; h < 2; ++h) {
      const __m512 x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(r.dot[h]), sdr, _mm512_mul_ps(_mm512_cvtepi32_ps(q.dot[h]), sdx));
      acc[h] = _mm512_fmadd_ps(halves(d + 64 + 32 * h), sum, _mm512_fmadd_ps(x, halves(d + 32 * h), acc[h]));
    }
  }
};

template <typename Format, bool FINE>
struct Blocks {
  static constexpr int ROWS = MR8;
  const uint8_t* q;  // (P, K / 32, Format::RECORD)
  Rows8 x;
  int64_t K;
  template <int R>
  TS_AVX512 void tile(int64_t p, int64_t m, float* y, int64_t ldy, const float* bias, int64_t nvalid) const {
    const int64_t G = K / GROUP;
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* rec = q + (p * G + g) * Format::RECORD;
      Sums coarse[R], fine[R];  // the activations' two parts
      for (int i = 0; i < R; ++i) coarse[i].dot[0] = coarse[i].dot[1] = fine[i].dot[0] = fine[i].dot[1] = _mm512_setzero_si512();
      const int64_t at = m * G + g;
      for (int64_t t = 0; t < STEPS; ++t) {
        __m512i w0, w1;
        Format::step(rec, t, w0, w1);
        for (int i = 0; i < R; ++i) {
          const int64_t k = (m + i) * K + g * GROUP + 4 * t;
          int32_t four;
          std::memcpy(&four, x.q + k, 4);
          const __m512i bq = _mm512_set1_epi32(four);
          coarse[i].dot[0] = dot4(coarse[i].dot[0], w0, bq);
          coarse[i].dot[1] = dot4(coarse[i].dot[1], w1, bq);
          if constexpr (FINE) {
            std::memcpy(&four, x.r + k, 4);
            const __m512i br = _mm512_set1_epi32(four);
            fine[i].dot[0] = dot4(fine[i].dot[0], w0, br);
            fine[i].dot[1] = dot4(fine[i].dot[1], w1, br);
          }
        }
      }
      for (int i = 0; i < R; ++i) {  // one part: the fine sums stay 0 (adding exact zeros: the same bits)
        const int64_t j = at + i * G;
        Format::add(rec, coarse[i], fine[i], x.dx[j], FINE ? x.dr[j] : 0.0f, x.sq[j], FINE ? x.sr[j] : 0, acc[i]);
      }
    }
    store<R>(acc, y, ldy, bias, nvalid);
  }
};

// the last M % ROWS rows of a panel, in one pass of exactly that many
template <int R, typename Kernel>
void rest(const Kernel& kernel, int64_t left, int64_t p, int64_t m, float* y, int64_t N, const float* bias,
          int64_t nvalid) {
  if constexpr (R > 0) {
    if (left == R) return kernel.template tile<R>(p, m, y, N, bias, nvalid);
    rest<R - 1>(kernel, left, p, m, y, N, bias, nvalid);
  }
}

// y (M, N) against P panels; parallel over panels, rows in passes of up to Kernel::ROWS
template <typename Kernel>
at::Tensor run(const Kernel& kernel, const at::Tensor& x, int64_t P, int64_t N, const c10::optional<at::Tensor>& bias) {
  constexpr int R = Kernel::ROWS;
  const int64_t M = x.size(0);
  TORCH_CHECK(N <= P * NR && N > (P - 1) * NR, "N does not match the number of panels");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bad bias");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t nvalid = std::min<int64_t>(NR, N - p * NR);
      const float* bp = b == nullptr ? nullptr : b + p * NR;
      float* yo = yp + p * NR;
      int64_t m = 0;
      for (; m + R <= M; m += R) kernel.template tile<R>(p, m, yo + m * N, N, bp, nvalid);
      rest<R - 1>(kernel, M - m, p, m, yo + m * N, N, bp, nvalid);
    }
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

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t n) {
  check_x(x);
  check_panels(w, x.size(1), at::kFloat, NR, "w");
  return run(F32{w.data_ptr<float>(), x.data_ptr<float>(), x.size(1)}, x, w.size(0), n, bias);
}

template <typename Format>
at::Tensor linear_blocks(const at::Tensor& x, const at::Tensor& q, const c10::optional<at::Tensor>& bias, int64_t n,
                         int64_t parts) {
  check_x(x);
  const int64_t K = x.size(1);
  TORCH_CHECK(K % GROUP == 0, "block formats need the input size to be a multiple of 32");
  TORCH_CHECK(parts == 1 || parts == 2, "activations come in 1 or 2 parts of 8 bits");
  check_panels(q, K / GROUP, at::kByte, Format::RECORD, "q");
  const Rows8 rows = quantize_activations(x.data_ptr<float>(), x.size(0), K, parts == 2);
  if (parts == 2) return run(Blocks<Format, true>{q.data_ptr<uint8_t>(), rows, K}, x, q.size(0), n, bias);
  return run(Blocks<Format, false>{q.data_ptr<uint8_t>(), rows, K}, x, q.size(0), n, bias);
}

}  // namespace

TORCH_LIBRARY(ts_panels, m) {
  m.def("linear_f32(Tensor x, Tensor w, Tensor? bias, int n) -> Tensor");
  m.def("linear_q4_1(Tensor x, Tensor q, Tensor? bias, int n, int parts) -> Tensor");
  m.def("linear_q8_0(Tensor x, Tensor q, Tensor? bias, int n, int parts) -> Tensor");
}

TORCH_LIBRARY_IMPL(ts_panels, CPU, m) {
  m.impl("linear_f32", &linear_f32);
  m.impl("linear_q4_1", &linear_blocks<Q41Format>);
  m.impl("linear_q8_0", &linear_blocks<Q80Format>);
}
