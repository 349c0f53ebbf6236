// Integer dot products, llama.cpp's scheme, for qmatmul.cc (on qtypes.h's
// Problem): each row of x is quantized per weight block to int8,
//
//   xq[k] = round(x[k] 127 / amax)  (ties to even),  dx = amax / 127   (amax = max |x| of the block)
//
// (a block holding a NaN or an infinity gets dx = NaN, so the output is NaN as on the
// float path), then per block and output column the integer sum s = sum_k q[k, n] xq[k]
// is exact (4 products at a time into int32: VNNI's dpbusd, or maddubs + madd where the
// CPU lacks it: every pair fits an int16) and y += d (dx s) (+ m xsum, or - 8 d xsum for
// int4_sym), in float32; xsum = dx sum_k xq, the block sum of x as rounded (llama.cpp's
// Q8_1 `s`). So y is exactly the dequantized W times the rounded x, and the only change
// from the float path is x's rounding to 8 bits per block: |x - dx xq| <= dx / 2, its
// error weighted by W itself. (With the float sum of x the offset term would not see
// the rounding, and the errors would be weighted by d q, 0..15 d, never centred: on
// SmolLM2 Q4_1 logits 2x as far from the float path's, RoundedBlockSums.)
//
// x is quantized once per call, into the order in which the layout's weights stream
// (Problem::xs, `XStream`), so both layouts and every format share one inner loop:
//   N last (K/2 or K, N): 32 columns per pass, four k per column in each int32 lane
//     (4-bit: packed rows i, i + 1, low and high nibbles: k = i, i + bk/2, i + 1,
//     i + 1 + bk/2; int8_block: rows k .. k + 3), x's 4 matching bytes broadcast; every
//     row of x (up to 8) against each weight vector while it is in registers or L1.
//     Any even block (int8_block: any block), padded with zeros to 4 k.
//   transposed (N, K): one row per output, 32 k per vector (4-bit: a 16-byte chunk's
//     low then high nibbles); block % 32 == 0.
// int8 weights enter as |q| against x carrying q's sign (ggml's Q8_0 dot): the unsigned
// operand stays <= 128.

#ifndef JAXFORMER_KERNELS_QDOT_H_
#define JAXFORMER_KERNELS_QDOT_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "qtypes.h"

namespace jaxformer::qmatmul {

#if defined(__AVX2__)
constexpr bool kIntegerDot = true;
#else
constexpr bool kIntegerDot = false;
#endif

constexpr int IR = 8;  // rows of x per pass over the weights (integer paths)

inline bool UsesIntegerDot(Fmt fmt, bool transposed, int64_t block) {
  if (!kIntegerDot || fmt == Fmt::kInt8) return false;
  return !transposed || block % 32 == 0;
}

// Bytes of the x stream per block: transposed, bk; N last, bk rounded up to 4 k.
inline int64_t StreamBytes(const Problem& p) {
  return p.transposed ? p.block : (p.block + 3) / 4 * 4;
}

// The position in the block's x stream of the block's k = i (see the header).
inline int64_t StreamAt(const Problem& p, int64_t i) {
  const int64_t bk = p.block, half = bk / 2;
  if (p.fmt == Fmt::kInt8Block) return i;  // rows k in order (transposed or N last)
  const bool hi = i >= half;
  const int64_t r = hi ? i - half : i;     // packed row / byte r, its high nibble or not
  if (p.transposed) return r / 16 * 32 + (hi ? 16 : 0) + r % 16;
  return r / 2 * 4 + (hi ? 1 : 0) + (r % 2) * 2;
}

#if defined(__AVX2__)
// x[0 .. bk) (bk % 8 == 0) rounded as QuantizeX states into q[0 .. bk), in k order, 8
// lanes at a time (cvtps rounds to nearest, ties to even, as nearbyint does): its amax,
// or NaN where x holds a NaN or an infinity (q then unwritten).
inline float RoundBlock(const float* x, int64_t bk, int8_t* q) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 big = _mm256_set1_ps(std::numeric_limits<float>::max());
  __m256 m = _mm256_setzero_ps(), ok = _mm256_cmp_ps(m, m, _CMP_EQ_OQ);
  for (int64_t i = 0; i < bk; i += 8) {
    const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
    m = _mm256_max_ps(m, a);
    ok = _mm256_and_ps(ok, _mm256_cmp_ps(a, big, _CMP_LE_OQ));  // false for NaN and inf
  }
  if (_mm256_movemask_ps(ok) != 0xff) return std::numeric_limits<float>::quiet_NaN();
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  for (int64_t i = 0; i < bk; i += 8) {
    const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(w, w));
  }
  return amax;
}
#endif

// p.xs (B, K / block, StreamBytes) and p.xd (B, K / block) from p.x: quantized once;
// transposed also p.xdt (B / IR rounded up, K / block, IR): xd by row group.
inline void QuantizeX(Problem& p) {
  const int64_t K = p.K, bk = p.block, blocks = K / bk, sb = StreamBytes(p);
  p.xs.assign(p.B * blocks * sb, 0);
  p.xd.assign(p.B * blocks, 0.0f);
  std::vector<int64_t> at(bk);
  bool in_order = true;  // int8_block, and the transposed 4-bit layouts of 32-blocks
  for (int64_t i = 0; i < bk; ++i) {
    at[i] = StreamAt(p, i);
    in_order = in_order && at[i] == i;
  }
  std::vector<int8_t> q(bk);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t kb = 0; kb < blocks; ++kb) {
      const float* x = p.x + b * K + kb * bk;
#if defined(__AVX2__)
      if (bk % 8 == 0) {
        int8_t* xs = p.xs.data() + (b * blocks + kb) * sb;
        const float amax = RoundBlock(x, bk, in_order ? xs : q.data());
        if (!in_order && amax == amax)
          for (int64_t i = 0; i < bk; ++i) xs[at[i]] = q[i];
        p.xd[b * blocks + kb] = amax / 127.0f;  // NaN stays NaN
        continue;
      }
#endif
      float amax = 0.0f;
      bool finite = true;
      for (int64_t i = 0; i < bk; ++i) {
        finite = finite && std::isfinite(x[i]);
        amax = std::max(amax, std::fabs(x[i]));
      }
      if (!finite) {
        p.xd[b * blocks + kb] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* xs = p.xs.data() + (b * blocks + kb) * sb;
      for (int64_t i = 0; i < bk; ++i)
        xs[at[i]] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
      p.xd[b * blocks + kb] = amax / 127.0f;
    }
  if (!p.transposed) return;
  p.xdt.assign((p.B + IR - 1) / IR * blocks * IR, 0.0f);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t kb = 0; kb < blocks; ++kb)
      p.xdt[(b / IR * blocks + kb) * IR + b % IR] = p.xd[b * blocks + kb];
}

// The integer path's p.xsum (4-bit layouts): dx sum_k xq per row and block (header), from
// p.xs and p.xd (NaN where x's block is not finite).
inline void RoundedBlockSums(Problem& p) {
  const int64_t blocks = p.K / p.block, sb = StreamBytes(p);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t kb = 0; kb < blocks; ++kb) {
      const int8_t* xs = p.xs.data() + (b * blocks + kb) * sb;
      int32_t sum = 0;
      for (int64_t i = 0; i < sb; ++i) sum += xs[i];  // stream padding is zero
      p.xsum[b * blocks + kb] = p.xd[b * blocks + kb] * static_cast<float>(sum);
    }
}

// Columns per task of the N-last integer path, at most (qmatmul.cc's Run picks the width:
// N split evenly over the threads). A task reads block kb's rows w bytes at a time, so
// the hardware prefetchers follow sequential streams (64-column tiles going down the rows
// read one cache line per row, a new page every few rows: latency-bound).
constexpr int64_t IW = 512;

#if defined(__AVX2__)

// acc + the 4-product sums of unsigned bytes u and signed bytes s, per int32 lane.
inline __m256i DotAdd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                 _mm256_set1_epi16(1)));
#endif
}

// The 4 weight vectors of step t of a block, N last, 32 columns from `q` (the block's
// first row, column n0 + j): lane l of vector v holds column 4 v + l (l < 4) or
// 16 + 4 v + l - 4 (l >= 4), its 4 bytes the 4 k of the step in stream order.
// `rows`: the block's stored rows (bk/2 packed, or bk).
template <Fmt F>
inline void Quads(const uint8_t* q, int64_t N, int64_t t, int64_t rows, __m256i (&u)[4]) {
  auto row = [&](int64_t i) {
    return i < rows ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * N))
                    : _mm256_setzero_si256();
  };
  __m256i a, b, c, d;
  if constexpr (F == Fmt::kInt8Block) {
    a = row(4 * t), b = row(4 * t + 1), c = row(4 * t + 2), d = row(4 * t + 3);
  } else {  // packed rows 2t, 2t + 1: (low, high) nibbles of each
    const __m256i m = _mm256_set1_epi8(15), r0 = row(2 * t), r1 = row(2 * t + 1);
    a = _mm256_and_si256(r0, m), b = _mm256_and_si256(_mm256_srli_epi16(r0, 4), m);
    c = _mm256_and_si256(r1, m), d = _mm256_and_si256(_mm256_srli_epi16(r1, 4), m);
  }
  const __m256i abl = _mm256_unpacklo_epi8(a, b), abh = _mm256_unpackhi_epi8(a, b);
  const __m256i cdl = _mm256_unpacklo_epi8(c, d), cdh = _mm256_unpackhi_epi8(c, d);
  u[0] = _mm256_unpacklo_epi16(abl, cdl), u[1] = _mm256_unpackhi_epi16(abl, cdl);
  u[2] = _mm256_unpacklo_epi16(abh, cdh), u[3] = _mm256_unpackhi_epi16(abh, cdh);
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// Quads for 64 columns of a 4-bit layout in 512-bit vectors: quarter L of vector v holds
// columns 16 L + 4 v .. 16 L + 4 v + 3 (the unpacks work within each 128-bit quarter).
inline void Quads512(const uint8_t* q, int64_t N, int64_t t, int64_t rows, __m512i (&u)[4]) {
  auto row = [&](int64_t i) {
    return i < rows ? _mm512_loadu_si512(q + i * N) : _mm512_setzero_si512();
  };
  const __m512i m = _mm512_set1_epi8(15), r0 = row(2 * t), r1 = row(2 * t + 1);
  const __m512i a = _mm512_and_si512(r0, m), b = _mm512_and_si512(_mm512_srli_epi16(r0, 4), m);
  const __m512i c = _mm512_and_si512(r1, m), d = _mm512_and_si512(_mm512_srli_epi16(r1, 4), m);
  const __m512i abl = _mm512_unpacklo_epi8(a, b), abh = _mm512_unpackhi_epi8(a, b);
  const __m512i cdl = _mm512_unpacklo_epi8(c, d), cdh = _mm512_unpackhi_epi8(c, d);
  u[0] = _mm512_unpacklo_epi16(abl, cdl), u[1] = _mm512_unpackhi_epi16(abl, cdl);
  u[2] = _mm512_unpacklo_epi16(abh, cdh), u[3] = _mm512_unpackhi_epi16(abh, cdh);
}

// BlockSums' 64-column passes for the 4-bit layouts (from column j on; j advanced past them).
template <int R>
void BlockSums512(const uint8_t* q, const int8_t* const (&xs)[R], int64_t N, int64_t rows,
                  int64_t steps, int64_t w, int64_t& j, int32_t (*isum)[IW]) {
  for (; j + 64 <= w; j += 64) {
    __m512i s[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) s[r][c] = _mm512_setzero_si512();
    for (int64_t t = 0; t < steps; ++t) {
      __m512i u[4];
      Quads512(q + j, N, t, rows, u);
      for (int64_t e = 0; e < 2; ++e)  // the next block's rows, as BlockSums
        _mm_prefetch(reinterpret_cast<const char*>(q + j + (rows + 2 * t + e) * N), _MM_HINT_T0);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xs[r] + 4 * t, 4);
        const __m512i xv = _mm512_set1_epi32(four);
        for (int c = 0; c < 4; ++c) s[r][c] = _mm512_dpbusd_epi32(s[r][c], u[c], xv);
      }
    }
    for (int r = 0; r < R; ++r) {  // lanes back to column order: a 4 x 4 of quarters
      const __m512i a0 = _mm512_shuffle_i32x4(s[r][0], s[r][1], 0x44);  // 0.0 0.1 1.0 1.1
      const __m512i a1 = _mm512_shuffle_i32x4(s[r][2], s[r][3], 0x44);  // 2.0 2.1 3.0 3.1
      const __m512i a2 = _mm512_shuffle_i32x4(s[r][0], s[r][1], 0xee);  // 0.2 0.3 1.2 1.3
      const __m512i a3 = _mm512_shuffle_i32x4(s[r][2], s[r][3], 0xee);  // 2.2 2.3 3.2 3.3
      int32_t* out = isum[r] + j;  // quarter L of vector v -> out[16 L + 4 v]
      _mm512_storeu_si512(out, _mm512_shuffle_i32x4(a0, a1, 0x88));       // 0.0 1.0 2.0 3.0
      _mm512_storeu_si512(out + 16, _mm512_shuffle_i32x4(a0, a1, 0xdd));  // 0.1 1.1 2.1 3.1
      _mm512_storeu_si512(out + 32, _mm512_shuffle_i32x4(a2, a3, 0x88));
      _mm512_storeu_si512(out + 48, _mm512_shuffle_i32x4(a2, a3, 0xdd));
    }
  }
}
#endif

// isum[r][j] = the integer sum of block kb, column n0 + j (j < w), with x row b0 + r, for
// R <= 4 rows (N last).
template <int R, Fmt F>
void BlockSums(const Problem& p, int64_t b0, int64_t kb, int64_t n0, int64_t w,
               int32_t (*isum)[IW]) {
  constexpr bool kSigned = F == Fmt::kInt8Block;
  const int64_t N = p.N, bk = p.block, blocks = p.K / bk, sb = StreamBytes(p);
  constexpr int64_t kPer = kSigned ? 4 : 2;  // stored rows per step
  const int64_t rows = kSigned ? bk : bk / 2, steps = sb / 4;
  const uint8_t* q = static_cast<const uint8_t*>(p.q) + kb * rows * N + n0;
  const int8_t* xs[R];
  for (int r = 0; r < R; ++r) xs[r] = p.xs.data() + ((b0 + r) * blocks + kb) * sb;
  int64_t j = 0;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  if constexpr (!kSigned) BlockSums512<R>(q, xs, N, rows, steps, w, j, isum);
#endif
  for (; j + 32 <= w; j += 32) {
    __m256i s[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) s[r][c] = _mm256_setzero_si256();
    for (int64_t t = 0; t < steps; ++t) {
      __m256i u[4];
      Quads<F>(q + j, N, t, rows, u);
      // the next block's rows, these columns: ahead of the prefetchers' page-bound streams
      for (int64_t e = 0; e < kPer; ++e)
        _mm_prefetch(reinterpret_cast<const char*>(q + j + (rows + kPer * t + e) * N),
                     _MM_HINT_T0);
      __m256i a[4];
      for (int c = 0; c < 4; ++c) a[c] = kSigned ? _mm256_sign_epi8(u[c], u[c]) : u[c];
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xs[r] + 4 * t, 4);
        const __m256i xv = _mm256_set1_epi32(four);
        for (int c = 0; c < 4; ++c)
          s[r][c] = DotAdd(s[r][c], a[c], kSigned ? _mm256_sign_epi8(xv, u[c]) : xv);
      }
    }
    for (int r = 0; r < R; ++r) {  // lanes back to column order
      int32_t* out = isum[r] + j;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                          _mm256_permute2x128_si256(s[r][0], s[r][1], 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8),
                          _mm256_permute2x128_si256(s[r][2], s[r][3], 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16),
                          _mm256_permute2x128_si256(s[r][0], s[r][1], 0x31));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 24),
                          _mm256_permute2x128_si256(s[r][2], s[r][3], 0x31));
    }
  }
  for (; j < w; ++j)  // the ragged end, one column at a time
    for (int r = 0; r < R; ++r) {
      int32_t sum = 0;
      for (int64_t i = 0; i < bk; ++i) {
        const int64_t at = StreamAt(p, i);
        int32_t wq;
        if constexpr (kSigned) {
          wq = static_cast<const int8_t*>(p.q)[(kb * bk + i) * N + n0 + j];
        } else {
          const uint8_t byte = q[(i % (bk / 2)) * N + j];
          wq = i < bk / 2 ? byte & 15 : byte >> 4;
        }
        sum += wq * xs[r][at];
      }
      isum[r][j] = sum;
    }
}

// The R <= IR rows b0 .. b0 + R of y, columns n0 .. n0 + w (N last, integer sums): each
// block's weights are read from memory once for all R rows.
template <int R, Fmt F>
void IntTile(const Problem& p, int64_t b0, int64_t n0, int64_t w) {
  const int64_t N = p.N, blocks = p.K / p.block;
  const uint16_t* scale = static_cast<const uint16_t*>(p.scale) + n0;
  alignas(32) float acc[R][IW] = {};
  alignas(32) int32_t isum[R][IW];
  alignas(32) float d[IW], m[IW];
  for (int64_t kb = 0; kb < blocks; ++kb) {
    // the next block's scales (and offsets): a stream of their own, w halves a row, that
    // the prefetchers do not follow in time (without this, the B = 1 epilogue waited on them)
    for (int64_t j = 0; j < w; j += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(scale + (kb + 1) * N + j), _MM_HINT_T0);
      if constexpr (F == Fmt::kInt4)
        _mm_prefetch(reinterpret_cast<const char*>(p.offset + n0 + (kb + 1) * N + j), _MM_HINT_T0);
    }
    BlockSums<(R < 4 ? R : 4), F>(p, b0, kb, n0, w, isum);
    if constexpr (R > 4) BlockSums<R - 4, F>(p, b0 + 4, kb, n0, w, isum + 4);
    HalvesToFloats(scale + kb * N, d, w);
    if constexpr (F == Fmt::kInt4) HalvesToFloats(p.offset + n0 + kb * N, m, w);
    if constexpr (F == Fmt::kInt4Sym)
      for (int64_t j = 0; j < w; ++j) m[j] = -8.0f * d[j];
    for (int r = 0; r < R; ++r) {
      const float dx = p.xd[(b0 + r) * blocks + kb];
      if constexpr (F == Fmt::kInt8Block) {
        for (int64_t j = 0; j < w; ++j) acc[r][j] += d[j] * (dx * static_cast<float>(isum[r][j]));
      } else {
        const float xs = p.xsum[(b0 + r) * blocks + kb];
        for (int64_t j = 0; j < w; ++j)
          acc[r][j] += d[j] * (dx * static_cast<float>(isum[r][j])) + m[j] * xs;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < w; ++j) p.y[(b0 + r) * N + n0 + j] = acc[r][j];
}

template <Fmt F>
void IntTileRows(const Problem& p, int64_t b0, int64_t rows, int64_t n0, int64_t w) {
  switch (rows) {
    case 1: return IntTile<1, F>(p, b0, n0, w);
    case 2: return IntTile<2, F>(p, b0, n0, w);
    case 3: return IntTile<3, F>(p, b0, n0, w);
    case 4: return IntTile<4, F>(p, b0, n0, w);
    case 5: return IntTile<5, F>(p, b0, n0, w);
    case 6: return IntTile<6, F>(p, b0, n0, w);
    case 7: return IntTile<7, F>(p, b0, n0, w);
    default: return IntTile<IR, F>(p, b0, n0, w);
  }
}

// [sum of s[0]'s lanes, ..., sum of s[R - 1]'s, 0, ...] (R <= 8).
template <int R>
inline __m256i RowSums(const __m256i (&s)[R]) {
  __m256i v[8];
  for (int r = 0; r < 8; ++r) v[r] = r < R ? s[r] : _mm256_setzero_si256();
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  // a: rows 0-3 over lanes 0-3 | rows 0-3 over lanes 4-7; b: rows 4-7 likewise
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                          _mm256_permute2x128_si256(a, b, 0x31));
}

// Transposed layout, integer sums: y[b0 .. b0 + R, n] over row n of W^T, R <= IR. From 4
// rows on, the rows' block sums share one vector (RowSums), scaled together by d dx.
template <int R, Fmt F>
void IntRowDots(const Problem& p, int64_t b0, int64_t n) {
  constexpr bool kSigned = F == Fmt::kInt8Block, kShared = R >= 4;
  const int64_t K = p.K, bk = p.block, blocks = K / bk;
  const uint16_t* scale = static_cast<const uint16_t*>(p.scale) + n * blocks;
  const uint8_t* q = static_cast<const uint8_t*>(p.q) + n * (kSigned ? K : K / 2);
  const int8_t* xs = p.xs.data() + b0 * K;  // stream bytes = bk per block: K per row
  const __m128i m4 = _mm_set1_epi8(15);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < blocks; ++kb) {
    __m256i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
    for (int64_t i = 0; i < bk; i += 32) {
      __m256i u;
      if constexpr (kSigned) {
        u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + kb * bk + i));
      } else {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (kb * bk + i) / 2));
        u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m4), _mm_and_si128(b, m4));
      }
      const __m256i a = kSigned ? _mm256_sign_epi8(u, u) : u;
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(xs + r * K + kb * bk + i));
        s[r] = DotAdd(s[r], a, kSigned ? _mm256_sign_epi8(xv, u) : xv);
      }
    }
    const float d = HalfToFloat(scale[kb]);
    if constexpr (kShared) {  // lane r of one vector: row r's block sum, scaled at once
      acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(RowSums<R>(s)),
                               _mm256_mul_ps(_mm256_set1_ps(d),
                                             _mm256_loadu_ps(p.xdt.data() + (b0 / IR * blocks + kb) * IR)),
                               acc[0]);
    } else {
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]),
                                 _mm256_set1_ps(d * p.xd[(b0 + r) * blocks + kb]), acc[r]);
    }
  }
  float extra[R] = {};
  if constexpr (F != Fmt::kInt8Block) {  // sum over blocks of c x sum: c = m, or -8 d
    const uint16_t* c = F == Fmt::kInt4 ? p.offset + n * blocks : scale;
    const float k = F == Fmt::kInt4 ? 1.0f : -8.0f;
    __m256 e[R];  // 8 blocks at a time: a scalar chain would wait on each add's latency
    for (int r = 0; r < R; ++r) e[r] = _mm256_setzero_ps();
    int64_t kb = 0;
    for (; kb + 8 <= blocks; kb += 8) {
      const __m256 cv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + kb)));
      for (int r = 0; r < R; ++r)
        e[r] = _mm256_fmadd_ps(cv, _mm256_loadu_ps(p.xsum.data() + (b0 + r) * blocks + kb), e[r]);
    }
    for (int r = 0; r < R; ++r) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, e[r]);
      for (int l = 0; l < 8; ++l) extra[r] += lanes[l];
    }
    for (; kb < blocks; ++kb) {
      const float ck = HalfToFloat(c[kb]);
      for (int r = 0; r < R; ++r) extra[r] += ck * p.xsum[(b0 + r) * blocks + kb];
    }
    for (int r = 0; r < R; ++r) extra[r] *= k;
  }
  alignas(32) float lanes[kShared ? 1 : R][8];
  for (int r = 0; r < (kShared ? 1 : R); ++r)
    _mm256_store_ps(lanes[r], acc[r]);
  for (int r = 0; r < R; ++r) {
    float sum = lanes[0][r];
    if constexpr (!kShared) {
      sum = 0.0f;
      for (int l = 0; l < 8; ++l) sum += lanes[r][l];
    }
    p.y[(b0 + r) * p.N + n] = sum + extra[r];
  }
}

template <Fmt F>
void IntRowsOf(const Problem& p, int64_t t) {
  for (int64_t n = t * VT; n < std::min(p.N, (t + 1) * VT); ++n)
    for (int64_t b0 = 0; b0 < p.B; b0 += IR) {
      switch (std::min<int64_t>(IR, p.B - b0)) {
        case 1: IntRowDots<1, F>(p, b0, n); break;
        case 2: IntRowDots<2, F>(p, b0, n); break;
        case 3: IntRowDots<3, F>(p, b0, n); break;
        case 4: IntRowDots<4, F>(p, b0, n); break;
        case 5: IntRowDots<5, F>(p, b0, n); break;
        case 6: IntRowDots<6, F>(p, b0, n); break;
        case 7: IntRowDots<7, F>(p, b0, n); break;
        default: IntRowDots<IR, F>(p, b0, n); break;
      }
    }
}

#endif  // __AVX2__

}  // namespace jaxformer::qmatmul

#endif  // JAXFORMER_KERNELS_QDOT_H_
