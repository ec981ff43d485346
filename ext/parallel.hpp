// run_parallel: a tiny fork/join used by the movers (included by core.hpp).
#pragma once

#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace aiodd {

template <class Fn>
void run_parallel(size_t n, Control& ctl, Fn fn) {
  if (n <= 1) {
    fn(size_t{0});
    return;
  }
  std::exception_ptr first;
  std::mutex mu;
  auto guarded = [&](size_t i) {
    try {
      fn(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!first) first = std::current_exception();
      // Stop the sibling threads quickly; the caller sees the first error, not ABORTED.
      ctl.abort();
    }
  };
  std::vector<std::thread> workers;
  workers.reserve(n - 1);
  try {
    for (size_t i = 1; i < n; ++i) workers.emplace_back(guarded, i);
  } catch (...) {
    ctl.abort();
    for (auto& t : workers) t.join();
    throw Error(Status::NO_MEMORY, "could not start mover threads");
  }
  guarded(0);
  for (auto& t : workers) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace aiodd
