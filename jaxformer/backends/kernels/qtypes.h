// The types qmatmul.cc and its integer paths (qdot.h, qdot_wide.h) share: the weight
// formats, float16 reads and `Problem`, one call's operands and its per-call scratch.

#ifndef JAXFORMER_KERNELS_QTYPES_H_
#define JAXFORMER_KERNELS_QTYPES_H_

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace jaxformer::qmatmul {

constexpr int64_t NT = 64;   // output columns per tile
constexpr int64_t VT = 16;   // weight rows per task (transposed layout)

enum class Fmt { kInt8, kInt8Block, kInt4, kInt4Sym };

inline float HalfToFloat(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#endif
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      uint32_t e = 0;
      while (!(man & 0x400u)) { man <<= 1; ++e; }
      bits = sign | ((113 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void HalvesToFloats(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) dst[i] = HalfToFloat(src[i]);
}

struct Problem {
  Fmt fmt;
  bool transposed;
  int64_t B, K, N, block;
  const float* x;
  const void* q;
  const void* scale;     // float32 (int8) or float16 bits
  const uint16_t* offset;  // int4 only
  float* y;
  std::vector<float> xsum;  // (B, K / block): block sums of x, as rounded on the
                            // integer path (4-bit layouts)
  bool integer = false;     // integer dot products (qdot.h): xs, xd below
  int64_t width = NT;       // columns per task (N-last layout)
  std::vector<int8_t> xs;   // (B, K / block, stream bytes): x quantized per block (qdot.h)
  std::vector<float> xd;    // (B, K / block): its block scales
  std::vector<float> xdt;   // the same by groups of rows (qdot.h, transposed)
  bool wide = false;        // rows in the vector lanes (qdot_wide.h): xw, xdw, xsw, bp
  int64_t bp = 0;
  std::vector<int8_t> xw;
  std::vector<float> xdw, xsw;
  std::vector<int32_t> xqw;
};

}  // namespace jaxformer::qmatmul

#endif  // JAXFORMER_KERNELS_QTYPES_H_
