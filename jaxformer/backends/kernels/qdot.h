// Integer dot products, llama.cpp's scheme, for qmatmul.cc (included inside its anonymous
// namespace, after Problem): each row of x is quantized per weight block to int8,
//
//   xq[k] = round(x[k] 127 / amax)  (ties to even),  dx = amax / 127   (amax = max |x| of the block)
//
// (a block holding a NaN or an infinity gets dx = NaN, so the output is NaN as on the
// float path), then per block and output column the integer sum s = sum_k q[k, n] xq[k]
// is exact (int16 pairs from _mm256_maddubs_epi16, widened to int32 at most every 8
// packed rows) and y += d (dx s) (+ m xsum, or - 8 d xsum for int4_sym), in float32;
// xsum is the float block sum of x itself. So the only change from the float path is x's
// rounding to 8 bits per block: |x - dx xq| <= dx / 2 per element.
//
// Layouts taken (AVX2 only; elsewhere the float path of qmatmul.cc):
//   int4, int4_sym, N last (K/2, N): 32 columns per pass, a packed byte's low and high
//     nibbles interleaved so that one maddubs multiplies x[k] and x[k + bk/2] into one
//     column's int16; any even block.
//   int8_block, N last (K, N): the same, rows k and k + 1 interleaved (|q| against x
//     carrying q's sign), widened to int32 after every pair; any block.
//   int8_block, int4, int4_sym, transposed (N, K): one row per output, 32 k per
//     maddubs (int8: |q| against x carrying q's sign, as ggml's Q8_0 dot); block % 32 == 0.

#if defined(__AVX2__)
constexpr bool kIntegerDot = true;
#else
constexpr bool kIntegerDot = false;
#endif

inline bool UsesIntegerDot(Fmt fmt, bool transposed, int64_t block) {
  if (!kIntegerDot) return false;
  if (fmt == Fmt::kInt4 || fmt == Fmt::kInt4Sym) return !transposed || block % 32 == 0;
  return fmt == Fmt::kInt8Block && (!transposed || block % 32 == 0);
}

// p.xq (B, K) and p.xd (B, K / block) from p.x.
inline void QuantizeX(Problem& p) {
  const int64_t K = p.K, bk = p.block, blocks = K / bk;
  p.xq.assign(p.B * K, 0);
  p.xd.assign(p.B * blocks, 0.0f);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t kb = 0; kb < blocks; ++kb) {
      const float* x = p.x + b * K + kb * bk;
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
      int8_t* xq = p.xq.data() + b * K + kb * bk;
      for (int64_t i = 0; i < bk; ++i)
        xq[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
      p.xd[b * blocks + kb] = amax / 127.0f;
    }
}

// Columns per task of the N-last integer path, at most (qmatmul.cc's Run picks the width:
// N split evenly over the threads). A task reads block kb's bk/2 packed rows w bytes at a
// time, so the hardware prefetchers follow bk/2 sequential streams (64-column tiles going
// down the rows read one cache line per row, a new page every few rows: latency-bound).
constexpr int64_t IW = 1024;

#if defined(__AVX2__)

// isum[r][j] = sum over block kb's k of q[k, n0 + j] xq[b0 + r, k] (N-last 4-bit), j < w.
template <int R>
void Int4BlockSums(const Problem& p, int64_t b0, int64_t kb, int64_t n0, int64_t w,
                   int32_t (*isum)[IW]) {
  const int64_t K = p.K, N = p.N, bk = p.block, half = bk / 2;
  const uint8_t* q = static_cast<const uint8_t*>(p.q) + kb * half * N + n0;
  const int8_t* xq = p.xq.data() + b0 * K + kb * bk;
  const __m256i mask = _mm256_set1_epi8(15);
  int64_t j = 0;
  for (; j + 32 <= w; j += 32) {
    __m256i s32[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) s32[r][c] = _mm256_setzero_si256();
    for (int64_t i0 = 0; i0 < half; i0 += 8) {
      __m256i s16[R][2];
      for (int r = 0; r < R; ++r) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
      const int64_t i1 = std::min(half, i0 + 8);
      for (int64_t i = i0; i < i1; ++i) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * N + j));
        // the next block's rows, these columns: ahead of the prefetchers' page-bound streams
        _mm_prefetch(reinterpret_cast<const char*>(q + (half + i) * N + j), _MM_HINT_T0);
        const __m256i lo = _mm256_and_si256(b, mask);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
        // bytes (lo, hi) per column: columns 0-7 and 16-23, then 8-15 and 24-31
        const __m256i wl = _mm256_unpacklo_epi8(lo, hi), wh = _mm256_unpackhi_epi8(lo, hi);
        for (int r = 0; r < R; ++r) {
          const uint16_t pair = static_cast<uint8_t>(xq[r * K + i]) |
                                static_cast<uint16_t>(static_cast<uint8_t>(xq[r * K + half + i]) << 8);
          const __m256i xv = _mm256_set1_epi16(static_cast<int16_t>(pair));
          // |lo x + hi x'| <= 2 * 15 * 127: eight rows fit an int16
          s16[r][0] = _mm256_add_epi16(s16[r][0], _mm256_maddubs_epi16(wl, xv));
          s16[r][1] = _mm256_add_epi16(s16[r][1], _mm256_maddubs_epi16(wh, xv));
        }
      }
      for (int r = 0; r < R; ++r) {
        s32[r][0] = _mm256_add_epi32(s32[r][0], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(s16[r][0])));
        s32[r][1] = _mm256_add_epi32(s32[r][1], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(s16[r][1])));
        s32[r][2] = _mm256_add_epi32(s32[r][2], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s16[r][0], 1)));
        s32[r][3] = _mm256_add_epi32(s32[r][3], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s16[r][1], 1)));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(isum[r] + j + 8 * c), s32[r][c]);
  }
  for (; j < w; ++j)
    for (int r = 0; r < R; ++r) {
      int32_t s = 0;
      for (int64_t i = 0; i < half; ++i)
        s += (q[i * N + j] & 15) * xq[r * K + i] + (q[i * N + j] >> 4) * xq[r * K + half + i];
      isum[r][j] = s;
    }
}

// isum[r][j] = sum over block kb's k of q[k, n0 + j] xq[b0 + r, k] (N-last int8_block), j < w.
template <int R>
void Int8BlockSums(const Problem& p, int64_t b0, int64_t kb, int64_t n0, int64_t w,
                   int32_t (*isum)[IW]) {
  const int64_t K = p.K, N = p.N, bk = p.block;
  const int8_t* q = static_cast<const int8_t*>(p.q) + kb * bk * N + n0;
  const int8_t* xq = p.xq.data() + b0 * K + kb * bk;
  int64_t j = 0;
  for (; j + 32 <= w; j += 32) {
    __m256i s32[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) s32[r][c] = _mm256_setzero_si256();
    for (int64_t i = 0; i < bk; i += 2) {
      const bool pair = i + 1 < bk;  // an odd block's last row pairs with zeros
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * N + j));
      const __m256i b = pair ? _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(q + (i + 1) * N + j)) : _mm256_setzero_si256();
      // the next block's rows, these columns: ahead of the prefetchers' page-bound streams
      _mm_prefetch(reinterpret_cast<const char*>(q + (bk + i) * N + j), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(q + (bk + i + 1) * N + j), _MM_HINT_T0);
      // bytes (q[i], q[i + 1]) per column: columns 0-7 and 16-23, then 8-15 and 24-31
      const __m256i wl = _mm256_unpacklo_epi8(a, b), wh = _mm256_unpackhi_epi8(a, b);
      const __m256i al = _mm256_sign_epi8(wl, wl), ah = _mm256_sign_epi8(wh, wh);  // |q|
      for (int r = 0; r < R; ++r) {
        const uint16_t two = static_cast<uint8_t>(xq[r * K + i]) |
            static_cast<uint16_t>(pair ? static_cast<uint8_t>(xq[r * K + i + 1]) : 0) << 8;
        const __m256i xv = _mm256_set1_epi16(static_cast<int16_t>(two));
        // |q x + q' x'| <= 2 * 128 * 127: one pair fits an int16, then int32
        const __m256i l = _mm256_maddubs_epi16(al, _mm256_sign_epi8(xv, wl));
        const __m256i h = _mm256_maddubs_epi16(ah, _mm256_sign_epi8(xv, wh));
        s32[r][0] = _mm256_add_epi32(s32[r][0], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(l)));
        s32[r][1] = _mm256_add_epi32(s32[r][1], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(h)));
        s32[r][2] = _mm256_add_epi32(s32[r][2], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(l, 1)));
        s32[r][3] = _mm256_add_epi32(s32[r][3], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(h, 1)));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(isum[r] + j + 8 * c), s32[r][c]);
  }
  for (; j < w; ++j)
    for (int r = 0; r < R; ++r) {
      int32_t s = 0;
      for (int64_t i = 0; i < bk; ++i) s += q[i * N + j] * xq[r * K + i];
      isum[r][j] = s;
    }
}

// The R rows b0 .. b0 + R of y, columns n0 .. n0 + w (N-last int8_block or 4-bit, integer sums).
template <int R>
void IntTile(const Problem& p, int64_t b0, int64_t n0, int64_t w) {
  const int64_t N = p.N, blocks = p.K / p.block;
  const uint16_t* scale = static_cast<const uint16_t*>(p.scale) + n0;
  float acc[R][IW] = {};
  alignas(32) int32_t isum[R][IW];
  float d[IW], m[IW];
  for (int64_t kb = 0; kb < blocks; ++kb) {
    if (p.fmt == Fmt::kInt8Block) {
      Int8BlockSums<R>(p, b0, kb, n0, w, isum);
    } else {
      Int4BlockSums<R>(p, b0, kb, n0, w, isum);
    }
    HalvesToFloats(scale + kb * N, d, w);
    if (p.fmt == Fmt::kInt4) HalvesToFloats(p.offset + n0 + kb * N, m, w);
    for (int r = 0; r < R; ++r) {
      const float dx = p.xd[(b0 + r) * blocks + kb];
      if (p.fmt == Fmt::kInt8Block) {
        for (int64_t j = 0; j < w; ++j) acc[r][j] += d[j] * (dx * static_cast<float>(isum[r][j]));
        continue;
      }
      const float xs = p.xsum[(b0 + r) * blocks + kb];
      if (p.fmt == Fmt::kInt4) {
        for (int64_t j = 0; j < w; ++j)
          acc[r][j] += d[j] * (dx * static_cast<float>(isum[r][j])) + m[j] * xs;
      } else {
        for (int64_t j = 0; j < w; ++j)
          acc[r][j] += d[j] * (dx * static_cast<float>(isum[r][j]) - 8.0f * xs);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < w; ++j) p.y[(b0 + r) * N + n0 + j] = acc[r][j];
}

// Transposed layout, integer sums: y[b0 .. b0 + R, n] over row n of W^T.
template <int R, Fmt F>
void IntRowDots(const Problem& p, int64_t b0, int64_t n) {
  const int64_t K = p.K, bk = p.block, blocks = K / bk, half = bk / 2;
  const uint16_t* scale = static_cast<const uint16_t*>(p.scale) + n * blocks;
  const int8_t* xq = p.xq.data() + b0 * K;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  float extra[R] = {};
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < blocks; ++kb) {
    __m256i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
    if constexpr (F == Fmt::kInt8Block) {
      const int8_t* q = static_cast<const int8_t*>(p.q) + n * K + kb * bk;
      for (int64_t i = 0; i < bk; i += 32) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i));
        const __m256i aw = _mm256_sign_epi8(wv, wv);  // |q| (128 for -128: as unsigned)
        for (int r = 0; r < R; ++r) {
          const __m256i xv = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(xq + r * K + kb * bk + i));
          s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(
              _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), ones));
        }
      }
    } else {
      const uint8_t* q = static_cast<const uint8_t*>(p.q) + n * (K / 2) + kb * half;
      const __m128i m4 = _mm_set1_epi8(15);
      for (int64_t i = 0; i < half; i += 16) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i));
        const __m256i wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m4),
                                            _mm_and_si128(b, m4));
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xq + r * K + kb * bk;
          const __m256i xv = _mm256_set_m128i(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(xr + half + i)),
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(xr + i)));
          s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones));
        }
      }
    }
    const float d = HalfToFloat(scale[kb]);
    for (int r = 0; r < R; ++r) {
      const float dx = p.xd[(b0 + r) * blocks + kb];
      acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(s[r]),
                                                   _mm256_set1_ps(d * dx)));
      if constexpr (F == Fmt::kInt4) {
        extra[r] += HalfToFloat(p.offset[n * blocks + kb]) * p.xsum[(b0 + r) * blocks + kb];
      } else if constexpr (F == Fmt::kInt4Sym) {
        extra[r] -= 8.0f * d * p.xsum[(b0 + r) * blocks + kb];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[r]);
    float sum = 0.0f;
    for (int l = 0; l < 8; ++l) sum += lanes[l];
    p.y[(b0 + r) * p.N + n] = sum + extra[r];
  }
}

#endif  // __AVX2__
