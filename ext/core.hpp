// aiodatadist native core: plans, abort/progress control, data movers.
//
// No pybind11 and no Python in here: bindings.cpp is the only file that knows
// about Python, so this core can be compiled, tested and sanitized on its own.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace aiodd {

// Native status codes. Python maps them to LLMStatusCode through one table
// (aiodatadist/errors.py NATIVE_STATUS_TABLE); keep the numbers in step.
enum class Status : int {
  OK = 0,
  FAILED = 1,
  PARAM_INVALID = 2,
  OUT_OF_RANGE = 3,
  OVERLAP = 4,
  ABORTED = 5,
  TIMEOUT = 6,
  PERMISSION_DENIED = 7,
  NO_SUCH_PROCESS = 8,
  PEER_CLOSED = 9,
  IO_ERROR = 10,
  NO_MEMORY = 11,
  // A data stream carried another transfer's bytes (or lost its place): see sock.cpp.
  STALE = 12,
};

class Error : public std::runtime_error {
 public:
  Error(Status status, const std::string& what, int err = 0)
      : std::runtime_error(what), status_(status), errno_(err) {}
  Status status() const noexcept { return status_; }
  int sys_errno() const noexcept { return errno_; }

 private:
  Status status_;
  int errno_;
};

// Movers look at the abort flag between segments and at least every kChunk bytes.
constexpr uint64_t kChunk = 4ull << 20;

// Abort token + progress counter for one job. Python reads bytes_done at any
// time without blocking; abort() may be called from any thread. The eventfd
// lets socket movers wake from poll() the moment an abort is requested; it is
// created on first use, so jobs that never wait on a socket don't pay for it.
class Control {
 public:
  Control() = default;
  ~Control();
  Control(const Control&) = delete;
  Control& operator=(const Control&) = delete;

  void abort() noexcept;
  bool aborted() const noexcept { return aborted_.load(std::memory_order_acquire); }
  void reset() noexcept;
  // The eventfd to poll for an abort; throws NO_MEMORY when one cannot be made.
  int wake_fd();

  void add_done(uint64_t n) noexcept { done_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t bytes_done() const noexcept { return done_.load(std::memory_order_relaxed); }
  void set_total(uint64_t n) noexcept { total_.store(n, std::memory_order_relaxed); }
  uint64_t total() const noexcept { return total_.load(std::memory_order_relaxed); }

  // The job's own deadline, `seconds` from now on CLOCK_MONOTONIC (<= 0: already due);
  // check() ends the job there even while the thread that would abort it (the event
  // loop's timer) does not run. Cleared by reset().
  void expire_in(double seconds) noexcept;
  // check() (or due()) found the deadline passed (and aborted the job).
  bool expired() const noexcept { return expired_.load(std::memory_order_acquire); }
  // aborted(), or the deadline has passed: then the job is aborted and marked expired,
  // as check() does, without throwing. For pollers that are not movers (an engine job
  // polling its requests), so the deadline holds while the event loop does not run.
  bool due() noexcept;

  // Throws Error(ABORTED) when an abort was requested or the deadline has passed.
  void check() {
    if (aborted()) throw Error(Status::ABORTED, expired() ? "deadline passed" : "transfer aborted");
    uint64_t d = deadline_ns_.load(std::memory_order_relaxed);
    if (d != 0 && monotonic_ns() >= d) expire();
  }

  static uint64_t monotonic_ns() noexcept;

 private:
  [[noreturn]] void expire();

  std::atomic<bool> aborted_{false};
  std::atomic<bool> expired_{false};
  std::atomic<uint64_t> deadline_ns_{0};
  std::atomic<uint64_t> done_{0};
  std::atomic<uint64_t> total_{0};
  std::mutex efd_mu_;
  int efd_ = -1;
};

struct Geometry {
  uint64_t num_tensors = 0;
  uint64_t num_blocks = 0;
  uint64_t block_bytes = 0;
  Geometry() = default;
  Geometry(uint64_t t, uint64_t b, uint64_t bb);
  uint64_t tensor_bytes() const { return num_blocks * block_bytes; }
};

struct Segment {
  uint64_t src_tensor;
  uint64_t src_off;
  uint64_t dst_tensor;
  uint64_t dst_off;
  uint64_t nbytes;
};

class Plan {
 public:
  // Block-to-block: for every tensor pair (src_tensor_start + k, dst_tensor_start + k),
  // k < tensor_count, and every i, copy block src_blocks[i] to block dst_blocks[i].
  // Block sizes must match on both sides. Consecutive pairs are merged into runs.
  static Plan blocks(const Geometry& src, const Geometry& dst, const std::vector<int64_t>& src_blocks,
                     const std::vector<int64_t>& dst_blocks, uint64_t src_tensor_start,
                     uint64_t dst_tensor_start, uint64_t tensor_count);
  // Arbitrary segments, each validated against both geometries; adjacent ones merged.
  static Plan from_segments(const Geometry& src, const Geometry& dst, std::vector<Segment> segs);

  const Geometry& src() const { return src_; }
  const Geometry& dst() const { return dst_; }
  const std::vector<Segment>& segments() const { return segs_; }
  uint64_t total_bytes() const { return total_; }

 private:
  void finish();  // merge, bounds-check, overlap-check, total
  Geometry src_, dst_;
  std::vector<Segment> segs_;
  uint64_t total_ = 0;
};

// A contiguous piece of a plan resolved to addresses.
struct Piece {
  uint64_t src;
  uint64_t dst;
  uint64_t nbytes;
};

// Resolves a plan against base addresses (one per tensor). Throws PARAM_INVALID
// when a base list does not match the plan's geometry or holds a null address.
std::vector<Piece> resolve(const Plan& plan, const std::vector<uint64_t>& src_bases,
                           const std::vector<uint64_t>& dst_bases);

// Splits resolved pieces into `parts` runs of (almost) equal bytes, cutting
// pieces where needed. Both ends of a socket transfer split the same way.
std::vector<std::vector<Piece>> split_even(const std::vector<Piece>& pieces, uint64_t total,
                                           size_t parts);

// ---- movers (all blocking; callers release the GIL) ----
// How copy_local copies: AUTO streams (non-temporal stores, x86-64 with AVX2) the pieces
// of a transfer larger than the last-level cache and memcpys the rest; MEMCPY always
// memcpys; STREAM streams every piece (tests, benchmarks). Process-wide.
enum class CopyMode : int { AUTO = 0, MEMCPY = 1, STREAM = 2 };
CopyMode copy_mode();
void set_copy_mode(CopyMode mode);
bool stream_supported();     // false: every mode copies with memcpy
uint64_t stream_threshold();  // AUTO streams transfers of at least this many bytes
void copy_local(const Plan& plan, const std::vector<uint64_t>& src_bases,
                const std::vector<uint64_t>& dst_bases, Control& ctl, int threads);
void cma_read(int pid, const Plan& plan, const std::vector<uint64_t>& remote_src,
              const std::vector<uint64_t>& local_dst, Control& ctl, int threads);
void cma_write(int pid, const Plan& plan, const std::vector<uint64_t>& local_src,
               const std::vector<uint64_t>& remote_dst, Control& ctl, int threads);
// Layered variants: one job over the whole plan, cut into layers at the segment indices
// `bounds` (each layer's end; the last is the plan's segment count). Layers move in order;
// after each one has landed in full 1 is written to the eventfd `efd` (after checking that
// the lease slot at `lease_addr`, when not 0, still holds `lease_gen`). Threads and the
// copy kernel are chosen on the whole transfer; the threads take 1 MiB chunks in layer order.
void copy_local_layered(const Plan& plan, const std::vector<uint64_t>& src_bases,
                        const std::vector<uint64_t>& dst_bases, const std::vector<uint64_t>& bounds,
                        Control& ctl, int threads, int efd, uint64_t lease_addr, uint64_t lease_gen);
void cma_read_layered(int pid, const Plan& plan, const std::vector<uint64_t>& remote_src,
                      const std::vector<uint64_t>& local_dst, const std::vector<uint64_t>& bounds,
                      Control& ctl, int threads, int efd, uint64_t lease_addr, uint64_t lease_gen);
// Returns 0 when process_vm_readv on pid works, else the errno.
int cma_probe(int pid);
long iov_max();

// Socket movers. Every stream starts with a header (magic, tag, that stream's
// payload bytes) that the receiver checks before writing a payload byte: a stream
// carrying another transfer's bytes fails with STALE. `tag` names the transfer
// (the requester's request id); both ends must pass the same one.
constexpr size_t kStreamHeaderBytes = 24;
constexpr char kStreamMagic[8] = {'A', 'I', 'O', 'D', 'D', 'S', 'T', '1'};
std::array<uint8_t, kStreamHeaderBytes> stream_header(uint64_t tag, uint64_t nbytes);
// A sender that refuses a transfer (a stream request it will not serve) sends this
// magic, the tag and the length of a body (at most kMaxRefusalBytes) instead of the
// stream header; the stream stays usable after the body.
constexpr char kRefusalMagic[8] = {'A', 'I', 'O', 'D', 'D', 'S', 'E', '1'};
constexpr size_t kMaxRefusalBytes = 4096;
void sock_send(const std::vector<int>& fds, const Plan& plan, const std::vector<uint64_t>& src_bases,
               Control& ctl, uint64_t tag);
void sock_recv(const std::vector<int>& fds, const Plan& plan, const std::vector<uint64_t>& dst_bases,
               Control& ctl, uint64_t tag);
// sock_recv, adding 1 to the eventfd efd as each layer has landed: every stream's share
// of the plan (split as sock_send splits it) carries its part of each layer in order, and
// ends[k] is where layer k's part ends in each share (so ends.back() is a share's size).
void sock_recv_layered(const std::vector<int>& fds, const Plan& plan, const std::vector<uint64_t>& dst_bases,
                       Control& ctl, uint64_t tag, const std::vector<uint64_t>& ends, int efd);

// One stream of a small socket transfer, moved in non-blocking steps by an event loop
// (no thread): step() sends or receives what the socket takes or holds now and returns
// true once every byte (header included) moved; it never waits. The same stream format
// and header check as sock_send / sock_recv (one fd). The caller keeps the memory and
// the fd alive and calls step() from one thread at a time.
class SockStep {
 public:
  SockStep(int fd, const Plan& plan, const std::vector<uint64_t>& bases, bool send, uint64_t tag);
  bool step();
  bool finished() const {
    return header_off_ == kStreamHeaderBytes &&
           (refused_ ? refusal_off_ == refusal_.size() : idx_ == pieces_.size());
  }
  // step(), then, while not finished, waits for readiness (ppoll, the caller releases
  // the GIL) and steps again, for at most timeout_us in all: true once finished.
  bool step_for(int64_t timeout_us);
  // step() until finished, waiting (poll, the caller releases the GIL) for readiness or
  // ctl's abort between steps: a worker thread's blocking run of the whole exchange.
  // Throws Status::ABORTED once ctl is aborted (the stream is then out of step).
  void run(Control& ctl);
  // A receiver whose stream carried the sender's refusal of this transfer (a refusal
  // header with this tag, then its body) instead of the bytes: nothing was written.
  bool refused() const { return refused_; }
  const std::string& refusal() const { return refusal_; }
  bool sending() const { return send_; }
  int fd() const { return fd_; }
  uint64_t bytes_done() const { return done_; }
  uint64_t total() const { return total_; }

 private:
  int fd_;
  bool send_;
  uint64_t tag_;
  uint64_t total_;
  uint64_t done_ = 0;
  std::vector<Piece> pieces_;
  size_t idx_ = 0;
  uint64_t used_ = 0;
  std::array<uint8_t, kStreamHeaderBytes> header_{};
  size_t header_off_ = 0;
  bool start_refusal();
  bool read_refusal();
  bool refused_ = false;
  std::string refusal_;
  size_t refusal_off_ = 0;
};

// Runs fn(i) for i in [0, n) on n threads (the caller's thread takes i = 0) and
// rethrows the first failure after every thread has returned; a failure on one
// thread aborts the others through ctl.
template <class Fn>
void run_parallel(size_t n, Control& ctl, Fn fn);

// ---- shared memory ----
// A nameless memfd segment. create() seals its size (shrink, grow, seal), so a
// process that maps it (from_fd, on an fd passed over a Unix socket) can never
// be made to fault past its end. ``name`` is a label only (shown in /proc/*/maps).
class ShmSegment {
 public:
  static ShmSegment* create(const std::string& name, uint64_t size);
  // Maps a received segment; refuses one not sealed against shrinking. Dups fd
  // (the caller keeps its own); the dup is closed by close().
  static ShmSegment* from_fd(int fd, uint64_t size, bool writable, const std::string& name);
  ~ShmSegment();
  const std::string& name() const { return name_; }
  uint64_t size() const { return size_; }
  uint64_t addr() const { return reinterpret_cast<uint64_t>(addr_); }
  int fd() const { return fd_; }
  bool owner() const { return owner_; }
  bool writable() const { return writable_; }
  bool closed() const { return addr_ == nullptr; }
  // True once every page of a mapping from from_fd is in its page tables (filled on a
  // thread of its own from the mapping on); create() fills its own before returning.
  bool populated() const { return owner_ || populated_.load(std::memory_order_acquire); }
  void close();

 private:
  ShmSegment() = default;
  void start_populate();
  std::string name_;
  uint64_t size_ = 0;
  void* addr_ = nullptr;
  int fd_ = -1;
  bool owner_ = false;
  bool writable_ = true;
  std::thread populater_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> populated_{false};
};

// ---- the fast lane (lane.cpp) ----
// One small pull of blocks on the calling thread (the caller releases the GIL):
// process_vm_readv from `pid`, or a memcpy when pid is 0 (the source is mapped here),
// single-threaded, under the lease slot at `lease_addr` (0: none). pull() returns the
// bytes moved, or: kLaneDeclined (the plan is invalid or over max_bytes: nothing moved),
// kLaneStale (the lease was not current: nothing moved), kLaneRevoked (it was revoked
// while the bytes moved: they are not valid). Copy failures throw Error.
constexpr int64_t kLaneDeclined = -1;
constexpr int64_t kLaneStale = -2;
constexpr int64_t kLaneRevoked = -3;
class LaneCopy {
 public:
  LaneCopy(int pid, const Geometry& src, const Geometry& dst, std::vector<uint64_t> src_bases,
           std::vector<uint64_t> dst_bases, uint64_t lease_addr, uint64_t lease_gen, uint64_t max_bytes);
  int64_t pull(const std::vector<int64_t>& src_blocks, const std::vector<int64_t>& dst_blocks,
               uint64_t src_tensor_start, uint64_t dst_tensor_start, uint64_t tensor_count) const;

 private:
  int pid_;
  Geometry src_, dst_;
  std::vector<uint64_t> src_bases_, dst_bases_;
  uint64_t lease_addr_, lease_gen_, max_bytes_;
};

// ---- leases (lease.cpp) ----
// One slot of a lease page: the generation of one cache's registration (0 =
// empty, kLeaseRevoked set = being revoked) and the count of peer copies under it.
struct LeaseSlot {
  std::atomic<uint64_t> gen;
  std::atomic<uint32_t> readers;
  // The owner's count of fences on the cache (aborted engine transfers that may still
  // write into it): a peer's one-sided write stays out while it is not 0.
  std::atomic<uint32_t> fences;
};
constexpr uint64_t kLeaseSlotBytes = 16;
constexpr uint64_t kLeaseRevoked = 1ull << 63;

// All take the address of a slot inside a mapped lease page.
bool lease_enter(uint64_t addr, uint64_t gen);   // false (and no reader left) when gen differs
void lease_exit(uint64_t addr);                  // wakes a revoker when the last reader leaves
void lease_publish(uint64_t addr, uint64_t gen);
uint64_t lease_gen(uint64_t addr);
uint32_t lease_readers(uint64_t addr);
void lease_set_fences(uint64_t addr, uint32_t n);  // the owner's side
uint32_t lease_fences(uint64_t addr);
// Marks the generation revoked and waits (futex) until no reader is left, at most
// timeout_s; on timeout restores the generation it found and returns false.
bool lease_revoke(uint64_t addr, double timeout_s);

}  // namespace aiodd

#include "parallel.hpp"
