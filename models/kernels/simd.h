// The vector operations the kernels use, at the width of the build (models/kernels/native.py builds
// one per instruction set and loads the one this CPU runs):
//   default      16 float lanes of AVX-512 (F, BW, VL, DQ); TS_VNNI adds AVX512-VNNI's vpdpbusd, TS_BF16
//                (with TS_VNNI) AVX512-BF16's vdpbf16ps (dot_bf16: the bfloat16 panels only)
//   TS_AVX2      8 float lanes of AVX2 with FMA and F16C, for CPUs without AVX-512 (AMD Zen 2/3, ...)
// Every operation is lane-wise or an exact reduction (max, integer sums) except reduce_add, so a
// kernel written on these computes the same bits per output at either width wherever it sums its
// floats lane by lane (the projections do; tests compare the builds).

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace ts {

#if defined(TS_AVX2)
#define TS_TARGET __attribute__((target("avx2,fma,f16c")))
constexpr int LANES = 8;
using vf = __m256;
using vi = __m256i;

TS_TARGET inline vf zero() { return _mm256_setzero_ps(); }
TS_TARGET inline vi zero_i() { return _mm256_setzero_si256(); }
TS_TARGET inline vf load(const float* p) { return _mm256_loadu_ps(p); }
TS_TARGET inline void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
TS_TARGET inline vi load_i(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
TS_TARGET inline vf set1(float x) { return _mm256_set1_ps(x); }
TS_TARGET inline vi set1_i32(int32_t x) { return _mm256_set1_epi32(x); }
TS_TARGET inline vi set1_i8(int8_t x) { return _mm256_set1_epi8(x); }
TS_TARGET inline vi set1_i16(int16_t x) { return _mm256_set1_epi16(x); }
TS_TARGET inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
TS_TARGET inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
TS_TARGET inline vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
TS_TARGET inline vf min(vf a, vf b) { return _mm256_min_ps(a, b); }
TS_TARGET inline vi slli_i32(vi a, int n) { return _mm256_slli_epi32(a, n); }
TS_TARGET inline vf as_float(vi a) { return _mm256_castsi256_ps(a); }  // the same bits
TS_TARGET inline vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
TS_TARGET inline vf copysign(vf mag, vf sign) {  // |mag| with sign's sign
  const __m256 bit = _mm256_set1_ps(-0.0f);
  return _mm256_or_ps(_mm256_andnot_ps(bit, mag), _mm256_and_ps(bit, sign));
}
TS_TARGET inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
TS_TARGET inline vf fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
TS_TARGET inline vf abs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
TS_TARGET inline vi add_i32(vi a, vi b) { return _mm256_add_epi32(a, b); }
TS_TARGET inline vi add_i16(vi a, vi b) { return _mm256_add_epi16(a, b); }
TS_TARGET inline vi sub_i32(vi a, vi b) { return _mm256_sub_epi32(a, b); }
TS_TARGET inline vi and_i(vi a, vi b) { return _mm256_and_si256(a, b); }
TS_TARGET inline vi srli_i16(vi a, int n) { return _mm256_srli_epi16(a, n); }
TS_TARGET inline vi slli_i16(vi a, int n) { return _mm256_slli_epi16(a, n); }
TS_TARGET inline vi srai_i16(vi a, int n) { return _mm256_srai_epi16(a, n); }
TS_TARGET inline vi madd_i16(vi a, vi b) { return _mm256_madd_epi16(a, b); }
TS_TARGET inline vi maddubs_i16(vi u, vi s) { return _mm256_maddubs_epi16(u, s); }
TS_TARGET inline vf to_float(vi a) { return _mm256_cvtepi32_ps(a); }
// lane i: x where a >= b, else y (ordered: a NaN lane takes y)
TS_TARGET inline vf select_ge(vf a, vf b, vf x, vf y) { return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_GE_OQ)); }
// bit i set where lane i of a > b (ordered: a NaN lane is never greater)
TS_TARGET inline uint32_t greater(vf a, vf b) { return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ))); }
// bit i set where lane i of a is NaN
TS_TARGET inline uint32_t nan_lanes(vf a) { return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q))); }
// round to nearest, ties to even (the default rounding mode, which nothing here changes)
TS_TARGET inline vi round_i32(vf a) { return _mm256_cvtps_epi32(a); }
// LANES float16 -> float32
TS_TARGET inline vf halves(const uint8_t* h) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))); }
// LANES bfloat16 values (their bits) as float32, exactly
TS_TARGET inline vf bf16s(const uint16_t* h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))), 16));
}
TS_TARGET inline float reduce_max(vf a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
TS_TARGET inline float reduce_add(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
TS_TARGET inline int32_t reduce_add_i32(vi a) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}
// out[t] = sum of v[t]'s lanes, for LANES vectors at once (a tree of horizontal adds)
TS_TARGET inline vf sum_lanes(const vf (&v)[LANES]) {
  const vf a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // v0..v3 | v0..v3
  const vf b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));  // v4..v7 | v4..v7
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
// the first n (< LANES) lanes of v to p
TS_TARGET inline void store_first(float* p, vf v, int64_t n) {
  alignas(32) float buf[LANES];
  _mm256_store_ps(buf, v);
  std::memcpy(p, buf, n * sizeof(float));
}
// 32 int32 (in [-127, 127] after rounding; saturated otherwise) in 4 vectors -> 32 int8 in order
TS_TARGET inline void narrow_i8(const vi (&v)[32 / LANES], int8_t* out) {
  const vi words = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  // per 128-bit lane: 4 of v0, v1, v2, v3 -> each vector's 8 back together
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#else
#if defined(TS_BF16)
#define TS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512vnni,avx512bf16")))
#elif defined(TS_VNNI)
#define TS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512vnni")))
#else
#define TS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#endif
constexpr int LANES = 16;
using vf = __m512;
using vi = __m512i;

TS_TARGET inline vf zero() { return _mm512_setzero_ps(); }
TS_TARGET inline vi zero_i() { return _mm512_setzero_si512(); }
TS_TARGET inline vf load(const float* p) { return _mm512_loadu_ps(p); }
TS_TARGET inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
TS_TARGET inline vi load_i(const void* p) { return _mm512_loadu_si512(p); }
TS_TARGET inline vf set1(float x) { return _mm512_set1_ps(x); }
TS_TARGET inline vi set1_i32(int32_t x) { return _mm512_set1_epi32(x); }
TS_TARGET inline vi set1_i8(int8_t x) { return _mm512_set1_epi8(x); }
TS_TARGET inline vi set1_i16(int16_t x) { return _mm512_set1_epi16(x); }
TS_TARGET inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
TS_TARGET inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
TS_TARGET inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
TS_TARGET inline vf min(vf a, vf b) { return _mm512_min_ps(a, b); }
TS_TARGET inline vi slli_i32(vi a, int n) { return _mm512_slli_epi32(a, n); }
TS_TARGET inline vf as_float(vi a) { return _mm512_castsi512_ps(a); }  // the same bits
TS_TARGET inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
TS_TARGET inline vf copysign(vf mag, vf sign) {  // |mag| with sign's sign
  const __m512i bit = _mm512_set1_epi32(INT32_MIN);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_andnot_si512(bit, _mm512_castps_si512(mag)),
                                             _mm512_and_si512(bit, _mm512_castps_si512(sign))));
}
TS_TARGET inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
TS_TARGET inline vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
TS_TARGET inline vf abs(vf a) { return _mm512_abs_ps(a); }
TS_TARGET inline vi add_i32(vi a, vi b) { return _mm512_add_epi32(a, b); }
TS_TARGET inline vi add_i16(vi a, vi b) { return _mm512_add_epi16(a, b); }
TS_TARGET inline vi sub_i32(vi a, vi b) { return _mm512_sub_epi32(a, b); }
TS_TARGET inline vi and_i(vi a, vi b) { return _mm512_and_si512(a, b); }
TS_TARGET inline vi srli_i16(vi a, int n) { return _mm512_srli_epi16(a, n); }
TS_TARGET inline vi slli_i16(vi a, int n) { return _mm512_slli_epi16(a, n); }
TS_TARGET inline vi srai_i16(vi a, int n) { return _mm512_srai_epi16(a, n); }
TS_TARGET inline vi madd_i16(vi a, vi b) { return _mm512_madd_epi16(a, b); }
TS_TARGET inline vi maddubs_i16(vi u, vi s) { return _mm512_maddubs_epi16(u, s); }
TS_TARGET inline vf to_float(vi a) { return _mm512_cvtepi32_ps(a); }
TS_TARGET inline vf select_ge(vf a, vf b, vf x, vf y) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_GE_OQ), y, x); }
TS_TARGET inline uint32_t greater(vf a, vf b) { return static_cast<uint32_t>(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ)); }
TS_TARGET inline uint32_t nan_lanes(vf a) { return static_cast<uint32_t>(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q)); }
TS_TARGET inline vi round_i32(vf a) { return _mm512_cvt_roundps_epi32(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
TS_TARGET inline vf halves(const uint8_t* h) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h))); }
// LANES bfloat16 values (their bits) as float32, exactly
TS_TARGET inline vf bf16s(const uint16_t* h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h))), 16));
}
TS_TARGET inline float reduce_max(vf a) { return _mm512_reduce_max_ps(a); }
TS_TARGET inline float reduce_add(vf a) { return _mm512_reduce_add_ps(a); }
TS_TARGET inline int32_t reduce_add_i32(vi a) { return _mm512_reduce_add_epi32(a); }
// out[t] = sum of v[t]'s lanes, for 16 vectors at once: a tree of lane shuffles (4 levels, 15 adds)
TS_TARGET inline vf sum_lanes(const vf (&v)[LANES]) {
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
TS_TARGET inline void store_first(float* p, vf v, int64_t n) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), v);
}
TS_TARGET inline void narrow_i8(const vi (&v)[32 / LANES], int8_t* out) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(v[0]));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtsepi32_epi8(v[1]));
}
#endif

// LANES values stored as float32, as bfloat16 (their bits) or as int8, as float32, exactly; and one such value
TS_TARGET inline vf widen(const float* p) { return load(p); }
TS_TARGET inline vf widen(const uint16_t* p) { return bf16s(p); }
#if defined(TS_AVX2)
TS_TARGET inline vf widen(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#else
TS_TARGET inline vf widen(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif
inline float widen1(float v) { return v; }
inline float widen1(int8_t v) { return static_cast<float>(v); }
inline float widen1(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(TS_BF16)
// acc (float32 lanes j) += x[2 j] w[2 j] + x[2 j + 1] w[2 j + 1]: x and w hold bfloat16 pairs (vdpbf16ps;
// the products exact, its own rounding of the sums, the same for every lane and call)
TS_TARGET inline vf dot_bf16(vf acc, vi x, vi w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
#endif

// acc += sum over i < 4 of u[4 j + i] * s[4 j + i] in each int32 lane j (unsigned x signed bytes)
TS_TARGET inline vi dot4(vi acc, vi u, vi s) {
#if defined(TS_VNNI) && !defined(TS_AVX2)
  return _mm512_dpbusd_epi32(acc, u, s);
#else  // even and odd bytes widened to int16, multiplied and added in pairs to int32: exact for any u8
  const vi even = madd_i16(and_i(u, set1_i16(0xFF)), srai_i16(slli_i16(s, 8), 8));
  const vi odd = madd_i16(srli_i16(u, 8), srai_i16(s, 8));
  return add_i32(acc, add_i32(even, odd));
#endif
}

// dot4 for unsigned bytes below 16 (4-bit codes) over the 8 steps of a group, in two parts:
// nibbles_step adds a step's products into a partial sum, nibbles_sum turns the partials into dot4's
// int32 sums. Without VNNI the partials are pmaddubsw's int16 pair sums: a pair is at most
// 2 * 15 * 128 = 3840 in magnitude, so a group's 8 steps add up in int16 (at most 30720) and widen
// to int32 once per group: the same integers as dot4, in two instructions a step instead of five.
TS_TARGET inline vi nibbles_step(vi partial, vi u, vi s) {
#if defined(TS_VNNI) && !defined(TS_AVX2)
  return _mm512_dpbusd_epi32(partial, u, s);
#else
  return add_i16(partial, maddubs_i16(u, s));
#endif
}
TS_TARGET inline vi nibbles_sum(vi partial) {
#if defined(TS_VNNI) && !defined(TS_AVX2)
  return partial;
#else
  return madd_i16(partial, set1_i16(1));
#endif
}

// exp(x) lane by lane, Cephes' single-precision polynomial (within ~2 ulp of the exact value; torch's
// vectorised exp is within 1): x clamped to [-87.3, 88.4] (so exp(-inf), a masked score, is ~1e-38,
// not 0: nothing here sums fewer than one whole term).
TS_TARGET inline vf exp(vf x) {
  x = min(max(x, set1(-87.33654f)), set1(88.3762626647949f));
  const vf n = to_float(round_i32(mul(x, set1(1.44269504088896341f))));  // round(x / ln 2)
  x = fnmadd(n, set1(0.693359375f), x);
  x = fnmadd(n, set1(-2.12194440e-4f), x);  // x - n ln 2, in two parts
  vf y = set1(1.9875691500e-4f);
  y = fmadd(y, x, set1(1.3981999507e-3f));
  y = fmadd(y, x, set1(8.3334519073e-3f));
  y = fmadd(y, x, set1(4.1665795894e-2f));
  y = fmadd(y, x, set1(1.6666665459e-1f));
  y = fmadd(y, x, set1(5.0000001201e-1f));
  y = fmadd(y, mul(x, x), add(x, set1(1.0f)));
  const vi pow2 = slli_i32(add_i32(round_i32(n), set1_i32(127)), 23);  // 2^n as float bits
  return mul(y, as_float(pow2));
}

// erf(x) lane by lane (Abramowitz and Stegun 7.1.26: within 1.5e-7 of the exact value)
TS_TARGET inline vf erf(vf x) {
  const vf a = abs(x);
  const vf t = div(set1(1.0f), fmadd(set1(0.3275911f), a, set1(1.0f)));
  vf p = set1(1.061405429f);
  p = fmadd(p, t, set1(-1.453152027f));
  p = fmadd(p, t, set1(1.421413741f));
  p = fmadd(p, t, set1(-0.284496736f));
  p = fmadd(p, t, set1(0.254829592f));
  const vf e = fnmadd(mul(p, t), exp(mul(mul(a, a), set1(-1.0f))), set1(1.0f));  // 1 - p t exp(-x^2)
  return copysign(e, x);
}

}  // namespace ts
