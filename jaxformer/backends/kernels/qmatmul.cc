// y (B, N) = x (B, K) W (K, N), W in one of jaxformer.nn.quant's layouts, read as stored:
//
//   int8        q int8 (K, N), scale float32 (N):          W = scale[n] q[k, n]
//   int8_block  q int8 (K, N), scale float16 (K/bk, N):    W = d q             (GGUF Q8_0)
//   int4        q uint8 (K/2, N), scale, offset (K/bk, N): W = d q + m         (GGUF Q4_1)
//   int4_sym    q uint8 (K/2, N), scale (K/bk, N):         W = d (q - 8)       (GGUF Q4_0)
//
// 4-bit packing: packed row r of block j holds k = j bk + r in its low four bits and
// k = j bk + r + bk/2 in its high four bits. Every layout is row-major with N last, so a
// tile of NT output columns reads NT contiguous bytes of each weight row, once. The sums
// run in float32: per block, p = sum_k x[k] q[k, n], then y += d p (+ m sum_k x[k]), the
// plain path's x (d q + m) regrouped. Tiles are shared out to XLA's intra-op thread pool.
//
// transposed=true: W^T is stored, (N, K) with K last (a tied embedding table (V, D)
// quantized along D; the scales (N) or (N, K/bk)), packed the same way along K: each
// output n is a dot product over one contiguous row, summed in 16 lanes.
// Under AVX2 the 4-bit and int8_block layouts take integer dot products instead (x
// quantized per block to int8, llama.cpp's scheme): qdot.h.
// Built and loaded by jaxformer/backends/qmatmul.py; registered as "jaxformer_qmatmul_*".

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "qdot.h"
#include "qdot_wide.h"
#include "qtypes.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxformer::qmatmul;  // qtypes.h, qdot.h, qdot_wide.h

constexpr int64_t BT = 4;    // rows of x per pass over a tile's weights
// Below K N weights, no threads: waking the pool costs more than it saves until the
// weights are several MB (measured on 2 shared cores, issue 42, a chain of matmuls on
// weights out of cache: (1,576)x(576,1536) Q4_1 serial 38 us vs threaded 60 us, Q8_0 45
// vs 74; (1,1536)x(1536,576) 34 vs 63, 39 vs 66; 576x4608 serial 17-20% faster; still
// at B 16 and 64; but (1,1536)x(1536,6144) threaded 251 vs 523 us, Q8_0 803 vs 1574;
// the integer paths at B 8, 576x1536 and 1536x576 out of cache, threaded 1.0-1.19x the
// serial time, so K N B did not pay as the bound either).
constexpr int64_t SERIAL = 1 << 22;

// x[0] + ... + x[n - 1]: 8 partial sums (AVX) where n % 8 == 0, a chain of adds
// waiting on each other's latency otherwise.
inline float BlockSum(const float* x, int64_t n) {
#if defined(__AVX__)
  if (n % 8 == 0) {
    __m256 s = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(x + i));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  }
#endif
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += x[i];
  return s;
}


// The R rows b0 .. b0 + R of y, columns n0 .. n0 + W (W = NT when FULL, else nt).
template <int R, bool FULL>
void Tile(const Problem& p, int64_t b0, int64_t n0, int64_t nt) {
  const int64_t w = FULL ? NT : nt;
  const int64_t K = p.K, N = p.N;
  const float* x = p.x + b0 * K;
  float acc[R][NT] = {};
  float wk[NT];
  if (p.fmt == Fmt::kInt8) {
    const int8_t* q = static_cast<const int8_t*>(p.q) + n0;
    for (int64_t k = 0; k < K; ++k) {
      const int8_t* row = q + k * N;
      for (int64_t j = 0; j < w; ++j) wk[j] = static_cast<float>(row[j]);
      for (int r = 0; r < R; ++r) {
        const float xv = x[r * K + k];
        for (int64_t j = 0; j < w; ++j) acc[r][j] += xv * wk[j];
      }
    }
    const float* s = static_cast<const float*>(p.scale) + n0;
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < w; ++j) p.y[(b0 + r) * N + n0 + j] = acc[r][j] * s[j];
    return;
  }
  const int64_t bk = p.block, blocks = K / bk, half = bk / 2;
  const uint16_t* scale = static_cast<const uint16_t*>(p.scale) + n0;
  float d[NT], m[NT];
  for (int64_t kb = 0; kb < blocks; ++kb) {
    float part[R][NT] = {};
    if (p.fmt == Fmt::kInt8Block) {
      const int8_t* q = static_cast<const int8_t*>(p.q) + kb * bk * N + n0;
      for (int64_t i = 0; i < bk; ++i) {
        const int8_t* row = q + i * N;
        for (int64_t j = 0; j < w; ++j) wk[j] = static_cast<float>(row[j]);
        for (int r = 0; r < R; ++r) {
          const float xv = x[r * K + kb * bk + i];
          for (int64_t j = 0; j < w; ++j) part[r][j] += xv * wk[j];
        }
      }
    } else {
      float hk[NT];
      const uint8_t* q = static_cast<const uint8_t*>(p.q) + kb * half * N + n0;
      for (int64_t i = 0; i < half; ++i) {
        const uint8_t* row = q + i * N;
        for (int64_t j = 0; j < w; ++j) {
          wk[j] = static_cast<float>(row[j] & 15);
          hk[j] = static_cast<float>(row[j] >> 4);
        }
        for (int r = 0; r < R; ++r) {
          const float lo = x[r * K + kb * bk + i], hi = x[r * K + kb * bk + half + i];
          for (int64_t j = 0; j < w; ++j) part[r][j] += lo * wk[j] + hi * hk[j];
        }
      }
    }
    HalvesToFloats(scale + kb * N, d, w);
    if (p.fmt == Fmt::kInt4) {
      HalvesToFloats(p.offset + n0 + kb * N, m, w);
      for (int r = 0; r < R; ++r) {
        const float xs = p.xsum[(b0 + r) * blocks + kb];
        for (int64_t j = 0; j < w; ++j) acc[r][j] += d[j] * part[r][j] + m[j] * xs;
      }
    } else if (p.fmt == Fmt::kInt4Sym) {
      for (int r = 0; r < R; ++r) {
        const float xs8 = 8.0f * p.xsum[(b0 + r) * blocks + kb];
        for (int64_t j = 0; j < w; ++j) acc[r][j] += d[j] * (part[r][j] - xs8);
      }
    } else {
      for (int r = 0; r < R; ++r)
        for (int64_t j = 0; j < w; ++j) acc[r][j] += d[j] * part[r][j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < w; ++j) p.y[(b0 + r) * N + n0 + j] = acc[r][j];
}

// int8 (per-column scales), N last: the rows k in order, w <= RW contiguous bytes of
// each (the hardware prefetchers follow one stream; the rows AHEAD further on prefetched
// too, as a new page starts every few rows), float sums.
constexpr int64_t RW = 512;
constexpr int64_t AHEAD = 4;
template <int R>
void Int8Run(const Problem& p, int64_t b0, int64_t n0, int64_t w) {
  const int64_t K = p.K, N = p.N;
  const int8_t* q = static_cast<const int8_t*>(p.q) + n0;
  const float* x = p.x + b0 * K;
  alignas(64) float acc[R][RW] = {};
  for (int64_t k = 0; k < K; ++k) {
    const int8_t* row = q + k * N;
    if (k + AHEAD < K)
      for (int64_t j = 0; j < w; j += 64) __builtin_prefetch(row + AHEAD * N + j);
    float xv[R];
    for (int r = 0; r < R; ++r) xv[r] = x[r * K + k];
    for (int64_t j = 0; j < w; ++j) {
      const float wv = static_cast<float>(row[j]);
      for (int r = 0; r < R; ++r) acc[r][j] += xv[r] * wv;
    }
  }
  const float* s = static_cast<const float*>(p.scale) + n0;
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < w; ++j) p.y[(b0 + r) * N + n0 + j] = acc[r][j] * s[j];
}

template <bool FULL>
void Rows(const Problem& p, int64_t b0, int64_t rows, int64_t n0, int64_t nt) {
  switch (rows) {
    case 1: return Tile<1, FULL>(p, b0, n0, nt);
    case 2: return Tile<2, FULL>(p, b0, n0, nt);
    case 3: return Tile<3, FULL>(p, b0, n0, nt);
    default: return Tile<BT, FULL>(p, b0, n0, nt);
  }
}

// Transposed layout, in GCC/Clang vector extensions (AVX2/AVX-512, NEON or SSE code as
// -march allows): 16 lanes at a time, the ragged end one lane at a time.
constexpr int64_t LANES = 16;
typedef float V8 __attribute__((vector_size(4 * LANES)));
// 16 int8 weights, or the low and high nibbles of 16 bytes, as floats (GCC 12 scalarises
// a vector-extension int8 -> float conversion: intrinsics where there are some).
inline V8 S8ToFloat(const int8_t* p) {
#if defined(__AVX512F__)
  return (V8)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128((const __m128i*)p);
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  V8 v;
  std::memcpy(&v, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
  return v;
#else
  V8 v;
  for (int l = 0; l < LANES; ++l) v[l] = static_cast<float>(p[l]);
  return v;
#endif
}

inline void NibblesToFloat(const uint8_t* p, V8& lo, V8& hi) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128((const __m128i*)p), m = _mm_set1_epi8(15);
  lo = (V8)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, m)));
  hi = (V8)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m)));
#else
  for (int l = 0; l < LANES; ++l) {
    lo[l] = static_cast<float>(p[l] & 15);
    hi[l] = static_cast<float>(p[l] >> 4);
  }
#endif
}

inline V8 Load(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float Sum(V8 v) {
  float s = 0.0f;
  for (int l = 0; l < LANES; ++l) s += v[l];
  return s;
}

// acc[r] (16 lanes) + tail[r] += the products of n weights of one row (from `row`) with
// x's rows r (from `xb`; 4-bit: each byte's high nibble weighs x `half` further on).
template <int R, Fmt F>
__attribute__((always_inline)) inline void Span(V8 (&acc)[R], float (&tail)[R],
                                                const float* xb, int64_t K, int64_t half,
                                                const void* row, int64_t n) {
  int64_t i = 0;
  if constexpr (F == Fmt::kInt8 || F == Fmt::kInt8Block) {
    const int8_t* q = static_cast<const int8_t*>(row);
    for (; i + LANES <= n; i += LANES) {
      const V8 w = S8ToFloat(q + i);
      for (int r = 0; r < R; ++r) acc[r] += Load(xb + r * K + i) * w;
    }
    for (; i < n; ++i)
      for (int r = 0; r < R; ++r) tail[r] += xb[r * K + i] * static_cast<float>(q[i]);
  } else {
    const uint8_t* q = static_cast<const uint8_t*>(row);
    for (; i + LANES <= n; i += LANES) {
      V8 lo, hi;
      NibblesToFloat(q + i, lo, hi);
      for (int r = 0; r < R; ++r)
        acc[r] += Load(xb + r * K + i) * lo + Load(xb + r * K + half + i) * hi;
    }
    for (; i < n; ++i)
      for (int r = 0; r < R; ++r)
        tail[r] += xb[r * K + i] * static_cast<float>(q[i] & 15) +
                   xb[r * K + half + i] * static_cast<float>(q[i] >> 4);
  }
}

// Transposed layout: y[b0 .. b0 + R, n], one dot product per row of x over row n of W^T.
template <int R, Fmt F>
void RowDots(const Problem& p, int64_t b0, int64_t n) {
  const int64_t K = p.K;
  const float* x = p.x + b0 * K;
  V8 acc[R] = {};
  float extra[R] = {};
  float s = 1.0f;
  if constexpr (F == Fmt::kInt8) {
    Span<R, F>(acc, extra, x, K, 0, static_cast<const int8_t*>(p.q) + n * K, K);
    s = static_cast<const float*>(p.scale)[n];
  } else {
    const int64_t bk = p.block, blocks = K / bk, half = bk / 2;
    const uint16_t* scale = static_cast<const uint16_t*>(p.scale) + n * blocks;
    for (int64_t kb = 0; kb < blocks; ++kb) {
      V8 part[R] = {};
      float tail[R] = {};
      if constexpr (F == Fmt::kInt8Block) {
        Span<R, F>(part, tail, x + kb * bk, K, 0,
                   static_cast<const int8_t*>(p.q) + n * K + kb * bk, bk);
      } else {
        Span<R, F>(part, tail, x + kb * bk, K, half,
                   static_cast<const uint8_t*>(p.q) + n * (K / 2) + kb * half, half);
      }
      const float d = HalfToFloat(scale[kb]);
      for (int r = 0; r < R; ++r) {
        acc[r] += d * part[r];
        extra[r] += d * tail[r];
      }
      if constexpr (F == Fmt::kInt4) {
        const float m = HalfToFloat(p.offset[n * blocks + kb]);
        for (int r = 0; r < R; ++r) extra[r] += m * p.xsum[(b0 + r) * blocks + kb];
      } else if constexpr (F == Fmt::kInt4Sym) {
        for (int r = 0; r < R; ++r) extra[r] -= 8.0f * d * p.xsum[(b0 + r) * blocks + kb];
      }
    }
  }
  for (int r = 0; r < R; ++r) p.y[(b0 + r) * p.N + n] = (Sum(acc[r]) + extra[r]) * s;
}

template <Fmt F>
void RowsOf(const Problem& p, int64_t t) {
  for (int64_t n = t * VT; n < std::min(p.N, (t + 1) * VT); ++n)
    for (int64_t b0 = 0; b0 < p.B; b0 += BT) {
      switch (std::min(BT, p.B - b0)) {
        case 1: RowDots<1, F>(p, b0, n); break;
        case 2: RowDots<2, F>(p, b0, n); break;
        case 3: RowDots<3, F>(p, b0, n); break;
        default: RowDots<BT, F>(p, b0, n); break;
      }
    }
}

// Transposed layout, task t: outputs t VT .. min(N, (t + 1) VT), every row of x.
void RunRows(const Problem& p, int64_t t) {
#if defined(__AVX2__)
  if (p.integer) {
    switch (p.fmt) {
      case Fmt::kInt8Block: return IntRowsOf<Fmt::kInt8Block>(p, t);
      case Fmt::kInt4: return IntRowsOf<Fmt::kInt4>(p, t);
      case Fmt::kInt4Sym: return IntRowsOf<Fmt::kInt4Sym>(p, t);
      default: break;
    }
  }
#endif
  switch (p.fmt) {
    case Fmt::kInt8: return RowsOf<Fmt::kInt8>(p, t);
    case Fmt::kInt8Block: return RowsOf<Fmt::kInt8Block>(p, t);
    case Fmt::kInt4: return RowsOf<Fmt::kInt4>(p, t);
    case Fmt::kInt4Sym: return RowsOf<Fmt::kInt4Sym>(p, t);
  }
}

// Output tile t: columns t width .. min(N, (t + 1) width), every row of x.
void RunTile(const Problem& p, int64_t t) {
  const int64_t n0 = t * p.width, nt = std::min(p.width, p.N - n0);
#if defined(__AVX2__)
  if (p.integer) {
    for (int64_t b0 = 0; b0 < p.B; b0 += IR) {
      const int64_t rows = std::min<int64_t>(IR, p.B - b0);
      switch (p.fmt) {
        case Fmt::kInt8Block: IntTileRows<Fmt::kInt8Block>(p, b0, rows, n0, nt); break;
        case Fmt::kInt4: IntTileRows<Fmt::kInt4>(p, b0, rows, n0, nt); break;
        default: IntTileRows<Fmt::kInt4Sym>(p, b0, rows, n0, nt); break;
      }
    }
    return;
  }
#endif
  for (int64_t b0 = 0; b0 < p.B; b0 += BT) {
    const int64_t rows = std::min(BT, p.B - b0);
    if (p.fmt == Fmt::kInt8) {
      switch (rows) {
        case 1: Int8Run<1>(p, b0, n0, nt); break;
        case 2: Int8Run<2>(p, b0, n0, nt); break;
        case 3: Int8Run<3>(p, b0, n0, nt); break;
        default: Int8Run<BT>(p, b0, n0, nt); break;
      }
      continue;
    }
    if (nt == NT) {
      Rows<true>(p, b0, rows, n0, nt);
    } else {
      Rows<false>(p, b0, rows, n0, nt);
    }
  }
}

using jaxformer::ParallelFor;

ffi::Error Run(ffi::ThreadPool& pool, Problem& p) {
  if (p.B == 0 || p.N == 0) return ffi::Error::Success();
  if (p.K == 0) {
    std::fill(p.y, p.y + p.B * p.N, 0.0f);
    return ffi::Error::Success();
  }
  p.integer = UsesIntegerDot(p.fmt, p.transposed, p.block);
  if (p.integer) QuantizeX(p);
  if (p.fmt == Fmt::kInt4 || p.fmt == Fmt::kInt4Sym) {
    const int64_t blocks = p.K / p.block;
    p.xsum.assign(p.B * blocks, 0.0f);
    if (p.integer) {
      RoundedBlockSums(p);
    } else {
      for (int64_t b = 0; b < p.B; ++b)
        for (int64_t kb = 0; kb < blocks; ++kb)
          p.xsum[b * blocks + kb] = BlockSum(p.x + b * p.K + kb * p.block, p.block);
    }
  }
  p.wide = UsesWideDot(p);
  if (p.wide) WideX(p);
  const bool serial = p.K * p.N < SERIAL;
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  if (p.wide) {  // qdot_wide.h
    ParallelFor(pool, (p.N + VT - 1) / VT, serial, [&p](int64_t t) {
      switch (p.fmt) {
        case Fmt::kInt4: return WideRowsOf<Fmt::kInt4>(p, t);
        case Fmt::kInt4Sym: return WideRowsOf<Fmt::kInt4Sym>(p, t);
        default: return WideRowsOf<Fmt::kInt8Block>(p, t);
      }
    });
    return ffi::Error::Success();
  }
#endif
  if (p.transposed) {
    ParallelFor(pool, (p.N + VT - 1) / VT, serial, [&p](int64_t t) { RunRows(p, t); });
    return ffi::Error::Success();
  }
  if (p.integer || p.fmt == Fmt::kInt8) {  // N split evenly, in multiples of 32 columns
    const int64_t workers = serial ? 1 : pool.num_threads() + 1;
    p.width = std::min(p.integer ? IW : RW, ((p.N + workers - 1) / workers + 31) / 32 * 32);
  }
  ParallelFor(pool, (p.N + p.width - 1) / p.width, serial, [&p](int64_t t) { RunTile(p, t); });
  return ffi::Error::Success();
}

// x (B, K); q (K or K/2, N), scales (N) or (K / block, N); transposed: q (N, K or K/2),
// scales (N) or (N, K / block); y (B, N).
template <typename Q, typename S>
ffi::Error Setup(Problem& p, Fmt fmt, bool transposed, ffi::Buffer<ffi::F32> x, Q q,
                 S scale, int64_t block, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions(),
       yd = y->dimensions();
  if (xd.size() != 2 || qd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("qmatmul: x, q and y must be 2-D");
  const bool packed = fmt == Fmt::kInt4 || fmt == Fmt::kInt4Sym;
  p.fmt = fmt;
  p.transposed = transposed;
  p.B = xd[0];
  p.K = xd[1];
  p.N = transposed ? qd[0] : qd[1];
  p.block = block;
  if (fmt != Fmt::kInt8 && (block <= 0 || (packed && block % 2) || p.K % block))
    return ffi::Error::InvalidArgument("qmatmul: block must divide K (and be even for 4-bit)");
  if (qd[transposed ? 1 : 0] != (packed ? p.K / 2 : p.K) || yd[0] != p.B || yd[1] != p.N)
    return ffi::Error::InvalidArgument("qmatmul: shapes of x, q and y disagree");
  bool scales_ok;
  if (fmt == Fmt::kInt8) {
    scales_ok = sd.size() == 1 && sd[0] == p.N;
  } else {
    const int64_t blocks = p.K / block;
    scales_ok = sd.size() == 2 && sd[0] == (transposed ? p.N : blocks) &&
                sd[1] == (transposed ? blocks : p.N);
  }
  if (!scales_ok) return ffi::Error::InvalidArgument("qmatmul: the scales' shape disagrees");
  p.x = x.typed_data();
  p.q = q.typed_data();
  p.scale = scale.typed_data();
  p.offset = nullptr;
  p.y = y->typed_data();
  return ffi::Error::Success();
}

ffi::Error Int8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                    ffi::Buffer<ffi::F32> scale, int64_t block, bool transposed,
                    ffi::Result<ffi::Buffer<ffi::F32>> y) {
  Problem p;
  if (auto e = Setup(p, Fmt::kInt8, transposed, x, q, scale, block, y); e.failure()) return e;
  return Run(pool, p);
}

ffi::Error Int8BlockImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                         ffi::Buffer<ffi::F16> scale, int64_t block, bool transposed,
                         ffi::Result<ffi::Buffer<ffi::F32>> y) {
  Problem p;
  if (auto e = Setup(p, Fmt::kInt8Block, transposed, x, q, scale, block, y); e.failure())
    return e;
  return Run(pool, p);
}

ffi::Error Int4Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                    ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> offset, int64_t block,
                    bool transposed, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  Problem p;
  if (auto e = Setup(p, Fmt::kInt4, transposed, x, q, scale, block, y); e.failure()) return e;
  if (offset.dimensions().size() != scale.dimensions().size() ||
      offset.element_count() != scale.element_count())
    return ffi::Error::InvalidArgument("qmatmul: offset and scale shapes differ");
  p.offset = offset.typed_data();
  return Run(pool, p);
}

ffi::Error Int4SymImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                       ffi::Buffer<ffi::F16> scale, int64_t block, bool transposed,
                       ffi::Result<ffi::Buffer<ffi::F32>> y) {
  Problem p;
  if (auto e = Setup(p, Fmt::kInt4Sym, transposed, x, q, scale, block, y); e.failure())
    return e;
  return Run(pool, p);
}

}  // namespace

#define JAXFORMER_QMATMUL_BIND(...)                                         \
  ffi::Ffi::Bind()                                                          \
      .Ctx<ffi::ThreadPool>()                                               \
      .Arg<ffi::Buffer<ffi::F32>>() __VA_ARGS__                             \
      .Attr<int64_t>("block")                                               \
      .Attr<bool>("transposed")                                             \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxformerQmatmulInt8, Int8Impl,
                              JAXFORMER_QMATMUL_BIND(.Arg<ffi::Buffer<ffi::S8>>()
                                                     .Arg<ffi::Buffer<ffi::F32>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxformerQmatmulInt8Block, Int8BlockImpl,
                              JAXFORMER_QMATMUL_BIND(.Arg<ffi::Buffer<ffi::S8>>()
                                                     .Arg<ffi::Buffer<ffi::F16>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxformerQmatmulInt4, Int4Impl,
                              JAXFORMER_QMATMUL_BIND(.Arg<ffi::Buffer<ffi::U8>>()
                                                     .Arg<ffi::Buffer<ffi::F16>>()
                                                     .Arg<ffi::Buffer<ffi::F16>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxformerQmatmulInt4Sym, Int4SymImpl,
                              JAXFORMER_QMATMUL_BIND(.Arg<ffi::Buffer<ffi::U8>>()
                                                     .Arg<ffi::Buffer<ffi::F16>>()));

// 1 where the library takes qdot.h's integer dot products (UsesIntegerDot), else 0.
extern "C" int jaxformer_qmatmul_integer_dot() { return kIntegerDot ? 1 : 0; }
