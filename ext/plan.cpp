// Plans: block lists and layer ranges -> validated, merged segments.
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <limits>
#include <sstream>

#include "core.hpp"

namespace aiodd {

Control::~Control() {
  if (efd_ >= 0) ::close(efd_);
}

int Control::wake_fd() {
  std::lock_guard<std::mutex> lock(efd_mu_);
  if (efd_ < 0) {
    efd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (efd_ < 0) throw Error(Status::NO_MEMORY, std::string("eventfd: ") + std::strerror(errno), errno);
    // An abort that came before the eventfd existed must still wake the poller.
    if (aborted()) {
      uint64_t one = 1;
      ssize_t r = ::write(efd_, &one, sizeof one);
      (void)r;
    }
  }
  return efd_;
}

void Control::abort() noexcept {
  if (!aborted_.exchange(true, std::memory_order_acq_rel)) {
    std::lock_guard<std::mutex> lock(efd_mu_);
    if (efd_ >= 0) {
      uint64_t one = 1;
      ssize_t r = ::write(efd_, &one, sizeof one);
      (void)r;
    }
  }
}

uint64_t Control::monotonic_ns() noexcept {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

void Control::expire_in(double seconds) noexcept {
  uint64_t now = monotonic_ns();
  // (NaN and <= 0: due now; a bound past ~292 years: none, as no deadline.)
  uint64_t d = now;
  if (seconds > 0) d = seconds < 9.0e9 ? now + static_cast<uint64_t>(seconds * 1e9) : 0;
  deadline_ns_.store(d == 0 ? 0 : std::max<uint64_t>(d, 1), std::memory_order_relaxed);
}

void Control::expire() {
  expired_.store(true, std::memory_order_release);  // (before the abort: see check())
  abort();  // (every thread of the job, and a poller, stops too)
  throw Error(Status::ABORTED, "deadline passed");
}

bool Control::due() noexcept {
  if (aborted()) return true;
  uint64_t d = deadline_ns_.load(std::memory_order_relaxed);
  if (d == 0 || monotonic_ns() < d) return false;
  expired_.store(true, std::memory_order_release);  // (before the abort, as in expire())
  abort();
  return true;
}

void Control::reset() noexcept {
  aborted_.store(false, std::memory_order_release);
  expired_.store(false, std::memory_order_relaxed);
  deadline_ns_.store(0, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  total_.store(0, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(efd_mu_);
  uint64_t v;
  while (efd_ >= 0 && ::read(efd_, &v, sizeof v) > 0) {
  }
}

namespace {

bool mul_overflows(uint64_t a, uint64_t b) {
  return a != 0 && b > std::numeric_limits<uint64_t>::max() / a;
}

[[noreturn]] void fail(Status s, const std::string& msg) { throw Error(s, msg); }

}  // namespace

Geometry::Geometry(uint64_t t, uint64_t b, uint64_t bb) : num_tensors(t), num_blocks(b), block_bytes(bb) {
  if (t == 0) fail(Status::PARAM_INVALID, "geometry: num_tensors must be > 0");
  if (b == 0) fail(Status::PARAM_INVALID, "geometry: num_blocks must be > 0");
  if (bb == 0) fail(Status::PARAM_INVALID, "geometry: block_bytes must be > 0");
  if (mul_overflows(b, bb) || b * bb > (uint64_t{1} << 62))
    fail(Status::PARAM_INVALID, "geometry: tensor size overflows");
}

Plan Plan::blocks(const Geometry& src, const Geometry& dst, const std::vector<int64_t>& src_blocks,
                  const std::vector<int64_t>& dst_blocks, uint64_t src_tensor_start,
                  uint64_t dst_tensor_start, uint64_t tensor_count) {
  if (src_blocks.size() != dst_blocks.size()) {
    std::ostringstream os;
    os << "src_blocks and dst_blocks differ in length (" << src_blocks.size() << " != " << dst_blocks.size()
       << ")";
    fail(Status::PARAM_INVALID, os.str());
  }
  if (src_blocks.empty()) fail(Status::PARAM_INVALID, "block lists are empty");
  if (src.block_bytes != dst.block_bytes) {
    std::ostringstream os;
    os << "block size differs: source " << src.block_bytes << " bytes, destination " << dst.block_bytes
       << " bytes";
    fail(Status::PARAM_INVALID, os.str());
  }
  if (tensor_count == 0) fail(Status::PARAM_INVALID, "tensor_count must be > 0");
  if (src_tensor_start > src.num_tensors || tensor_count > src.num_tensors - src_tensor_start) {
    std::ostringstream os;
    os << "source tensors [" << src_tensor_start << ", " << src_tensor_start + tensor_count
       << ") out of range for " << src.num_tensors << " tensors";
    fail(Status::OUT_OF_RANGE, os.str());
  }
  if (dst_tensor_start > dst.num_tensors || tensor_count > dst.num_tensors - dst_tensor_start) {
    std::ostringstream os;
    os << "destination tensors [" << dst_tensor_start << ", " << dst_tensor_start + tensor_count
       << ") out of range for " << dst.num_tensors << " tensors";
    fail(Status::OUT_OF_RANGE, os.str());
  }
  const uint64_t bb = src.block_bytes;
  // Runs of consecutive (src, dst) pairs, computed once and reused for every tensor.
  struct Run {
    uint64_t s, d, n;
  };
  std::vector<Run> runs;
  for (size_t i = 0; i < src_blocks.size(); ++i) {
    int64_t s = src_blocks[i], d = dst_blocks[i];
    if (s < 0 || static_cast<uint64_t>(s) >= src.num_blocks) {
      std::ostringstream os;
      os << "src_blocks[" << i << "] = " << s << " out of range [0, " << src.num_blocks << ")";
      fail(Status::OUT_OF_RANGE, os.str());
    }
    if (d < 0 || static_cast<uint64_t>(d) >= dst.num_blocks) {
      std::ostringstream os;
      os << "dst_blocks[" << i << "] = " << d << " out of range [0, " << dst.num_blocks << ")";
      fail(Status::OUT_OF_RANGE, os.str());
    }
    if (!runs.empty() && runs.back().s + runs.back().n == static_cast<uint64_t>(s) &&
        runs.back().d + runs.back().n == static_cast<uint64_t>(d)) {
      runs.back().n += 1;
    } else {
      runs.push_back({static_cast<uint64_t>(s), static_cast<uint64_t>(d), 1});
    }
  }
  Plan p;
  p.src_ = src;
  p.dst_ = dst;
  p.segs_.reserve(runs.size() * tensor_count);
  for (uint64_t k = 0; k < tensor_count; ++k) {
    for (const Run& r : runs) {
      p.segs_.push_back({src_tensor_start + k, r.s * bb, dst_tensor_start + k, r.d * bb, r.n * bb});
    }
  }
  p.finish();
  return p;
}

Plan Plan::from_segments(const Geometry& src, const Geometry& dst, std::vector<Segment> segs) {
  Plan p;
  p.src_ = src;
  p.dst_ = dst;
  p.segs_ = std::move(segs);
  p.finish();
  return p;
}

void Plan::finish() {
  if (segs_.empty()) fail(Status::PARAM_INVALID, "plan has no segments");
  const uint64_t st = src_.tensor_bytes(), dt = dst_.tensor_bytes();
  // Bounds first (on the unmerged input, so messages name what the caller sent).
  for (size_t i = 0; i < segs_.size(); ++i) {
    const Segment& s = segs_[i];
    // The stream is built only on failure: one per segment cost ~0.4 us each, most of
    // the planning time of a pull of a few thousand segments.
    if (s.nbytes == 0) {
      std::ostringstream os;
      os << "segment " << i << " has 0 bytes";
      fail(Status::PARAM_INVALID, os.str());
    }
    if (s.src_tensor >= src_.num_tensors || s.src_off > st || s.nbytes > st - s.src_off) {
      std::ostringstream os;
      os << "segment " << i << " reads outside the source (tensor " << s.src_tensor << ", offset " << s.src_off
         << ", " << s.nbytes << " bytes; source has " << src_.num_tensors << " tensors of " << st << " bytes)";
      fail(Status::OUT_OF_RANGE, os.str());
    }
    if (s.dst_tensor >= dst_.num_tensors || s.dst_off > dt || s.nbytes > dt - s.dst_off) {
      std::ostringstream os;
      os << "segment " << i << " writes outside the destination (tensor " << s.dst_tensor << ", offset "
         << s.dst_off << ", " << s.nbytes << " bytes; destination has " << dst_.num_tensors << " tensors of "
         << dt << " bytes)";
      fail(Status::OUT_OF_RANGE, os.str());
    }
  }
  // Two segments writing the same destination bytes make the result depend on
  // the mover's order (and race across threads): refuse them.
  std::vector<size_t> order(segs_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const Segment &x = segs_[a], &y = segs_[b];
    return x.dst_tensor != y.dst_tensor ? x.dst_tensor < y.dst_tensor : x.dst_off < y.dst_off;
  });
  for (size_t i = 1; i < order.size(); ++i) {
    const Segment &a = segs_[order[i - 1]], &b = segs_[order[i]];
    if (a.dst_tensor == b.dst_tensor && a.dst_off + a.nbytes > b.dst_off) {
      std::ostringstream os;
      os << "destinations overlap: tensor " << b.dst_tensor << " offset " << b.dst_off
         << " is written twice (segments " << order[i - 1] << " and " << order[i] << ")";
      fail(Status::OVERLAP, os.str());
    }
  }
  // Merge runs that are contiguous on both sides, keeping the caller's order.
  std::vector<Segment> merged;
  merged.reserve(segs_.size());
  for (const Segment& s : segs_) {
    if (!merged.empty()) {
      Segment& m = merged.back();
      if (m.src_tensor == s.src_tensor && m.dst_tensor == s.dst_tensor && m.src_off + m.nbytes == s.src_off &&
          m.dst_off + m.nbytes == s.dst_off) {
        m.nbytes += s.nbytes;
        continue;
      }
    }
    merged.push_back(s);
  }
  segs_.swap(merged);
  total_ = 0;
  for (const Segment& s : segs_) total_ += s.nbytes;
}

std::vector<Piece> resolve(const Plan& plan, const std::vector<uint64_t>& src_bases,
                           const std::vector<uint64_t>& dst_bases) {
  // An empty list leaves that side unresolved (0): a socket mover only knows its own side.
  const bool want_src = !src_bases.empty(), want_dst = !dst_bases.empty();
  if (want_src && src_bases.size() != plan.src().num_tensors) {
    std::ostringstream os;
    os << "expected " << plan.src().num_tensors << " source addresses, got " << src_bases.size();
    fail(Status::PARAM_INVALID, os.str());
  }
  if (want_dst && dst_bases.size() != plan.dst().num_tensors) {
    std::ostringstream os;
    os << "expected " << plan.dst().num_tensors << " destination addresses, got " << dst_bases.size();
    fail(Status::PARAM_INVALID, os.str());
  }
  std::vector<Piece> out;
  out.reserve(plan.segments().size());
  for (const Segment& s : plan.segments()) {
    uint64_t sb = want_src ? src_bases[s.src_tensor] : 0, db = want_dst ? dst_bases[s.dst_tensor] : 0;
    if ((want_src && sb == 0) || (want_dst && db == 0)) fail(Status::PARAM_INVALID, "null tensor address");
    out.push_back({want_src ? sb + s.src_off : 0, want_dst ? db + s.dst_off : 0, s.nbytes});
  }
  return out;
}

std::vector<std::vector<Piece>> split_even(const std::vector<Piece>& pieces, uint64_t total, size_t parts) {
  if (parts == 0) parts = 1;
  std::vector<std::vector<Piece>> out(parts);
  size_t idx = 0;
  uint64_t used = 0;  // bytes of pieces[idx] already assigned
  for (size_t p = 0; p < parts; ++p) {
    uint64_t want = total / parts + (p < total % parts ? 1 : 0);
    while (want > 0 && idx < pieces.size()) {
      const Piece& pc = pieces[idx];
      uint64_t take = std::min(want, pc.nbytes - used);
      out[p].push_back({pc.src + used, pc.dst + used, take});
      want -= take;
      used += take;
      if (used == pc.nbytes) {
        ++idx;
        used = 0;
      }
    }
  }
  return out;
}

}  // namespace aiodd
