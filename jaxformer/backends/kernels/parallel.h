// ParallelFor: the shared-out loop of jaxformer's CPU kernels (qmatmul.cc,
// paged_attention.cc), over XLA's intra-op thread pool (the FFI's ThreadPool context).

#ifndef JAXFORMER_KERNELS_PARALLEL_H_
#define JAXFORMER_KERNELS_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxformer {

// f(i) for i in 0 .. n, on the calling thread and the pool's. A task starting after
// every index is taken does nothing; the caller returns once every taken index is done.
template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, bool serial, const F& f) {
  const int64_t workers = serial ? 1 : std::min<int64_t>(n, pool.num_threads() + 1);
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  const F* fp = &f;
  auto run = [state, fp, n]() {
    int64_t mine = 0;
    for (int64_t i; (i = state->next.fetch_add(1)) < n; ++mine) (*fp)(i);
    if (mine) state->done.fetch_add(mine);
  };
  for (int64_t w = 1; w < workers; ++w) {
    auto task = run;
    pool.Schedule(std::move(task));
  }
  run();
  while (state->done.load() < n) std::this_thread::yield();
}

}  // namespace jaxformer

#endif  // JAXFORMER_KERNELS_PARALLEL_H_
