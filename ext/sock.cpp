// Socket movers: send a plan's source bytes straight from registered memory
// (sendmsg, no staging copy) and receive straight into the destination blocks
// (readv). Each fd is one stream carrying an equal share of the plan's bytes.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
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

void stream(int fd, const std::vector<Piece>& pieces, bool send, Control& ctl) {
  NonBlocking nb(fd);
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

void run_streams(const std::vector<int>& fds, const std::vector<Piece>& pieces, uint64_t total, bool send,
                 Control& ctl) {
  if (fds.empty()) throw Error(Status::PARAM_INVALID, "no socket fds given");
  for (int fd : fds) {
    if (fd < 0) throw Error(Status::PARAM_INVALID, "negative socket fd");
    // A descriptor that is not a stream socket (a reused fd number, say) would
    // never become readable: refuse it rather than wait on it.
    int type = 0;
    socklen_t len = sizeof type;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM)
      throw Error(Status::PARAM_INVALID, "fd " + std::to_string(fd) + " is not a connected stream socket");
  }
  ctl.set_total(total);
  auto parts = split_even(pieces, total, fds.size());
  run_parallel(fds.size(), ctl, [&](size_t i) { stream(fds[i], parts[i], send, ctl); });
}

}  // namespace

void sock_send(const std::vector<int>& fds, const Plan& plan, const std::vector<uint64_t>& src_bases,
               Control& ctl) {
  if (src_bases.empty()) throw Error(Status::PARAM_INVALID, "source addresses are required");
  run_streams(fds, resolve(plan, src_bases, {}), plan.total_bytes(), true, ctl);
}

void sock_recv(const std::vector<int>& fds, const Plan& plan, const std::vector<uint64_t>& dst_bases,
               Control& ctl) {
  if (dst_bases.empty()) throw Error(Status::PARAM_INVALID, "destination addresses are required");
  run_streams(fds, resolve(plan, {}, dst_bases), plan.total_bytes(), false, ctl);
}

}  // namespace aiodd
