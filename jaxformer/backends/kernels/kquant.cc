// y (B, N) = x (B, K) W (K, N), W in one of GGUF's K-quant layouts (jaxformer.nn.kquant),
// read as stored, N last (a tile of NT output columns reads NT contiguous bytes of each
// row of every part, once):
//
//   q4_k  q uint8 (K/2, N): in each 64 rows of W, packed row r holds k = r (low nibble)
//         and k = r + 32 (high); scale, min float16 (K/256, N); sub_scale, sub_min
//         uint8 (K/32, N):   W = (d sc) q - (dmin m)
//   q5_k  as q4_k, plus q_high uint8 (K/8, N): in each 256 rows, bit i of packed row j
//         is k = 32 i + j's fifth bit
//   q6_k  q uint8 (K/2, N): in each 128 rows, packed row r holds k = r (low), r + 64
//         (high); q_high uint8 (K/4, N): in each 128 rows, bits 2t, 2t + 1 of packed row
//         j are k = 32 t + j's top two; scale float16 (K/256, N); sub_scale int8 (K/16,
//         N):                W = (d sc) (q - 32)
//
// Per sub-block (32 or 16 rows of W), p = sum_k x[k] q[k, n], then y += (d sc) p -
// (dmin m) sum_k x[k] (q6_k: (d sc) (p - 32 sum_k x[k])): the plain path's
// x ((d sc) q - dmin m) regrouped, in float32. d sc is a float16 times a small integer,
// exact in float32 as in llama.cpp. Tiles are shared out to XLA's intra-op thread pool.
// Built with qmatmul.cc by jaxformer/backends/qmatmul.py; "jaxformer_qmatmul_q*_k".

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "parallel.h"
#include "qtypes.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxformer::qmatmul::HalfToFloat;
using jaxformer::qmatmul::NT;

enum class KFmt { kQ4K, kQ5K, kQ6K };

constexpr int64_t SUPER = 256;  // rows of W per super-block
constexpr int64_t BR = 4;       // rows of x per pass over a tile's weights
constexpr int64_t SERIAL = 1 << 22;  // below K N weights, no threads (qmatmul.cc's bound)

struct KProblem {
  KFmt fmt;
  int64_t B, K, N;
  const float* x;
  const uint8_t* q;
  const uint8_t* q_high;     // q5_k, q6_k
  const uint16_t* scale;     // d, float16 bits (K/256, N)
  const uint16_t* min;       // dmin (q4_k, q5_k)
  const void* sub_scale;     // uint8 (K/32, N), or int8 (K/16, N) for q6_k
  const uint8_t* sub_min;    // q4_k, q5_k
  float* y;
  std::vector<float> xsum;   // (B, K / sub): x summed over each sub-block
};

inline int64_t SubRows(KFmt fmt) { return fmt == KFmt::kQ6K ? 16 : 32; }

// The integer of W[k, n0 + j] for the w columns of row k (before the scales).
inline void Values(const KProblem& p, int64_t k, int64_t n0, int64_t w, float* out) {
  const int64_t N = p.N;
  if (p.fmt == KFmt::kQ6K) {
    const int64_t h = k / 128, r = k % 128;
    const uint8_t* low = p.q + (h * 64 + r % 64) * N + n0;
    const int shift_low = r < 64 ? 0 : 4;
    const uint8_t* high = p.q_high + (h * 32 + r % 32) * N + n0;
    const int shift_high = 2 * (r / 32);
    for (int64_t j = 0; j < w; ++j)
      out[j] = static_cast<float>(static_cast<int>(((low[j] >> shift_low) & 15) |
                                                   (((high[j] >> shift_high) & 3) << 4)) - 32);
    return;
  }
  const int64_t c = k / 64, r = k % 64;
  const uint8_t* low = p.q + (c * 32 + r % 32) * N + n0;
  const int shift_low = r < 32 ? 0 : 4;
  if (p.fmt == KFmt::kQ4K) {
    for (int64_t j = 0; j < w; ++j) out[j] = static_cast<float>((low[j] >> shift_low) & 15);
    return;
  }
  const int64_t s = k / SUPER, i = (k % SUPER) / 32;
  const uint8_t* high = p.q_high + (s * 32 + k % 32) * N + n0;
  for (int64_t j = 0; j < w; ++j)
    out[j] = static_cast<float>(((low[j] >> shift_low) & 15) | (((high[j] >> i) & 1) << 4));
}

// Rows b0 .. b0 + R of y, columns n0 .. n0 + w.
template <int R>
void Tile(const KProblem& p, int64_t b0, int64_t n0, int64_t w) {
  const int64_t K = p.K, N = p.N, sub = SubRows(p.fmt), subs = K / sub;
  const float* x = p.x + b0 * K;
  float acc[R][NT] = {};
  float wk[NT], d[NT], dmin[NT];
  for (int64_t s = 0; s < K / SUPER; ++s) {
    for (int64_t j = 0; j < w; ++j) {
      d[j] = HalfToFloat(p.scale[s * N + n0 + j]);
      dmin[j] = p.min ? HalfToFloat(p.min[s * N + n0 + j]) : 0.0f;
    }
    for (int64_t b = s * (SUPER / sub); b < (s + 1) * (SUPER / sub); ++b) {
      float part[R][NT] = {};
      for (int64_t t = 0; t < sub; ++t) {
        const int64_t k = b * sub + t;
        Values(p, k, n0, w, wk);
        for (int r = 0; r < R; ++r) {
          const float xv = x[r * K + k];
          for (int64_t j = 0; j < w; ++j) part[r][j] += xv * wk[j];
        }
      }
      if (p.fmt == KFmt::kQ6K) {
        const int8_t* sc = static_cast<const int8_t*>(p.sub_scale) + b * N + n0;
        for (int r = 0; r < R; ++r)
          for (int64_t j = 0; j < w; ++j)
            acc[r][j] += (d[j] * static_cast<float>(sc[j])) * part[r][j];
        continue;
      }
      const uint8_t* sc = static_cast<const uint8_t*>(p.sub_scale) + b * N + n0;
      const uint8_t* m = p.sub_min + b * N + n0;
      for (int r = 0; r < R; ++r) {
        const float xs = p.xsum[(b0 + r) * subs + b];
        for (int64_t j = 0; j < w; ++j)
          acc[r][j] += (d[j] * static_cast<float>(sc[j])) * part[r][j] -
                       (dmin[j] * static_cast<float>(m[j])) * xs;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < w; ++j) p.y[(b0 + r) * N + n0 + j] = acc[r][j];
}

void RunTile(const KProblem& p, int64_t t) {
  const int64_t n0 = t * NT, w = std::min(NT, p.N - n0);
  for (int64_t b0 = 0; b0 < p.B; b0 += BR) {
    switch (std::min(BR, p.B - b0)) {
      case 1: Tile<1>(p, b0, n0, w); break;
      case 2: Tile<2>(p, b0, n0, w); break;
      case 3: Tile<3>(p, b0, n0, w); break;
      default: Tile<BR>(p, b0, n0, w); break;
    }
  }
}

ffi::Error Run(ffi::ThreadPool& pool, KProblem& p) {
  if (p.B == 0 || p.N == 0) return ffi::Error::Success();
  const int64_t sub = SubRows(p.fmt), subs = p.K / sub;
  p.xsum.assign(p.B * subs, 0.0f);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t i = 0; i < subs; ++i) {
      float s = 0.0f;
      for (int64_t t = 0; t < sub; ++t) s += p.x[b * p.K + i * sub + t];
      p.xsum[b * subs + i] = s;
    }
  jaxformer::ParallelFor(pool, (p.N + NT - 1) / NT, p.K * p.N < SERIAL,
                         [&p](int64_t t) { RunTile(p, t); });
  return ffi::Error::Success();
}

// The shapes every part must have: rows of W per part row, and the part's rows.
ffi::Error Check(const KProblem& p, ffi::Span<const int64_t> dims, int64_t per,
                 const char* what) {
  if (dims.size() != 2 || dims[0] * per != p.K || dims[1] != p.N)
    return ffi::Error::InvalidArgument(std::string("kquant: the shape of ") + what +
                                       " disagrees with x and y");
  return ffi::Error::Success();
}

ffi::Error Setup(KProblem& p, KFmt fmt, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                 ffi::Buffer<ffi::F16> scale, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || yd[0] != xd[0])
    return ffi::Error::InvalidArgument("kquant: x and y must be 2-D with the same rows");
  p.fmt = fmt;
  p.B = xd[0];
  p.K = xd[1];
  p.N = yd[1];
  if (p.K % SUPER)
    return ffi::Error::InvalidArgument("kquant: K must be a multiple of 256");
  if (auto e = Check(p, q.dimensions(), 2, "q"); e.failure()) return e;
  if (auto e = Check(p, scale.dimensions(), SUPER, "scale"); e.failure()) return e;
  p.x = x.typed_data();
  p.q = q.typed_data();
  p.scale = reinterpret_cast<const uint16_t*>(scale.typed_data());
  p.q_high = nullptr;
  p.min = nullptr;
  p.sub_min = nullptr;
  p.y = y->typed_data();
  return ffi::Error::Success();
}

ffi::Error Q4KImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                   ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> min,
                   ffi::Buffer<ffi::U8> sub_scale, ffi::Buffer<ffi::U8> sub_min,
                   ffi::Result<ffi::Buffer<ffi::F32>> y) {
  KProblem p;
  if (auto e = Setup(p, KFmt::kQ4K, x, q, scale, y); e.failure()) return e;
  if (auto e = Check(p, min.dimensions(), SUPER, "min"); e.failure()) return e;
  if (auto e = Check(p, sub_scale.dimensions(), 32, "sub_scale"); e.failure()) return e;
  if (auto e = Check(p, sub_min.dimensions(), 32, "sub_min"); e.failure()) return e;
  p.min = reinterpret_cast<const uint16_t*>(min.typed_data());
  p.sub_scale = sub_scale.typed_data();
  p.sub_min = sub_min.typed_data();
  return Run(pool, p);
}

ffi::Error Q5KImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                   ffi::Buffer<ffi::U8> q_high, ffi::Buffer<ffi::F16> scale,
                   ffi::Buffer<ffi::F16> min, ffi::Buffer<ffi::U8> sub_scale,
                   ffi::Buffer<ffi::U8> sub_min, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  KProblem p;
  if (auto e = Setup(p, KFmt::kQ5K, x, q, scale, y); e.failure()) return e;
  if (auto e = Check(p, q_high.dimensions(), 8, "q_high"); e.failure()) return e;
  if (auto e = Check(p, min.dimensions(), SUPER, "min"); e.failure()) return e;
  if (auto e = Check(p, sub_scale.dimensions(), 32, "sub_scale"); e.failure()) return e;
  if (auto e = Check(p, sub_min.dimensions(), 32, "sub_min"); e.failure()) return e;
  p.q_high = q_high.typed_data();
  p.min = reinterpret_cast<const uint16_t*>(min.typed_data());
  p.sub_scale = sub_scale.typed_data();
  p.sub_min = sub_min.typed_data();
  return Run(pool, p);
}

ffi::Error Q6KImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                   ffi::Buffer<ffi::U8> q_high, ffi::Buffer<ffi::F16> scale,
                   ffi::Buffer<ffi::S8> sub_scale, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  KProblem p;
  if (auto e = Setup(p, KFmt::kQ6K, x, q, scale, y); e.failure()) return e;
  if (auto e = Check(p, q_high.dimensions(), 4, "q_high"); e.failure()) return e;
  if (auto e = Check(p, sub_scale.dimensions(), 16, "sub_scale"); e.failure()) return e;
  p.q_high = q_high.typed_data();
  p.sub_scale = sub_scale.typed_data();
  return Run(pool, p);
}

}  // namespace

#define JAXFORMER_KQUANT_BIND(...)                                          \
  ffi::Ffi::Bind()                                                          \
      .Ctx<ffi::ThreadPool>()                                               \
      .Arg<ffi::Buffer<ffi::F32>>() __VA_ARGS__                             \
      .Ret<ffi::Buffer<ffi::F32>>()

// x, then the parts in qmatmul.K_PARTS' order.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxformerQmatmulQ4K, Q4KImpl,
                              JAXFORMER_KQUANT_BIND(.Arg<ffi::Buffer<ffi::U8>>()
                                                    .Arg<ffi::Buffer<ffi::F16>>()
                                                    .Arg<ffi::Buffer<ffi::F16>>()
                                                    .Arg<ffi::Buffer<ffi::U8>>()
                                                    .Arg<ffi::Buffer<ffi::U8>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxformerQmatmulQ5K, Q5KImpl,
                              JAXFORMER_KQUANT_BIND(.Arg<ffi::Buffer<ffi::U8>>()
                                                    .Arg<ffi::Buffer<ffi::U8>>()
                                                    .Arg<ffi::Buffer<ffi::F16>>()
                                                    .Arg<ffi::Buffer<ffi::F16>>()
                                                    .Arg<ffi::Buffer<ffi::U8>>()
                                                    .Arg<ffi::Buffer<ffi::U8>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxformerQmatmulQ6K, Q6KImpl,
                              JAXFORMER_KQUANT_BIND(.Arg<ffi::Buffer<ffi::U8>>()
                                                    .Arg<ffi::Buffer<ffi::U8>>()
                                                    .Arg<ffi::Buffer<ffi::F16>>()
                                                    .Arg<ffi::Buffer<ffi::S8>>()));
