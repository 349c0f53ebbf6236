// Paged attention of a serving step, read straight from the page pool (float32):
//
//   q      (B, C, H, D)   the step's queries (rotated), C per row at positions start_b + i
//   k, v   (..., G, P, D) the pool of Lx layers (the leading axes' product: 1 when
//                         unstacked), P = (N + 1) Z slots;
//                         position p of row b sits at slot table[b, p / Z] Z + p % Z
//   layer  ()             which of the Lx layers to read
//   table  (B, M)         each row's pages in position order
//   start  (B,)           positions cached before this call (the row's new keys are in
//                         the pool already: the layer writes them first)
//   out    (B, C, H, D)   softmax(scale q k^T over positions 0 .. start_b + i) v
//
// Query head h reads kv head h / (H / G) (grouped-query attention: a kv head's keys and
// values are read once for all its query heads and all C queries). Each row reads only
// its own positions (no view padded to the longest row, no copy of the pages), the
// softmax is the plain path's (max, exp, sum, divide, in float32), the sums over D in 16
// lanes. One task per (row, kv head) on XLA's intra-op thread pool.
// Built with qmatmul.cc by jaxformer/backends/qmatmul.py; wrapped by
// jaxformer/backends/paged_attention.py; registered as "jaxformer_paged_attention".

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t LANES = 16;
// Below this many multiply-adds a call runs on the calling thread alone.
constexpr int64_t SERIAL = 1 << 18;

struct Problem {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* table;
  const int32_t* start;
  float* out;
  int64_t B, C, H, G, D, M, Z, P;
  float scale;
};

inline float Dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float part[LANES] = {};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) part[l] += a[i + l] * b[i + l];
  float s = 0.0f;
  for (int l = 0; l < LANES; ++l) s += part[l];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// exp(x) for x <= 0 in float32 (Cephes' expf: 2^n e^r, |r| <= ln2 / 2, a degree-6
// polynomial, within 2 ulp), written as plain arithmetic so the loop vectorizes.
inline void ExpInPlace(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float t = std::max(x[i], -87.0f);
    const float k = std::nearbyint(t * 1.44269504088896341f);
    float r = t - k * 0.693359375f;
    r = r + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float two;
    std::memcpy(&two, &bits, sizeof two);
    x[i] = x[i] < -87.0f ? 0.0f : p * two;
  }
}

// Row b, kv head g: its R = H / G query heads for each of the C queries.
void Task(const Problem& p, int64_t t) {
  const int64_t b = t / p.G, g = t % p.G, R = p.H / p.G, D = p.D;
  const int64_t capacity = p.M * p.Z;
  const int64_t Q = p.C * R;  // queries of this task, query (c, r) at c * R + r
  std::vector<int64_t> seen(Q);
  int64_t longest = 0;
  for (int64_t c = 0; c < p.C; ++c) {
    const int64_t n = std::clamp<int64_t>(int64_t{p.start[b]} + c + 1, 1, capacity);
    for (int64_t r = 0; r < R; ++r) seen[c * R + r] = n;
    longest = std::max(longest, n);
  }
  const float* kbase = p.k + g * p.P * D;
  const float* vbase = p.v + g * p.P * D;
  const int32_t* pages = p.table + b * p.M;
  auto query = [&](int64_t i) {  // (c, r) -> q[b, c, g R + r]
    return p.q + ((b * p.C + i / R) * p.H + g * R + i % R) * D;
  };
  auto slot = [&](int64_t pos) {
    return int64_t{pages[pos / p.Z]} * p.Z + pos % p.Z;
  };
  std::vector<float> scores(Q * longest);
  for (int64_t pos = 0; pos < longest; ++pos) {
    const float* key = kbase + slot(pos) * D;
    for (int64_t i = 0; i < Q; ++i)
      if (pos < seen[i]) scores[i * longest + pos] = Dot(query(i), key, D) * p.scale;
  }
  for (int64_t i = 0; i < Q; ++i) {
    float* s = scores.data() + i * longest;
    const int64_t n = seen[i];
    float top = s[0];
    for (int64_t j = 1; j < n; ++j) top = std::max(top, s[j]);
    for (int64_t j = 0; j < n; ++j) s[j] -= top;
    ExpInPlace(s, n);
    float part[LANES] = {};
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES)
      for (int l = 0; l < LANES; ++l) part[l] += s[j + l];
    float total = 0.0f;
    for (int l = 0; l < LANES; ++l) total += part[l];
    for (; j < n; ++j) total += s[j];
    for (j = 0; j < n; ++j) s[j] /= total;
  }
  std::vector<float> acc(Q * D, 0.0f);
  for (int64_t pos = 0; pos < longest; ++pos) {
    const float* value = vbase + slot(pos) * D;
    for (int64_t i = 0; i < Q; ++i) {
      if (pos >= seen[i]) continue;
      const float w = scores[i * longest + pos];
      float* a = acc.data() + i * D;
      for (int64_t d = 0; d < D; ++d) a[d] += w * value[d];
    }
  }
  for (int64_t i = 0; i < Q; ++i)
    std::memcpy(p.out + ((b * p.C + i / R) * p.H + g * R + i % R) * D, acc.data() + i * D,
                D * sizeof(float));
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> layer,
                ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> start, int64_t page_size,
                float scale, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), td = table.dimensions(),
       sd = start.dimensions(), od = out->dimensions();
  const size_t rank = kd.size();
  if (qd.size() != 4 || rank < 3 || td.size() != 2 || sd.size() != 1 || od.size() != 4)
    return ffi::Error::InvalidArgument(
        "paged_attention: q (B, C, H, D), pools (..., G, P, D), table (B, M), start (B,)");
  Problem p;
  p.B = qd[0];
  p.C = qd[1];
  p.H = qd[2];
  p.D = qd[3];
  p.G = kd[rank - 3];
  p.P = kd[rank - 2];
  p.M = td[1];
  p.Z = page_size;
  p.scale = scale;
  if (k.element_count() != v.element_count() || kd[rank - 1] != p.D || p.G <= 0 || p.H % p.G ||
      td[0] != p.B || sd[0] != p.B || p.Z <= 0 || p.P % p.Z || layer.element_count() != 1 ||
      od[0] != p.B || od[1] != p.C || od[2] != p.H || od[3] != p.D)
    return ffi::Error::InvalidArgument("paged_attention: shapes disagree");
  const int64_t per_layer = p.G * p.P * p.D;
  const int64_t lx = per_layer ? k.element_count() / per_layer : 0, l = layer.typed_data()[0];
  if (l < 0 || l >= lx) return ffi::Error::InvalidArgument("paged_attention: layer out of range");
  p.q = q.typed_data();
  p.k = k.typed_data() + l * per_layer;
  p.v = v.typed_data() + l * per_layer;
  p.table = table.typed_data();
  p.start = start.typed_data();
  p.out = out->typed_data();
  const int64_t pages = p.P / p.Z;
  for (int64_t i = 0; i < p.B * p.M; ++i)
    if (p.table[i] < 0 || p.table[i] >= pages)
      return ffi::Error::InvalidArgument("paged_attention: a page id is outside the pool");
  if (p.B == 0 || p.C == 0 || p.H == 0 || p.M == 0) return ffi::Error::Success();
  int64_t work = 0;
  for (int64_t b = 0; b < p.B; ++b)
    work += p.C * p.H * p.D * std::min<int64_t>(int64_t{p.start[b]} + p.C, p.M * p.Z);
  jaxformer::ParallelFor(pool, p.B * p.G, work < SERIAL,
                         [&p](int64_t t) { Task(p, t); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxformerPagedAttention, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("page_size")
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
