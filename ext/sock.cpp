// Socket movers: send a plan's source bytes straight from registered memory
// (sendmsg, no staging copy) and receive straight into the destination blocks
// (readv). Each fd is one stream carrying an equal share of the plan's bytes.
//
// Every stream of a transfer starts with a header (kStreamHeaderBytes): a magic,
// the transfer's tag and that stream's payload byte count. The receiver reads it
// into a scratch buffer and checks it before a single payload byte reaches the
// destination, so the bytes of another transfer (one that was cancelled, or a
// stream that lost its place) are refused (Status::STALE), never delivered.
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <sstream>

#include "core.hpp"

namespace aiodd {

namespace {

// Bytes per system call: large enough to amortize the call, small enough that
// an abort is noticed within one chunk.
constexpr uint64_t kSockBatch = kChunk;

// Puts fd in non-blocking mode for the duration of a transfer, so that an
// abort can interrupt a wait; restores the caller's flags afterwards.
class NonBlocking {
 public:
  explicit NonBlocking(int fd) : fd_(fd) {
    flags_ = fcntl(fd, F_GETFL);
    if (flags_ < 0) {
      int e = errno;
      throw Error(Status::PARAM_INVALID, std::string("bad socket fd: ") + std::strerror(e), e);
    }
    if (!(flags_ & O_NONBLOCK)) fcntl(fd, F_SETFL, flags_ | O_NONBLOCK);
  }
  ~NonBlocking() {
    if (!(flags_ & O_NONBLOCK)) fcntl(fd_, F_SETFL, flags_);
  }

 private:
  int fd_;
  int flags_;
};

[[noreturn]] void sock_fail(const char* what, int e) {
  std::ostringstream os;
  os << what << " failed: " << std::strerror(e);
  Status s = (e == EPIPE || e == ECONNRESET || e == ENOTCONN || e == ECONNABORTED) ? Status::PEER_CLOSED
                                                                                    : Status::IO_ERROR;
  if (s == Status::PEER_CLOSED) os << " (the peer closed the connection)";
  throw Error(s, os.str(), e);
}

// Waits until fd is ready for `events` or the control is aborted.
void wait_ready(int fd, short events, Control& ctl) {
  for (;;) {
    ctl.check();
    struct pollfd fds[2] = {{fd, events, 0}, {ctl.wake_fd(), POLLIN, 0}};
    int r = poll(fds, 2, -1);
    if (r < 0) {
      if (errno == EINTR) continue;
      sock_fail("poll", errno);
    }
    if (fds[1].revents) ctl.check();
    if (fds[0].revents & (events | POLLHUP | POLLERR)) return;
    if (fds[0].revents & POLLNVAL) throw Error(Status::IO_ERROR, "socket fd was closed during the transfer");
  }
}

using Header = std::array<uint8_t, kStreamHeaderBytes>;

void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

// Sends or receives exactly len bytes of a small buffer (a stream header) on a
// non-blocking fd, waiting (abortably) when the socket is not ready.
void header_io(int fd, uint8_t* buf, size_t len, bool send, Control& ctl) {
  size_t off = 0;
  while (off < len) {
    ctl.check();
    ssize_t n = send ? ::send(fd, buf + off, len - off, MSG_NOSIGNAL) : ::recv(fd, buf + off, len - off, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        wait_ready(fd, send ? POLLOUT : POLLIN, ctl);
        continue;
      }
      sock_fail(send ? "send" : "recv", errno);
    }
    if (n == 0 && !send) {
      std::ostringstream os;
      os << "the peer closed the connection before the transfer's stream header (" << off << " of " << len
         << " header bytes)";
      throw Error(Status::PEER_CLOSED, os.str());
    }
    off += static_cast<size_t>(n);
  }
}

// Checks a received header against the transfer this receiver waits for.
void check_header(const Header& h, uint64_t tag, uint64_t nbytes) {
  if (std::memcmp(h.data(), kStreamMagic, sizeof kStreamMagic) != 0) {
    throw Error(Status::STALE,
                "data stream out of step: no transfer header where transfer " + std::to_string(tag) +
                    "'s should start; nothing was written");
  }
  uint64_t got_tag = get_u64(h.data() + 8);
  uint64_t got_bytes = get_u64(h.data() + 16);
  if (got_tag != tag) {
    throw Error(Status::STALE, "data stream carries transfer " + std::to_string(got_tag) + ", not transfer " +
                                   std::to_string(tag) + "; nothing was written");
  }
  if (got_bytes != nbytes) {
    throw Error(Status::STALE, "data stream of transfer " + std::to_string(tag) + " announces " +
                                   std::to_string(got_bytes) + " bytes, this end expects " +
                                   std::to_string(nbytes) + "; nothing was written");
  }
}

// The layers of a layered receive, signalled in order: 1 is added to the eventfd once
// every stream has received its share of a layer (and of every layer before it).
class LayerGate {
 public:
  LayerGate(const std::vector<uint64_t>& ends, size_t streams, int efd)
      : ends_(ends), reached_(streams, 0), efd_(efd) {}
  const std::vector<uint64_t>& ends() const { return ends_; }
  // Stream i has received `layers` layers' shares.
  void reach(size_t i, size_t layers) {
    std::lock_guard<std::mutex> lock(m_);
    reached_[i] = layers;
    size_t low = *std::min_element(reached_.begin(), reached_.end());
    uint64_t one = 1;
    for (; signalled_ < low; ++signalled_) {
      while (::write(efd_, &one, sizeof one) < 0) {
        if (errno != EINTR) sock_fail("eventfd write", errno);
      }
    }
  }

 private:
  std::vector<uint64_t> ends_;  // each stream's payload offset where each layer's share ends
  std::mutex m_;
  std::vector<size_t> reached_;
  size_t signalled_ = 0;
  int efd_;
};

// gate (a receiver only): stream `index` of a layered receive reports each layer's share.
void stream(int fd, const std::vector<Piece>& pieces, bool send, Control& ctl, uint64_t tag,
            LayerGate* gate = nullptr, size_t index = 0) {
  NonBlocking nb(fd);
  size_t layer = 0;
  uint64_t received = 0;
  auto advance = [&] {
    size_t before = layer;
    while (layer < gate->ends().size() && received >= gate->ends()[layer]) ++layer;
    if (layer != before) gate->reach(index, layer);
  };
  uint64_t part_bytes = 0;
  for (const Piece& p : pieces) part_bytes += p.nbytes;
  Header h = stream_header(tag, part_bytes);
  if (send) {
    header_io(fd, h.data(), h.size(), true, ctl);
  } else {
    Header got{};
    header_io(fd, got.data(), got.size(), false, ctl);
    check_header(got, tag, part_bytes);
  }
  const size_t max_iov = static_cast<size_t>(iov_max());
  std::vector<struct iovec> iov;
  iov.reserve(max_iov);
  size_t idx = 0;
  uint64_t used = 0;
  while (idx < pieces.size()) {
    ctl.check();
    iov.clear();
    uint64_t batch = 0;
    for (size_t j = idx, u = used; j < pieces.size() && iov.size() < max_iov && batch < kSockBatch;) {
      const Piece& p = pieces[j];
      uint64_t take = std::min(p.nbytes - u, kSockBatch - batch);
      uint64_t addr = (send ? p.src : p.dst) + u;
      iov.push_back({reinterpret_cast<void*>(addr), take});
      batch += take;
      u += take;
      if (u == p.nbytes) {
        ++j;
        u = 0;
      }
    }
    ssize_t n;
    if (send) {
      struct msghdr msg{};
      msg.msg_iov = iov.data();
      msg.msg_iovlen = iov.size();
      n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    } else {
      n = readv(fd, iov.data(), static_cast<int>(iov.size()));
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        wait_ready(fd, send ? POLLOUT : POLLIN, ctl);
        continue;
      }
      sock_fail(send ? "sendmsg" : "readv", errno);
    }
    if (n == 0 && !send) {
      std::ostringstream os;
      os << "the peer closed the connection after " << ctl.bytes_done() << " of " << ctl.total() << " bytes";
      throw Error(Status::PEER_CLOSED, os.str());
    }
    uint64_t got = static_cast<uint64_t>(n);
    ctl.add_done(got);
    if (gate != nullptr) {
      received += got;
      advance();
    }
    // Advance (idx, used) by got bytes.
    while (got > 0) {
      uint64_t left = pieces[idx].nbytes - used;
      if (got >= left) {
        got -= left;
        ++idx;
        used = 0;
      } else {
        used += got;
        got = 0;
      }
    }
  }
}

void check_stream_fd(int fd) {
  if (fd < 0) throw Error(Status::PARAM_INVALID, "negative socket fd");
  // A descriptor that is not a stream socket (a reused fd number, say) would
  // never become readable: refuse it rather than wait on it.
  int type = 0;
  socklen_t len = sizeof type;
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM)
    throw Error(Status::PARAM_INVALID, "fd " + std::to_string(fd) + " is not a connected stream socket");
}

void run_streams(const std::vector<int>& fds, const std::vector<Piece>& pieces, uint64_t total, bool send,
                 Control& ctl, uint64_t tag) {
  if (fds.empty()) throw Error(Status::PARAM_INVALID, "no socket fds given");
  for (int fd : fds) check_stream_fd(fd);
  ctl.set_total(total);
  auto parts = split_even(pieces, total, fds.size());
  run_parallel(fds.size(), ctl, [&](size_t i) { stream(fds[i], parts[i], send, ctl, tag); });
}


}  // namespace

SockStep::SockStep(int fd, const Plan& plan, const std::vector<uint64_t>& bases, bool send, uint64_t tag)
    : fd_(fd), send_(send), tag_(tag), total_(plan.total_bytes()) {
  if (bases.empty()) throw Error(Status::PARAM_INVALID, "buffer addresses are required");
  check_stream_fd(fd);
  pieces_ = send ? resolve(plan, bases, {}) : resolve(plan, {}, bases);
  if (send) header_ = stream_header(tag, total_);
}

bool SockStep::step() {
  const size_t max_iov = static_cast<size_t>(iov_max());
  std::vector<struct iovec> iov;
  while (!finished()) {
    if (refused_) return read_refusal();
    iov.clear();
    bool in_header = header_off_ < kStreamHeaderBytes;
    if (in_header)
      iov.push_back({header_.data() + header_off_, kStreamHeaderBytes - header_off_});
    // The receiver takes the header alone: it is checked before a payload byte lands.
    if (send_ || !in_header) {
      uint64_t u = used_;
      for (size_t j = idx_; j < pieces_.size() && iov.size() < max_iov; ++j, u = 0) {
        const Piece& p = pieces_[j];
        iov.push_back({reinterpret_cast<void*>((send_ ? p.src : p.dst) + u), p.nbytes - u});
      }
    }
    struct msghdr msg{};
    msg.msg_iov = iov.data();
    msg.msg_iovlen = iov.size();
    ssize_t n = send_ ? sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT) : recvmsg(fd_, &msg, MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
      sock_fail(send_ ? "sendmsg" : "recvmsg", errno);
    }
    if (n == 0 && !send_) {
      std::ostringstream os;
      os << "the peer closed the connection after " << done_ << " of " << total_ << " bytes";
      throw Error(Status::PEER_CLOSED, os.str());
    }
    uint64_t got = static_cast<uint64_t>(n);
    if (in_header) {
      uint64_t h = std::min<uint64_t>(got, kStreamHeaderBytes - header_off_);
      header_off_ += h;
      got -= h;
      if (!send_ && header_off_ == kStreamHeaderBytes) {
        if (start_refusal()) return read_refusal();
        check_header(header_, tag_, total_);
      }
    }
    done_ += got;
    while (got > 0) {
      uint64_t left = pieces_[idx_].nbytes - used_;
      if (got >= left) {
        got -= left;
        ++idx_;
        used_ = 0;
      } else {
        used_ += got;
        got = 0;
      }
    }
  }
  return true;
}

// A received header that is the sender's refusal of this transfer: its body is read
// next (into refusal_, never into the destination). A refusal of another transfer, or
// one announcing an oversized body, is STALE like any other foreign header.
bool SockStep::start_refusal() {
  if (std::memcmp(header_.data(), kRefusalMagic, sizeof kRefusalMagic) != 0) return false;
  uint64_t got_tag = get_u64(header_.data() + 8);
  uint64_t len = get_u64(header_.data() + 16);
  if (got_tag != tag_)
    throw Error(Status::STALE, "data stream carries the refusal of transfer " + std::to_string(got_tag) +
                                   ", not of transfer " + std::to_string(tag_) + "; nothing was written");
  if (len > kMaxRefusalBytes)
    throw Error(Status::STALE, "data stream carries a refusal of " + std::to_string(len) + " bytes (at most " +
                                   std::to_string(kMaxRefusalBytes) + "); nothing was written");
  refused_ = true;
  refusal_.assign(len, '\0');
  return true;
}

bool SockStep::read_refusal() {
  while (refusal_off_ < refusal_.size()) {
    ssize_t n = recv(fd_, refusal_.data() + refusal_off_, refusal_.size() - refusal_off_, MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
      sock_fail("recv", errno);
    }
    if (n == 0) throw Error(Status::PEER_CLOSED, "the peer closed the connection inside its refusal");
    refusal_off_ += static_cast<size_t>(n);
  }
  return true;
}

// Polls (non-blocking steps, yielding the CPU between them, no sleep) rather than waiting
// in ppoll: the answer to a tiny request is tens of microseconds away, and a thread
// asleep in ppoll pays a wakeup on another CPU for it.
bool SockStep::step_for(int64_t timeout_us) {
  if (step()) return true;
  struct timespec now{}, end{};
  clock_gettime(CLOCK_MONOTONIC, &end);
  int64_t end_ns = end.tv_sec * 1000000000LL + end.tv_nsec + std::max<int64_t>(timeout_us, 0) * 1000;
  for (;;) {
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (now.tv_sec * 1000000000LL + now.tv_nsec >= end_ns) return false;
    if (step()) return true;
    // A sender sharing this CPU (the peer's serving thread, two cores) runs now, not at
    // the end of our timeslice.
    sched_yield();
  }
}

void SockStep::run(Control& ctl) {
  ctl.set_total(total_);
  for (;;) {
    ctl.check();
    uint64_t before = done_;
    bool finished_now = step();
    if (done_ > before) ctl.add_done(done_ - before);
    if (finished_now) return;
    wait_ready(fd_, send_ ? POLLOUT : POLLIN, ctl);
  }
}

std::array<uint8_t, kStreamHeaderBytes> stream_header(uint64_t tag, uint64_t nbytes) {
  std::array<uint8_t, kStreamHeaderBytes> h{};
  std::memcpy(h.data(), kStreamMagic, sizeof kStreamMagic);
  put_u64(h.data() + 8, tag);
  put_u64(h.data() + 16, nbytes);
  return h;
}

void sock_send(const std::vector<int>& fds, const Plan& plan, const std::vector<uint64_t>& src_bases,
               Control& ctl, uint64_t tag) {
  if (src_bases.empty()) throw Error(Status::PARAM_INVALID, "source addresses are required");
  run_streams(fds, resolve(plan, src_bases, {}), plan.total_bytes(), true, ctl, tag);
}

void sock_recv_layered(const std::vector<int>& fds, const Plan& plan, const std::vector<uint64_t>& dst_bases,
                       Control& ctl, uint64_t tag, const std::vector<uint64_t>& ends, int efd) {
  if (dst_bases.empty()) throw Error(Status::PARAM_INVALID, "destination addresses are required");
  if (fds.empty()) throw Error(Status::PARAM_INVALID, "no socket fds given");
  if (efd < 0) throw Error(Status::PARAM_INVALID, "layered transfer: the signal fd must be >= 0");
  uint64_t prev = 0;
  for (uint64_t e : ends) {
    if (e <= prev) throw Error(Status::PARAM_INVALID, "layered transfer: layer ends must ascend (no empty layer)");
    prev = e;
  }
  const uint64_t total = plan.total_bytes();
  if (ends.empty() || ends.back() * fds.size() != total)
    throw Error(Status::PARAM_INVALID, "layered transfer: each stream's layers must end at its share of the plan");
  for (int fd : fds) check_stream_fd(fd);
  ctl.set_total(total);
  auto parts = split_even(resolve(plan, {}, dst_bases), total, fds.size());
  LayerGate gate(ends, fds.size(), efd);
  run_parallel(fds.size(), ctl, [&](size_t i) { stream(fds[i], parts[i], false, ctl, tag, &gate, i); });
}

void sock_recv(const std::vector<int>& fds, const Plan& plan, const std::vector<uint64_t>& dst_bases,
               Control& ctl, uint64_t tag) {
  if (dst_bases.empty()) throw Error(Status::PARAM_INVALID, "destination addresses are required");
  run_streams(fds, resolve(plan, {}, dst_bases), plan.total_bytes(), false, ctl, tag);
}

}  // namespace aiodd
