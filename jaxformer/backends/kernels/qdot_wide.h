// Many rows against a transposed block layout (a tied embedding table, the logits of a
// serving step's slots), for qmatmul.cc (on qtypes.h's Problem): the rows of x in the
// lanes of a 512-bit vector, where the CPU has AVX-512 VNNI.
//
// qdot.h's IntRowDots holds 32 k of one row of x per vector and must add each vector's
// lanes up (RowSums) at every block: at 32 rows that horizontal work, not the products,
// bounds the logits. Here x is laid out once per call as (blocks, stream bytes / 4,
// rows padded to 16, 4): one 512-bit load holds 4 k of 16 rows, and the weights' 4
// matching bytes (unpacked from the nibbles in qdot.h's stream order) are broadcast to
// every lane, so each dpbusd adds 4 products to each of 16 rows' sums and no lane sum is
// ever needed. int8_block's signed weights enter as q + 128 (dpbusd's unsigned operand;
// AVX-512 has no vpsignb), less 128 times the block's integer sum of x. Per block and row
// the arithmetic is qdot.h's: the same exact integer sum s, x rounding and xsum (of x as
// rounded), y += (d dx) s + c xsum (c = m, -8 d for int4_sym, 0 for int8_block), in float32, in
// block order (so within float rounding of IntRowDots, not bit for bit: it adds the
// c xsum terms apart).

#ifndef JAXFORMER_KERNELS_QDOT_WIDE_H_
#define JAXFORMER_KERNELS_QDOT_WIDE_H_

#include <cstdint>
#include <vector>

#include "qtypes.h"

namespace jaxformer::qmatmul {

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
constexpr bool kWideDot = true;
#else
constexpr bool kWideDot = false;
#endif

constexpr int64_t WIDE_ROWS = 8;  // from this many rows of x on (8: measured faster than qdot.h)
constexpr int WG = 4;              // groups of 16 rows per pass over a row of W^T

// Whether Run takes this path: a transposed layout on the integer path, B rows.
inline bool UsesWideDot(const Problem& p) {
  return kWideDot && p.integer && p.transposed && p.B >= WIDE_ROWS;
}

// p.xw (blocks, bk / 4, bp, 4), p.xdw and p.xsw (blocks, bp) from p.xs, p.xd and p.xsum,
// and p.xqw (blocks, bp): the integer sums of p.xs per block (bp: B rounded up to 16;
// padding rows zero).
inline void WideX(Problem& p) {
  const int64_t bk = p.block, blocks = p.K / bk, bp = (p.B + 15) / 16 * 16;
  p.bp = bp;
  p.xw.assign(blocks * bk * bp, 0);
  p.xdw.assign(blocks * bp, 0.0f);
  p.xsw.assign(blocks * bp, 0.0f);
  p.xqw.assign(blocks * bp, 0);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t kb = 0; kb < blocks; ++kb) {
      const int8_t* xs = p.xs.data() + (b * blocks + kb) * bk;
      int8_t* out = p.xw.data() + kb * bk * bp + b * 4;
      int32_t sum = 0;
      for (int64_t s = 0; s < bk; ++s) {
        out[(s / 4) * bp * 4 + s % 4] = xs[s];
        sum += xs[s];
      }
      p.xqw[kb * bp + b] = sum;
      p.xdw[kb * bp + b] = p.xd[b * blocks + kb];
      if (!p.xsum.empty()) p.xsw[kb * bp + b] = p.xsum[b * blocks + kb];  // 4-bit only
    }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)

// y[16 g0 .. 16 (g0 + G), n] (rows below B) over row n of W^T.
template <int G, Fmt F>
void WideDots(const Problem& p, int64_t g0, int64_t n) {
  const int64_t K = p.K, bk = p.block, blocks = K / bk, bp = p.bp;
  const uint16_t* scale = static_cast<const uint16_t*>(p.scale) + n * blocks;
  constexpr bool kSigned = F == Fmt::kInt8Block;
  const uint8_t* q = static_cast<const uint8_t*>(p.q) + n * (kSigned ? K : K / 2);
  const __m128i m4 = _mm_set1_epi8(15);
  __m512 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
  alignas(32) int32_t w[8];  // 32 unpacked weights, 4 per int32, in stream order
  for (int64_t kb = 0; kb < blocks; ++kb) {
    __m512i s[G];
    for (int g = 0; g < G; ++g) s[g] = _mm512_setzero_si512();
    for (int64_t i = 0; i < bk; i += 32) {
      if constexpr (kSigned) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + kb * bk + i));
        _mm256_store_si256(reinterpret_cast<__m256i*>(w),
                           _mm256_xor_si256(v, _mm256_set1_epi8(-128)));  // q + 128
      } else {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (kb * bk + i) / 2));
        _mm256_store_si256(reinterpret_cast<__m256i*>(w),
                           _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m4),
                                            _mm_and_si128(b, m4)));
      }
      const int8_t* x = p.xw.data() + ((kb * bk + i) * bp + g0 * 16 * 4);
      for (int t = 0; t < 8; ++t) {
        const __m512i a = _mm512_set1_epi32(w[t]);
        for (int g = 0; g < G; ++g)
          s[g] = _mm512_dpbusd_epi32(
              s[g], a, _mm512_loadu_si512(x + (t * bp + g * 16) * 4));
      }
    }
    const float d = HalfToFloat(scale[kb]);
    const float c = F == Fmt::kInt4 ? HalfToFloat(p.offset[n * blocks + kb]) : -8.0f * d;
    const __m512 dv = _mm512_set1_ps(d), cv = _mm512_set1_ps(c);
    for (int g = 0; g < G; ++g) {
      const int64_t at = kb * bp + (g0 + g) * 16;
      if constexpr (kSigned)  // less 128 sum xq: the q + 128 above
        s[g] = _mm512_sub_epi32(s[g], _mm512_slli_epi32(_mm512_loadu_si512(p.xqw.data() + at), 7));
      acc[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[g]),
                               _mm512_mul_ps(dv, _mm512_loadu_ps(p.xdw.data() + at)), acc[g]);
      if constexpr (!kSigned) acc[g] = _mm512_fmadd_ps(cv, _mm512_loadu_ps(p.xsw.data() + at), acc[g]);
    }
  }
  alignas(64) float out[16];
  for (int g = 0; g < G; ++g) {
    _mm512_store_ps(out, acc[g]);
    const int64_t b0 = (g0 + g) * 16;
    for (int64_t r = 0; r < 16 && b0 + r < p.B; ++r) p.y[(b0 + r) * p.N + n] = out[r];
  }
}

// Task t: outputs t VT .. min(N, (t + 1) VT), every row of x, WG groups of 16 at a time.
template <Fmt F>
void WideRowsOf(const Problem& p, int64_t t) {
  const int64_t groups = p.bp / 16;
  for (int64_t n = t * VT; n < std::min(p.N, (t + 1) * VT); ++n)
    for (int64_t g0 = 0; g0 < groups; g0 += WG) {
      switch (std::min<int64_t>(WG, groups - g0)) {
        case 1: WideDots<1, F>(p, g0, n); break;
        case 2: WideDots<2, F>(p, g0, n); break;
        case 3: WideDots<3, F>(p, g0, n); break;
        default: WideDots<WG, F>(p, g0, n); break;
      }
    }
}

#endif  // AVX-512 VNNI

}  // namespace jaxformer::qmatmul

#endif  // JAXFORMER_KERNELS_QDOT_WIDE_H_
