// Projections y = x W^T + b for CPU inference, weights repacked once into panels of 32 outputs.
//
// A panel holds 32 consecutive output channels with the input dimension outermost: element (k, j) of
// panel p is W[32 p + j, k]. One pass over a panel computes up to 8 rows of x against those 32
// outputs: per k, the panel's 32 weights are loaded (or decoded from their blocks) once and
// multiplied with each row's x[m, k] (an outer-product micro-kernel). At one row the weights stream
// from memory in the order they are stored; at many rows a panel (32 x K) stays in L2 while the rows
// pass over it. Every output is summed over k in the same order whatever the number of rows, so a
// row's result does not depend on what it is batched with (bitwise).
//
// Weight formats (models/panels.py packs them):
//   f32   w (P, K, 32) float32
//   q4_1  q (P, K, 16) uint8: byte j of step k holds output j (low nibble) and 16 + j (high nibble);
//         d, mn (P, K / 32, 32) float16: w = q * d + mn per group of 32 inputs (GGUF's Q4_1)
//   q8_0  q (P, K, 32) int8, d (P, K / 32, 32) float16: w = q * d per group of 32 (GGUF's Q8_0)
// Activations stay float32; the AVX-512 code is compiled for that target only and called only where
// the CPU has it (models/kernels/native.py checks). A block format at more rows than one pass decodes
// each panel to float32 once per call and runs the float passes on it (same values, same bits).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t NR = 32;  // outputs per panel
constexpr int64_t GROUP = 32;  // inputs per quantization group
constexpr int MR = 8;  // rows per pass

#define TS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

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

// Weights walked in panel order, 32 at a time (w0: outputs 0-15, w1: 16-31), handed to a sink: the
// outer-product passes over up to R rows (OuterSink) or a float32 buffer (StoreSink).
template <int R>
struct OuterSink {
  __m512 (*acc)[2];
  const float* x;
  int64_t ldx;
  TS_AVX512 void operator()(int64_t k, __m512 w0, __m512 w1) const {
    for (int m = 0; m < R; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
      acc[m][0] = _mm512_fmadd_ps(w0, xb, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(w1, xb, acc[m][1]);
    }
  }
};

struct StoreSink {
  float* out;
  TS_AVX512 void operator()(int64_t k, __m512 w0, __m512 w1) const {
    _mm512_storeu_ps(out + k * NR, w0);
    _mm512_storeu_ps(out + k * NR + 16, w1);
  }
};

struct F32 {
  const float* w;
  template <int R>
  TS_AVX512 void tile(int64_t p, const float* x, int64_t ldx, int64_t K, float* y, int64_t ldy, const float* bias,
                      int64_t nvalid) const {
    __m512 acc[R][2];
    for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    const float* wp = w + p * K * NR;
    const OuterSink<R> sink{acc, x, ldx};
    for (int64_t k = 0; k < K; ++k) sink(k, _mm512_loadu_ps(wp + k * NR), _mm512_loadu_ps(wp + k * NR + 16));
    store<R>(acc, y, ldy, bias, nvalid);
  }
};

// A block format: Derived::walk decodes its codes and hands the weights to a sink.
template <typename Derived>
struct Blocks {
  template <int R>
  TS_AVX512 void tile(int64_t p, const float* x, int64_t ldx, int64_t K, float* y, int64_t ldy, const float* bias,
                      int64_t nvalid) const {
    __m512 acc[R][2];
    for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    static_cast<const Derived*>(this)->walk(p, K, OuterSink<R>{acc, x, ldx});
    store<R>(acc, y, ldy, bias, nvalid);
  }
  // panel p decoded to float32 (K, 32) into out: for many rows, decoded once instead of once per pass
  TS_AVX512 void decode(int64_t p, int64_t K, float* out) const {
    static_cast<const Derived*>(this)->walk(p, K, StoreSink{out});
  }
};

TS_AVX512 inline __m512 halves(const uint16_t* h) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));  // 16 float16 -> float32
}

struct Q41 : Blocks<Q41> {
  const uint8_t* q;
  const uint16_t* d;
  const uint16_t* mn;
  Q41(const uint8_t* q_, const uint16_t* d_, const uint16_t* mn_) : q(q_), d(d_), mn(mn_) {}
  template <typename Sink>
  TS_AVX512 void walk(int64_t p, int64_t K, const Sink& sink) const {
    const uint8_t* qp = q + p * K * 16;
    const uint16_t* dp = d + p * K;  // (K / 32) groups x 32 outputs
    const uint16_t* mp = mn + p * K;
    const __m512i low = _mm512_set1_epi32(0xF);
    for (int64_t g = 0; g < K / GROUP; ++g) {
      const __m512 d0 = halves(dp + g * NR), d1 = halves(dp + g * NR + 16);
      const __m512 m0 = halves(mp + g * NR), m1 = halves(mp + g * NR + 16);
      for (int64_t k = g * GROUP; k < (g + 1) * GROUP; ++k) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qp + k * 16)));
        sink(k, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, low)), d0, m0),
             _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), d1, m1));
      }
    }
  }
};

struct Q80 : Blocks<Q80> {
  const int8_t* q;
  const uint16_t* d;
  Q80(const int8_t* q_, const uint16_t* d_) : q(q_), d(d_) {}
  template <typename Sink>
  TS_AVX512 void walk(int64_t p, int64_t K, const Sink& sink) const {
    const int8_t* qp = q + p * K * NR;
    const uint16_t* dp = d + p * K;
    for (int64_t g = 0; g < K / GROUP; ++g) {
      const __m512 d0 = halves(dp + g * NR), d1 = halves(dp + g * NR + 16);
      for (int64_t k = g * GROUP; k < (g + 1) * GROUP; ++k) {
        const __m512i b0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qp + k * NR)));
        const __m512i b1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qp + k * NR + 16)));
        sink(k, _mm512_mul_ps(_mm512_cvtepi32_ps(b0), d0), _mm512_mul_ps(_mm512_cvtepi32_ps(b1), d1));
      }
    }
  }
};

template <int R, typename Kernel>
void pass(const Kernel& kernel, int64_t p, const float* x, int64_t K, float* y, int64_t N, const float* bias,
          int64_t nvalid) {
  kernel.template tile<R>(p, x, K, K, y, N, bias, nvalid);
}

template <typename Kernel>
void panel_rows(const Kernel& kernel, int64_t p, const float* xp, int64_t M, int64_t K, float* yo, int64_t N,
                const float* bp, int64_t nvalid) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) pass<MR>(kernel, p, xp + m * K, K, yo + m * N, N, bp, nvalid);
  switch (M - m) {
    case 7: pass<7>(kernel, p, xp + m * K, K, yo + m * N, N, bp, nvalid); break;
    case 6: pass<6>(kernel, p, xp + m * K, K, yo + m * N, N, bp, nvalid); break;
    case 5: pass<5>(kernel, p, xp + m * K, K, yo + m * N, N, bp, nvalid); break;
    case 4: pass<4>(kernel, p, xp + m * K, K, yo + m * N, N, bp, nvalid); break;
    case 3: pass<3>(kernel, p, xp + m * K, K, yo + m * N, N, bp, nvalid); break;
    case 2: pass<2>(kernel, p, xp + m * K, K, yo + m * N, N, bp, nvalid); break;
    case 1: pass<1>(kernel, p, xp + m * K, K, yo + m * N, N, bp, nvalid); break;
    default: break;
  }
}

template <typename Kernel>
constexpr bool has_decode = !std::is_same_v<Kernel, F32>;

// y (M, N) = x (M, K) against P panels; parallel over panels, rows in passes of up to MR. A block
// format with more rows than one pass decodes each panel to float32 once (into a buffer that stays in
// L2) and runs the float passes on it: the same products in the same order, so the same bits as
// decoding inside every pass.
template <typename Kernel>
at::Tensor run(const Kernel& kernel, const at::Tensor& x, int64_t P, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous float32 matrix");
  TORCH_CHECK(N <= P * NR && N > (P - 1) * NR, "N does not match the number of panels");
  const int64_t M = x.size(0), K = x.size(1);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bad bias");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> decoded;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t nvalid = std::min<int64_t>(NR, N - p * NR);
      const float* bp = b == nullptr ? nullptr : b + p * NR;
      if constexpr (has_decode<Kernel>) {
        if (M > MR) {
          decoded.resize(K * NR);
          kernel.decode(p, K, decoded.data());
          panel_rows(F32{decoded.data()}, 0, xp, M, K, yp + p * NR, N, bp, nvalid);
          continue;
        }
      }
      panel_rows(kernel, p, xp, M, K, yp + p * NR, N, bp, nvalid);
    }
  });
  return y;
}

void check_panels(const at::Tensor& t, int64_t K, at::ScalarType dtype, int64_t inner, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.dim() == 3 && t.size(1) == K && t.size(2) == inner,
              name, " has the wrong dtype, layout or shape");
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t n) {
  check_panels(w, x.size(1), at::kFloat, NR, "w");
  return run(F32{w.data_ptr<float>()}, x, w.size(0), n, bias);
}

at::Tensor linear_q4_1(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, const at::Tensor& mn,
                       const c10::optional<at::Tensor>& bias, int64_t n) {
  const int64_t K = x.size(1);
  TORCH_CHECK(K % GROUP == 0, "q4_1 needs the input size to be a multiple of 32");
  check_panels(q, K, at::kByte, 16, "q");
  check_panels(d, K / GROUP, at::kHalf, NR, "d");
  check_panels(mn, K / GROUP, at::kHalf, NR, "mn");
  return run(Q41{q.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()),
                 reinterpret_cast<const uint16_t*>(mn.data_ptr<at::Half>())}, x, q.size(0), n, bias);
}

at::Tensor linear_q8_0(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d,
                       const c10::optional<at::Tensor>& bias, int64_t n) {
  const int64_t K = x.size(1);
  TORCH_CHECK(K % GROUP == 0, "q8_0 needs the input size to be a multiple of 32");
  check_panels(q, K, at::kChar, NR, "q");
  check_panels(d, K / GROUP, at::kHalf, NR, "d");
  return run(Q80{q.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>())}, x, q.size(0), n, bias);
}

}  // namespace

TORCH_LIBRARY(ts_panels, m) {
  m.def("linear_f32(Tensor x, Tensor w, Tensor? bias, int n) -> Tensor");
  m.def("linear_q4_1(Tensor x, Tensor q, Tensor d, Tensor mn, Tensor? bias, int n) -> Tensor");
  m.def("linear_q8_0(Tensor x, Tensor q, Tensor d, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(ts_panels, CPU, m) {
  m.impl("linear_f32", &linear_f32);
  m.impl("linear_q4_1", &linear_q4_1);
  m.impl("linear_q8_0", &linear_q8_0);
}
