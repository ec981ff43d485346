// Native serving of tcp stream requests (tiny pulls): a thread per link answers the
// peer's requests on the link's request stream without the event loop or the GIL.
//
// ServeBook is one instance's record of what a request may read: per cache, its
// geometry, tensor addresses and the lease slot (in the book's own lease words) and
// generation its registration holds. Python keeps it in step with registration
// (aiodatadist/_leases.py: every grant, renewal and release) and revokes through the
// same lease words as for one-sided peers, so a free waits for (or refuses over) a
// request being served exactly as it does for a peer's copy.
//
// StreamServer serves one link: it reads each request off its stream, checks it against
// the book (the cache, its generation, every segment against the registered geometry,
// the size bound), sends the stream header and the bytes under the cache's lease, or a
// refusal frame naming the status. A stream that misbehaves (not a request, a malformed
// or oversized one, a request not all there within the serving cap, a send that fails
// or outlasts its deadline) is shut down: the requester retires it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core.hpp"

namespace aiodd {

struct ServedCache {
  Geometry geo;
  std::vector<uint64_t> bases;
  uint64_t slot_addr = 0;
  uint64_t gen = 0;
  bool device = false;  // device memory: never read here
};

class ServeBook {
 public:
  explicit ServeBook(uint64_t slots);
  ~ServeBook();
  ServeBook(const ServeBook&) = delete;
  ServeBook& operator=(const ServeBook&) = delete;

  uint64_t slots() const { return slots_; }
  // The address of lease slot `slot` (for lease_publish / lease_revoke / lease_readers).
  uint64_t slot_addr(uint64_t slot) const;
  void put(uint64_t cache_id, uint64_t slot, uint64_t gen, const Geometry& geo, std::vector<uint64_t> bases,
           bool device);
  void remove(uint64_t cache_id);
  std::shared_ptr<const ServedCache> find(uint64_t cache_id) const;
  size_t size() const;

 private:
  uint64_t slots_;
  LeaseSlot* words_;
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<const ServedCache>> caches_;
};

// LLM status codes a refusal carries (the Python side's LLMStatusCode values).
struct RefusalCodes {
  std::vector<int64_t> by_native;  // indexed by Status
  int64_t not_exist = 0;
};

class StreamServer {
 public:
  StreamServer(std::shared_ptr<ServeBook> book, double cap_s, uint64_t max_bytes, RefusalCodes codes);
  ~StreamServer();
  StreamServer(const StreamServer&) = delete;
  StreamServer& operator=(const StreamServer&) = delete;

  // Serves requests on `fd` (the server owns and closes it) from now on; a stream served
  // until now is shut down first.
  void serve(int fd);
  // Shuts the stream being served down (and drops one not picked up yet).
  void retire();
  // Ends the thread (joins it); idempotent.
  void stop();

  uint64_t served() const { return served_.load(std::memory_order_relaxed); }
  uint64_t failed() const { return failed_.load(std::memory_order_relaxed); }
  uint64_t bytes() const { return bytes_.load(std::memory_order_relaxed); }
  bool busy() const { return busy_.load(std::memory_order_acquire); }

 private:
  void run();
  void serve_stream(int fd);
  bool serve_one(int fd, const uint8_t* req, size_t len, int64_t arrived_ns);
  bool refuse(int fd, uint64_t tag, int64_t status, const std::string& info, bool stale);

  std::shared_ptr<ServeBook> book_;
  int64_t cap_ns_;
  uint64_t max_bytes_;
  RefusalCodes codes_;
  std::mutex mu_;
  std::condition_variable cv_;
  int next_fd_ = -1;  // handed over, not picked up yet
  int cur_fd_ = -1;   // being served (closed by the thread, under mu_)
  bool stop_ = false;
  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> served_{0}, failed_{0}, bytes_{0};
  std::thread thread_;
};

// The request format (transports/tcp_requests.py): a fixed little-endian head, then
// 40 bytes per segment.
constexpr size_t kRequestHeadBytes = 68;
constexpr size_t kMaxRequestSegments = 1024;
constexpr char kRequestMagic[8] = {'a', 'i', 'o', 'd', 'd', 'R', 'Q', '1'};
constexpr uint32_t kMaxDeadlineMs = 0x7fffffffu;

}  // namespace aiodd
