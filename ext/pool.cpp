// The movers' helper thread pool and StartedJob (declared in parallel.hpp).
#include <pthread.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <new>
#include <thread>

#include "core.hpp"

namespace aiodd {

// ---- the movers' helper thread pool (parallel.hpp) ----
namespace pool {

namespace {

struct State {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Share> queue;
  size_t idle = 0;      // threads waiting for a share
  size_t starting = 0;  // threads started that have not looked at the queue yet
  size_t alive = 0;
};

// Enough for every executor worker's movers at once; past it shares wait for a pool
// thread or for their caller (take_back), so a job still finishes.
constexpr size_t kMaxThreads = 256;

// Never freed: pool threads may still wait on it at exit. A forked child gets a new one
// (its parent's threads do not exist there, and a parent thread may have held its lock).
std::atomic<State*> g_state{nullptr};

void forget_after_fork() { g_state.store(nullptr, std::memory_order_relaxed); }
const int g_atfork = pthread_atfork(nullptr, nullptr, forget_after_fork);

State* state() noexcept {
  State* s = g_state.load(std::memory_order_acquire);
  if (s != nullptr) return s;
  State* fresh = new (std::nothrow) State;
  if (fresh == nullptr) return nullptr;
  if (g_state.compare_exchange_strong(s, fresh, std::memory_order_acq_rel)) return fresh;
  delete fresh;  // another thread made it first
  return s;
}

pid_t thread_id() { return static_cast<pid_t>(syscall(SYS_gettid)); }

int thread_nice() {
  errno = 0;
  int v = getpriority(PRIO_PROCESS, static_cast<id_t>(thread_id()));  // Linux: per thread
  return errno == 0 ? v : 0;
}

void worker(State* s) {
  pthread_setname_np(pthread_self(), "aiodd-mover");
  int nice = thread_nice();
  std::unique_lock<std::mutex> lock(s->mu);
  --s->starting;
  ++s->alive;
  for (;;) {
    while (s->queue.empty()) {
      ++s->idle;
      s->cv.wait(lock);
      --s->idle;
    }
    Share sh = s->queue.front();
    s->queue.pop_front();
    {
      // Counted before the pool lock is let go: the caller's take_back (under it) and
      // its wait then see every share either taken back or running.
      std::lock_guard<std::mutex> g(sh.batch->mu);
      ++sh.batch->running;
    }
    lock.unlock();
    // Run at the submitter's priority (movers run below the event loop's thread). Best
    // effort: raising it back needs CAP_SYS_NICE.
    if (sh.nice != nice && setpriority(PRIO_PROCESS, static_cast<id_t>(thread_id()), sh.nice) == 0)
      nice = sh.nice;
    sh.run(sh.ctx, sh.index);  // run_parallel's guarded: never throws
    {
      // The last touch of the batch: the caller may return (and free it) once it is 0.
      std::lock_guard<std::mutex> g(sh.batch->mu);
      if (--sh.batch->running == 0) sh.batch->cv.notify_all();
    }
    lock.lock();
  }
}

}  // namespace

bool submit(Share* shares, size_t count, int nice) noexcept {
  State* s = state();
  if (s == nullptr) return false;
  if (nice == kSubmitterNice) nice = thread_nice();
  {
    std::lock_guard<std::mutex> lock(s->mu);
    size_t queued = 0;
    try {
      for (; queued < count; ++queued) {
        shares[queued].nice = nice;
        s->queue.push_back(shares[queued]);
      }
    } catch (...) {
      for (; queued > 0; --queued) s->queue.pop_back();  // all or nothing
      return false;
    }
    // Start threads while fewer are idle (or starting) than shares wait: a share never
    // queues behind another job's share while the pool can grow.
    while (s->queue.size() > s->idle + s->starting && s->alive + s->starting < kMaxThreads) {
      try {
        std::thread t(worker, s);
        // Named here too: a thread not yet scheduled (a loaded machine) is already one of
        // the pool's to whoever lists them (tools, the tests).
        pthread_setname_np(t.native_handle(), "aiodd-mover");
        t.detach();
      } catch (...) {
        break;  // the caller takes back what no thread takes
      }
      ++s->starting;
    }
  }
  for (size_t i = 0; i < count; ++i) s->cv.notify_one();
  return true;
}

size_t take_back(Batch* batch, Share* out, size_t cap) noexcept {
  State* s = g_state.load(std::memory_order_acquire);
  if (s == nullptr) return 0;
  std::lock_guard<std::mutex> lock(s->mu);
  size_t k = 0;
  for (auto it = s->queue.begin(); it != s->queue.end();) {
    if (it->batch == batch && k < cap) {
      out[k++] = *it;
      it = s->queue.erase(it);
    } else {
      ++it;
    }
  }
  return k;
}

}  // namespace pool

StartedJob::StartedJob(std::function<void()> body, int nice) : body_(std::move(body)) {
  share_ = {&StartedJob::run, this, 0, &batch_, 0};
  queued_ = pool::submit(&share_, 1, nice);
}

StartedJob::~StartedJob() {
  try {
    wait();
  } catch (...) {  // nobody asked for it
  }
}

void StartedJob::run(void* self, size_t) {
  auto* job = static_cast<StartedJob*>(self);
  try {
    job->body_();
  } catch (...) {
    job->error_ = std::current_exception();
  }
  job->finished_.store(true, std::memory_order_release);
}

void StartedJob::wait() {
  if (!waited_) {
    pool::Share mine;
    if (!queued_ || pool::take_back(&batch_, &mine, 1) == 1) run(this, 0);  // not started yet
    std::unique_lock<std::mutex> lock(batch_.mu);
    batch_.cv.wait(lock, [&] { return batch_.running == 0; });
    waited_ = true;
  }
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

}  // namespace aiodd
