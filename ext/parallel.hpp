// run_parallel: the movers' fork/join, on a pool of persistent helper threads
// (included by core.hpp; the pool and StartedJob live in pool.cpp).
//
// Why a pool: a std::thread spawned per job is placed by the kernel's fork balancing,
// which on a small VM often queues it behind its busy parent (measured on the 2-core dev
// VM: the helper of a layered pull started ~350 us late, after the first layer had
// landed on one thread); a sleeping pool thread is woken like any waiter, onto an idle
// CPU when there is one (~20-50 us there, a vCPU's wake-up), and no thread is created
// per job.
//
// The caller runs fn(0) itself, then takes back every helper share no pool thread has
// started yet ("stealing"), so a job never waits for a pool thread to be scheduled, and a
// pool that cannot grow (no memory for a thread) only makes the job serial, never stuck.
#pragma once

#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <vector>

namespace aiodd {

namespace pool {

// One helper share: run(ctx, index). Shares of one job point to its Batch.
struct Batch;
struct Share {
  void (*run)(void* ctx, size_t index);
  void* ctx;
  size_t index;
  Batch* batch;
  int nice;  // the submitter's nice value: pool threads take it while they run the share
};

// What the caller waits on: the count of its shares a pool thread took and has not
// finished. A pool thread decrements it (under mu, then notifies) as its last touch.
struct Batch {
  std::mutex mu;
  std::condition_variable cv;
  size_t running = 0;
};

// submit's nice: the submitting thread's own.
constexpr int kSubmitterNice = INT_MIN;

// Queues the `count` shares for pool threads (waking idle ones, starting new ones while
// fewer are idle than shares queued), to run at `nice`. Never throws: false when nothing
// could be queued (no memory); a share queued that no thread takes waits for the caller's
// take_back.
bool submit(Share* shares, size_t count, int nice = kSubmitterNice) noexcept;
// Removes from the queue every share of `batch` still in it and returns how many it
// removed into `out` (capacity `cap`); the caller runs them itself.
size_t take_back(Batch* batch, Share* out, size_t cap) noexcept;

}  // namespace pool

// A job started on a pool thread at once and awaited later, from another thread: the
// executor starts a layered pull from the event loop's thread the moment it queues it,
// so the first bytes move without waiting for a worker thread to wake and take the GIL.
// wait() runs the body itself when no pool thread has taken it yet. A handle is never
// destroyed while its body runs: the destructor waits (and drops the body's error).
class StartedJob {
 public:
  StartedJob(std::function<void()> body, int nice);
  ~StartedJob();
  StartedJob(const StartedJob&) = delete;
  StartedJob& operator=(const StartedJob&) = delete;
  // Returns once the body has returned; rethrows its error (the first wait only).
  void wait();
  bool done() const noexcept { return finished_.load(std::memory_order_acquire); }

 private:
  static void run(void* self, size_t);
  std::function<void()> body_;
  std::exception_ptr error_;
  pool::Batch batch_;
  pool::Share share_{};
  bool queued_ = false;
  bool waited_ = false;
  std::atomic<bool> finished_{false};
};

// copy_local_layered (pid 0: the source is mapped here) or cma_read_layered (from pid),
// started now as a StartedJob on a pool thread at `nice`. With a lease, the body enters
// it first (not current: Status::STALE, nothing moved) and leaves it after the copy; each
// layer's signal already checks it. plan and ctl must outlive the job.
StartedJob* start_layered(int pid, const Plan& plan, std::vector<uint64_t> src, std::vector<uint64_t> dst,
                          std::vector<uint64_t> bounds, Control& ctl, int threads, int efd,
                          uint64_t lease_addr, uint64_t lease_gen, int nice);

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
      // Stop the sibling shares quickly; the caller sees the first error, not ABORTED.
      ctl.abort();
    }
  };
  using Guarded = decltype(guarded);
  auto trampoline = [](void* ctx, size_t i) { (*static_cast<Guarded*>(ctx))(i); };
  pool::Batch batch;
  // n is a thread count (at most a few dozen): a stack array would do, but a vector
  // keeps any n correct; its allocation failing leaves the job serial.
  std::vector<pool::Share> shares;
  try {
    shares.reserve(n - 1);
    for (size_t i = 1; i < n; ++i) shares.push_back({trampoline, &guarded, i, &batch, 0});
  } catch (...) {
    shares.clear();
  }
  if (!shares.empty() && !pool::submit(shares.data(), shares.size())) shares.clear();
  guarded(0);
  // Whatever no pool thread has taken yet runs here, now, one share after another; the
  // shares a pool thread took are awaited. With none queued (the usual case: every
  // helper started while share 0 ran) this is one uncontended lock.
  if (!shares.empty()) {
    std::vector<pool::Share>& mine = shares;  // reused as the buffer for take_back
    size_t k = pool::take_back(&batch, mine.data(), mine.size());
    for (size_t j = 0; j < k; ++j) guarded(mine[j].index);
  } else {
    for (size_t i = 1; i < n; ++i) guarded(i);  // no shares could be queued
  }
  {
    std::unique_lock<std::mutex> lock(batch.mu);
    batch.cv.wait(lock, [&] { return batch.running == 0; });
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace aiodd
