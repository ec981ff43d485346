// Native serving of tcp stream requests: see serve.hpp.
#include "serve.hpp"

#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>

namespace aiodd {

namespace {

int64_t now_ns() {
  struct timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

uint64_t le64(const uint8_t* p) {
  uint64_t x = 0;
  for (int j = 0; j < 8; ++j) x |= static_cast<uint64_t>(p[j]) << (8 * j);
  return x;
}

uint32_t le32(const uint8_t* p) {
  uint32_t x = 0;
  for (int j = 0; j < 4; ++j) x |= static_cast<uint32_t>(p[j]) << (8 * j);
  return x;
}

void put64(uint8_t* p, uint64_t x) {
  for (int j = 0; j < 8; ++j) p[j] = static_cast<uint8_t>(x >> (8 * j));
}

// A JSON string body for ASCII text (anything else is replaced): the refusal's info.
std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s.substr(0, 600)) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) {
      out += '?';
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// Waits until fd is ready for `events` (or the stream was shut down: POLLHUP/POLLERR
// count as ready, the next call says what happened), at most until end_ns.
// Returns false at end_ns.
bool wait_ready(int fd, short events, int64_t end_ns) {
  for (;;) {
    int64_t left = end_ns - now_ns();
    if (left <= 0) return false;
    struct timespec ts{static_cast<time_t>(left / 1000000000LL), static_cast<long>(left % 1000000000LL)};
    struct pollfd pfd{fd, events, 0};
    int r = ppoll(&pfd, 1, &ts, nullptr);
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) return true;  // (the next call fails and says why)
  }
}

constexpr int64_t kForever = INT64_MAX / 4;
constexpr int64_t kServeSpinNs = 60000;  // 60 us

}  // namespace

// ------------------------------------------------------------------------ ServeBook

ServeBook::ServeBook(uint64_t slots) : slots_(slots) {
  if (slots == 0 || slots > (1u << 20)) throw Error(Status::PARAM_INVALID, "serve book: bad slot count");
  void* p = std::calloc(slots, sizeof(LeaseSlot));
  if (p == nullptr) throw Error(Status::NO_MEMORY, "serve book: out of memory");
  words_ = static_cast<LeaseSlot*>(p);
}

ServeBook::~ServeBook() { std::free(words_); }

uint64_t ServeBook::slot_addr(uint64_t slot) const {
  if (slot >= slots_) throw Error(Status::PARAM_INVALID, "serve book: slot out of range");
  return reinterpret_cast<uint64_t>(words_ + slot);
}

void ServeBook::put(uint64_t cache_id, uint64_t slot, uint64_t gen, const Geometry& geo,
                    std::vector<uint64_t> bases, bool device) {
  if (bases.size() != geo.num_tensors) throw Error(Status::PARAM_INVALID, "serve book: one address per tensor");
  auto c = std::make_shared<ServedCache>();
  c->geo = geo;
  c->bases = std::move(bases);
  c->slot_addr = slot_addr(slot);
  c->gen = gen;
  c->device = device;
  std::lock_guard<std::mutex> g(mu_);
  caches_[cache_id] = std::move(c);
}

void ServeBook::remove(uint64_t cache_id) {
  std::lock_guard<std::mutex> g(mu_);
  caches_.erase(cache_id);
}

std::shared_ptr<const ServedCache> ServeBook::find(uint64_t cache_id) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = caches_.find(cache_id);
  return it == caches_.end() ? nullptr : it->second;
}

size_t ServeBook::size() const {
  std::lock_guard<std::mutex> g(mu_);
  return caches_.size();
}

// --------------------------------------------------------------------- StreamServer

StreamServer::StreamServer(std::shared_ptr<ServeBook> book, double cap_s, uint64_t max_bytes, RefusalCodes codes)
    : book_(std::move(book)), max_bytes_(max_bytes), codes_(std::move(codes)) {
  if (!book_) throw Error(Status::PARAM_INVALID, "stream server: no book");
  if (!(cap_s > 0) || cap_s > 1e6) throw Error(Status::PARAM_INVALID, "stream server: cap must be > 0 s");
  if (codes_.by_native.size() <= static_cast<size_t>(Status::STALE))
    throw Error(Status::PARAM_INVALID, "stream server: a code for every native status is needed");
  cap_ns_ = static_cast<int64_t>(cap_s * 1e9);
  thread_ = std::thread([this] { run(); });
}

StreamServer::~StreamServer() { stop(); }

void StreamServer::serve(int fd) {
  std::lock_guard<std::mutex> g(mu_);
  if (stop_) {
    ::close(fd);
    return;
  }
  if (next_fd_ >= 0) ::close(next_fd_);
  next_fd_ = fd;
  if (cur_fd_ >= 0) shutdown(cur_fd_, SHUT_RDWR);  // its serving ends; the new one follows
  cv_.notify_all();
}

void StreamServer::retire() {
  std::lock_guard<std::mutex> g(mu_);
  if (next_fd_ >= 0) {
    ::close(next_fd_);
    next_fd_ = -1;
  }
  if (cur_fd_ >= 0) shutdown(cur_fd_, SHUT_RDWR);
}

void StreamServer::stop() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
    if (next_fd_ >= 0) {
      ::close(next_fd_);
      next_fd_ = -1;
    }
    if (cur_fd_ >= 0) shutdown(cur_fd_, SHUT_RDWR);
    cv_.notify_all();
  }
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void StreamServer::run() {
  pthread_setname_np(pthread_self(), "aiodd-serve");  // (what /proc/PID/task/*/comm shows)
  for (;;) {
    int fd;
    {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait(g, [this] { return stop_ || next_fd_ >= 0; });
      if (stop_) return;
      fd = cur_fd_ = next_fd_;
      next_fd_ = -1;
    }
    serve_stream(fd);
    std::lock_guard<std::mutex> g(mu_);
    ::close(fd);
    cur_fd_ = -1;
  }
}

// Serves requests on fd until the stream ends (the peer closed it, it was shut down,
// or it misbehaved: then it is shut down here, and the requester retires it).
void StreamServer::serve_stream(int fd) {
  std::vector<uint8_t> buf(kRequestHeadBytes + kMaxRequestSegments * 40);
  int64_t answered = 0, gap = kForever;  // when the last answer went; the wait before it
  for (;;) {
    size_t have = 0, need = kRequestHeadBytes;
    int64_t arrived = 0, end = kForever;
    // Back-to-back requests (the last one came within kServeSpinNs of the answer before
    // it): the next is polled for that long before the thread sleeps, as the requester
    // polls for its answer; a thread asleep pays a wakeup on another CPU per request.
    if (answered != 0 && gap <= kServeSpinNs) {
      const int64_t until = answered + kServeSpinNs;
      while (now_ns() < until) {
        ssize_t n = recv(fd, buf.data(), 1, MSG_PEEK | MSG_DONTWAIT);
        if (n != -1 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) break;
        sched_yield();  // (the requester, sharing this CPU, runs now)
      }
    }
    while (have < need) {
      if (!wait_ready(fd, POLLIN, end)) {  // a request not all here within the cap
        shutdown(fd, SHUT_RDWR);
        return;
      }
      // As much as there is (a whole request is most often one segment): a second
      // request before this one's answer is a protocol error either way.
      ssize_t n = recv(fd, buf.data() + have, buf.size() - have, MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
        return;  // reset, shut down
      }
      if (n == 0) return;  // the peer closed it (or it was shut down)
      if (have == 0) {
        arrived = now_ns();
        end = arrived + cap_ns_;
      }
      have += static_cast<size_t>(n);
      if (std::memcmp(buf.data(), kRequestMagic, have < 8 ? have : 8) != 0) {
        shutdown(fd, SHUT_RDWR);  // not a request: out of step
        return;
      }
      if (need == kRequestHeadBytes && have >= kRequestHeadBytes) {
        uint32_t nsegs = le32(buf.data() + 64);
        if (nsegs > kMaxRequestSegments) {
          shutdown(fd, SHUT_RDWR);
          return;
        }
        need = kRequestHeadBytes + static_cast<size_t>(nsegs) * 40;
      }
    }
    if (have > need) {
      shutdown(fd, SHUT_RDWR);  // a second request before the first one's answer
      failed_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    if (answered != 0) gap = arrived - answered;
    busy_.store(true, std::memory_order_release);
    bool in_step = serve_one(fd, buf.data(), need, arrived);
    busy_.store(false, std::memory_order_release);
    answered = now_ns();
    if (!in_step) {
      shutdown(fd, SHUT_RDWR);
      return;
    }
  }
}

bool StreamServer::refuse(int fd, uint64_t tag, int64_t status, const std::string& info, bool stale) {
  failed_.fetch_add(1, std::memory_order_relaxed);
  std::string body = "{\"status\": " + std::to_string(status) + ", \"info\": " + json_string(info) +
                     ", \"stale\": " + (stale ? "true" : "false") + "}";
  std::string frame(24, '\0');
  std::memcpy(&frame[0], kRefusalMagic, 8);
  put64(reinterpret_cast<uint8_t*>(&frame[8]), tag);
  put64(reinterpret_cast<uint8_t*>(&frame[16]), body.size());
  frame += body;
  // The requester reads every answer before it asks again: the socket's buffer is
  // empty, and a refusal that does not fit whole leaves the stream out of step.
  ssize_t n = ::send(fd, frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  return n == static_cast<ssize_t>(frame.size());
}

// One request: checked, then answered with its bytes (under the cache's lease) or a
// refusal. False: the stream is out of step (malformed, a failed or late send).
bool StreamServer::serve_one(int fd, const uint8_t* req, size_t len, int64_t arrived) {
  const uint64_t tag = le64(req + 8), cache_id = le64(req + 16), gen = le64(req + 24);
  const uint64_t nt = le64(req + 32), nb = le64(req + 40), bb = le64(req + 48);
  const uint32_t deadline_ms = le32(req + 56), flags = le32(req + 60);
  const size_t nsegs = (len - kRequestHeadBytes) / 40;
  if ((flags & ~1u) != 0 || nt == 0 || nb == 0 || bb == 0 || deadline_ms < 1 || deadline_ms > kMaxDeadlineMs) {
    failed_.fetch_add(1, std::memory_order_relaxed);
    return false;  // malformed: not a request we can answer in step
  }
  const int64_t cap_end = arrived + cap_ns_;
  const int64_t asked_end = arrived + static_cast<int64_t>(deadline_ms) * 1000000LL;
  const int64_t end = asked_end < cap_end ? asked_end : cap_end;
  const int64_t param_invalid = codes_.by_native[static_cast<size_t>(Status::PARAM_INVALID)];
  if (now_ns() >= end)
    return refuse(fd, tag, codes_.by_native[static_cast<size_t>(Status::TIMEOUT)],
                  "request arrived after its deadline", false);
  auto cache = book_->find(cache_id);
  if (!cache) return refuse(fd, tag, codes_.not_exist, "no cache with id " + std::to_string(cache_id), true);
  if ((flags & 1u) != 0 && gen != cache->gen)
    return refuse(fd, tag, codes_.not_exist,
                  "cache " + std::to_string(cache_id) + " was re-bound since the requester's table (generation " +
                      std::to_string(gen) + ", now " + std::to_string(cache->gen) + ")",
                  true);
  if (cache->device)
    return refuse(fd, tag, param_invalid,
                  "tcp: cache " + std::to_string(cache_id) +
                      " is in device memory; only an engine path that moves device memory (nixl) "
                      "transfers it, nothing here reads it",
                  false);
  std::unique_ptr<Plan> plan;
  try {
    Geometry dst(nt, nb, bb);
    std::vector<Segment> segs(nsegs);
    const uint8_t* b = req + kRequestHeadBytes;
    for (size_t i = 0; i < nsegs; ++i, b += 40)
      segs[i] = {le64(b), le64(b + 8), le64(b + 16), le64(b + 24), le64(b + 32)};
    // Every segment is checked against *our* registered geometry: a peer can never make
    // us read outside registered memory.
    plan = std::make_unique<Plan>(Plan::from_segments(cache->geo, dst, std::move(segs)));
  } catch (const Error& e) {
    size_t s = static_cast<size_t>(e.status());
    int64_t code = s < codes_.by_native.size() ? codes_.by_native[s] : param_invalid;
    return refuse(fd, tag, code, e.what(), false);
  }
  if (plan->total_bytes() > max_bytes_)
    return refuse(fd, tag, param_invalid, "a stream request moves at most " + std::to_string(max_bytes_) + " bytes",
                  false);
  if (!lease_enter(cache->slot_addr, cache->gen))
    return refuse(fd, tag, codes_.not_exist, "cache " + std::to_string(cache_id) + " was unregistered", true);
  bool ok = false;
  try {
    SockStep step(fd, *plan, cache->bases, true, tag);
    for (;;) {
      if (step.step()) {
        ok = true;
        break;
      }
      if (!wait_ready(fd, POLLOUT, end)) break;  // the peer does not take it in time
    }
  } catch (const Error&) {
    ok = false;  // the peer went away, the stream was shut down
  }
  lease_exit(cache->slot_addr);
  if (!ok) {
    failed_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  served_.fetch_add(1, std::memory_order_relaxed);
  bytes_.fetch_add(plan->total_bytes(), std::memory_order_relaxed);
  return true;
}

}  // namespace aiodd
