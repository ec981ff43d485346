// Movers within one host: local memcpy and cross-process CMA.
#include <limits.h>
#include <sched.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <sstream>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "core.hpp"

namespace aiodd {

namespace {

// Below this a plan is copied on the calling thread: starting threads costs
// more than it saves, and tiny pulls are dominated by per-call overhead.
constexpr uint64_t kParallelMin = 8ull << 20;

size_t thread_count(uint64_t total, int threads) {
  if (threads <= 1 || total < kParallelMin) return 1;
  uint64_t by_size = total / (kParallelMin / 2);
  return static_cast<size_t>(std::max<uint64_t>(1, std::min<uint64_t>(threads, by_size)));
}

// ---- copy kernels ----
// Measured on the 2-core EPYC (Zen 5) dev VM, 256 KiB segments gathered from a memfd
// mapping (docs/performance.md, "shm and alignment"): a copy far bigger than the last-level
// cache runs ~1.2-1.4x faster with non-temporal (streaming) stores, which skip reading the
// destination lines into the cache first, than with glibc's memcpy / rep movsb, whatever
// the relative alignment of source and destination. Below the cache size memcpy wins (and
// leaves the bytes in cache for the caller), so small transfers keep it.

std::atomic<int> g_copy_mode{static_cast<int>(CopyMode::AUTO)};

// Pieces shorter than this are not worth a streaming loop (and its fence).
constexpr uint64_t kStreamMinPiece = 4096;

// The last-level cache size, within [16, 32] MiB: sysconf reports the host's whole L3 in
// some VMs (384 MiB on the dev VM, whose CPUID says 32). Measured there (2 threads, paired):
// streaming is 1.1x memcpy from 16 MiB, 1.1-1.2x from 32 MiB on, and slower below 8 MiB
// (1.3x the time at 4 MiB, 2.6x at 256 KiB, whose bytes memcpy leaves in the cache).
uint64_t stream_min_total() {
  static const uint64_t v = [] {
    long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    uint64_t llc = l3 > 0 ? static_cast<uint64_t>(l3) : (32ull << 20);
    return std::clamp<uint64_t>(llc, 16ull << 20, 32ull << 20);
  }();
  return v;
}

#if defined(__x86_64__)
bool cpu_has_avx2() {
  static const bool v = __builtin_cpu_supports("avx2");
  return v;
}

// Streaming copy: a head brings dst to a 64-byte (cache line) boundary, then whole lines
// are written with aligned non-temporal stores (loads may be unaligned: any relative
// misalignment of src and dst costs nothing measurable), then the tail. The fence
// orders the stores before anything the caller does next (another thread reads them
// after the join / the job's completion).
__attribute__((target("avx2"))) void stream_copy(char* d, const char* s, uint64_t n) {
  uint64_t head = (0 - reinterpret_cast<uintptr_t>(d)) & 63;
  if (head > n) head = n;
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  uint64_t i = 0;
  for (; i + 128 <= n; i += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
    __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
  }
  _mm_sfence();
  std::memcpy(d + i, s + i, n - i);
}
#else
bool cpu_has_avx2() { return false; }
void stream_copy(char* d, const char* s, uint64_t n) { std::memcpy(d, s, n); }
#endif

// Whether this transfer streams its (long enough) pieces.
bool use_stream(uint64_t total) {
  if (!cpu_has_avx2()) return false;
  switch (static_cast<CopyMode>(g_copy_mode.load(std::memory_order_relaxed))) {
    case CopyMode::MEMCPY:
      return false;
    case CopyMode::STREAM:
      return true;
    case CopyMode::AUTO:
    default:
      return total >= stream_min_total();
  }
}

void copy_pieces(const std::vector<Piece>& pieces, Control& ctl, bool stream) {
  const uint64_t min_piece = copy_mode() == CopyMode::STREAM ? 0 : kStreamMinPiece;
  for (const Piece& p : pieces) {
    uint64_t off = 0;
    while (off < p.nbytes) {
      ctl.check();
      uint64_t n = std::min(kChunk, p.nbytes - off);
      char* d = reinterpret_cast<char*>(p.dst + off);
      const char* s = reinterpret_cast<const char*>(p.src + off);
      if (stream && n >= min_piece)
        stream_copy(d, s, n);
      else
        std::memcpy(d, s, n);
      off += n;
      ctl.add_done(n);
    }
  }
}

Status errno_status(int e) {
  switch (e) {
    case EPERM:
    case EACCES:
      return Status::PERMISSION_DENIED;
    case ESRCH:
      return Status::NO_SUCH_PROCESS;
    case ENOMEM:
      return Status::NO_MEMORY;
    case EFAULT:
      return Status::OUT_OF_RANGE;
    default:
      return Status::IO_ERROR;
  }
}

[[noreturn]] void cma_fail(const char* what, int pid, int e) {
  std::ostringstream os;
  os << what << " on pid " << pid << " failed: " << std::strerror(e);
  if (e == EPERM)
    os << " (the kernel's ptrace policy refuses cross-process memory access; see "
          "/proc/sys/kernel/yama/ptrace_scope, or use the shm or tcp data path)";
  else if (e == ESRCH)
    os << " (the peer process is gone)";
  else if (e == EFAULT)
    os << " (an address is not mapped in one of the processes: memory was freed or unregistered)";
  throw Error(errno_status(e), os.str(), e);
}

// One thread's share of a CMA transfer: batches of up to IOV_MAX iovecs and
// kChunk bytes per system call, resuming after partial transfers.
void cma_pieces(int pid, const std::vector<Piece>& pieces, bool read, Control& ctl) {
  const size_t max_iov = static_cast<size_t>(iov_max());
  std::vector<struct iovec> local, remote;
  local.reserve(max_iov);
  remote.reserve(max_iov);
  size_t idx = 0;
  uint64_t used = 0;
  while (idx < pieces.size()) {
    ctl.check();
    local.clear();
    remote.clear();
    uint64_t batch = 0;
    size_t j = idx;
    uint64_t u = used;
    while (j < pieces.size() && local.size() < max_iov && batch < kChunk) {
      const Piece& p = pieces[j];
      uint64_t take = std::min(p.nbytes - u, kChunk - batch);
      // read: local = dst, remote = src. write: local = src, remote = dst.
      uint64_t l = read ? p.dst + u : p.src + u;
      uint64_t r = read ? p.src + u : p.dst + u;
      local.push_back({reinterpret_cast<void*>(l), take});
      remote.push_back({reinterpret_cast<void*>(r), take});
      batch += take;
      u += take;
      if (u == p.nbytes) {
        ++j;
        u = 0;
      }
    }
    // Issue the batch; a partial result moves the window forward and retries.
    size_t first = 0;
    uint64_t left = batch;
    while (left > 0) {
      ssize_t n = read ? process_vm_readv(pid, &local[first], local.size() - first, &remote[first],
                                          remote.size() - first, 0)
                       : process_vm_writev(pid, &local[first], local.size() - first, &remote[first],
                                           remote.size() - first, 0);
      if (n < 0) {
        if (errno == EINTR) continue;
        cma_fail(read ? "process_vm_readv" : "process_vm_writev", pid, errno);
      }
      if (n == 0) cma_fail(read ? "process_vm_readv" : "process_vm_writev", pid, EFAULT);
      uint64_t got = static_cast<uint64_t>(n);
      left -= got;
      ctl.add_done(got);
      while (got > 0) {
        uint64_t len = local[first].iov_len;
        if (got >= len) {
          got -= len;
          ++first;
        } else {
          local[first].iov_base = static_cast<char*>(local[first].iov_base) + got;
          remote[first].iov_base = static_cast<char*>(remote[first].iov_base) + got;
          local[first].iov_len -= got;
          remote[first].iov_len -= got;
          got = 0;
        }
      }
      if (left > 0) ctl.check();
    }
    idx = j;
    used = u;
  }
}

void cma_run(int pid, const std::vector<Piece>& pieces, uint64_t total, bool read, Control& ctl, int threads) {
  if (pid <= 0) throw Error(Status::PARAM_INVALID, "pid must be > 0");
  ctl.set_total(total);
  size_t n = thread_count(total, threads);
  if (n == 1) {
    cma_pieces(pid, pieces, read, ctl);
    return;
  }
  auto parts = split_even(pieces, total, n);
  run_parallel(n, ctl, [&](size_t i) { cma_pieces(pid, parts[i], read, ctl); });
}

std::vector<Piece> resolve_both(const Plan& plan, const std::vector<uint64_t>& src,
                                const std::vector<uint64_t>& dst) {
  if (src.empty() || dst.empty()) throw Error(Status::PARAM_INVALID, "both address lists are required");
  return resolve(plan, src, dst);
}

// ---- layered transfers: one job, many layers, a signal per landed layer ----
// The pieces of layer L are pieces[bounds[L-1] .. bounds[L]) (one piece per plan segment,
// in the plan's order). Each layer is cut into chunks of at most kLayerChunk bytes, and the
// n threads (chosen, like the streaming-store decision, on the whole transfer) take the
// chunks in layer order from one shared counter: a thread that starts late (or loses its
// CPU for a while) delays no layer, the others take its share. Once every chunk of layer L
// has landed, L is marked done; layers are signalled strictly in order (after checking
// the lease, when one is given): 1 is written to the eventfd per layer, so the count read
// off it is always a count of whole layers landed, from layer 0 on.
constexpr uint64_t kLayerChunk = 1ull << 20;
// A yield after a layer's signal that took longer than this gave the CPU to another
// process's thread, not only to the loop (see run_layered).
constexpr std::chrono::microseconds kYieldBudget{500};

template <class CopyFn>
void run_layered(const std::vector<Piece>& pieces, const std::vector<uint64_t>& bounds, Control& ctl,
                 size_t n, int efd, uint64_t lease_addr, uint64_t gen, CopyFn copy) {
  if (efd < 0) throw Error(Status::PARAM_INVALID, "layered transfer: the signal fd must be >= 0");
  if (bounds.empty()) throw Error(Status::PARAM_INVALID, "layered transfer: no layers");
  uint64_t prev = 0;
  for (uint64_t b : bounds) {
    if (b <= prev)
      throw Error(Status::PARAM_INVALID, "layered transfer: layer bounds must ascend (no empty layer)");
    prev = b;
  }
  if (prev != pieces.size())
    throw Error(Status::PARAM_INVALID, "layered transfer: the last layer bound must be the plan's segment count");
  const size_t layers = bounds.size();
  // A chunk is a run of at most kLayerChunk bytes of one layer: from byte `off` of piece
  // `piece` on, `bytes` long, across the pieces that follow. Only the runs are listed
  // here (one allocation); each thread cuts its chunk's pieces when it takes it, so the
  // first bytes move without a per-chunk allocation for the whole transfer first.
  struct Chunk {
    size_t piece;
    uint64_t off, bytes;
    size_t layer;
  };
  std::vector<Chunk> chunks;
  chunks.reserve(static_cast<size_t>(ctl.total() / kLayerChunk) + layers + 1);
  std::vector<std::atomic<uint64_t>> left(layers);
  size_t start = 0;
  for (size_t l = 0; l < layers; ++l) {
    uint64_t layer_bytes = 0, fill = kLayerChunk;  // fill: bytes in the open chunk
    for (size_t k = start; k < bounds[l]; ++k) {
      const Piece& p = pieces[k];
      uint64_t off = 0;
      while (off < p.nbytes) {
        if (fill == kLayerChunk) {
          chunks.push_back({k, off, 0, l});
          fill = 0;
        }
        uint64_t take = std::min(p.nbytes - off, kLayerChunk - fill);
        chunks.back().bytes += take;
        fill += take;
        off += take;
      }
      layer_bytes += p.nbytes;
    }
    left[l].store(layer_bytes, std::memory_order_relaxed);
    start = bounds[l];
  }
  auto cut = [&](const Chunk& ch, std::vector<Piece>& out) {
    out.clear();
    size_t k = ch.piece;
    uint64_t off = ch.off, rest = ch.bytes;
    while (rest > 0) {
      const Piece& p = pieces[k];
      uint64_t take = std::min(p.nbytes - off, rest);
      out.push_back({p.src + off, p.dst + off, take});
      rest -= take;
      off += take;
      if (off == p.nbytes) {
        ++k;
        off = 0;
      }
    }
  };
  std::atomic<size_t> next{0};
  std::atomic<bool> yielding{true};  // see the yield below
  std::mutex mu;  // guards landed and signalled
  std::vector<char> landed(layers, 0);
  size_t signalled = 0;
  auto signal = [&](size_t l) {
    if (lease_addr != 0 && lease_gen(lease_addr) != gen) {
      std::ostringstream os;
      os << "the owner revoked the cache's lease while layer " << l
         << " moved (it was unregistered, freed or re-registered): its bytes are not valid";
      throw Error(Status::FAILED, os.str());
    }
    uint64_t one = 1;
    ssize_t r;
    do {
      r = ::write(efd, &one, sizeof one);
    } while (r < 0 && errno == EINTR);
    if (r < 0) throw Error(Status::IO_ERROR, std::string("layer signal: ") + std::strerror(errno), errno);
  };
  run_parallel(n, ctl, [&](size_t) {
    std::vector<Piece> part;  // this thread's current chunk, cut from the pieces
    for (;;) {
      ctl.check();
      const size_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= chunks.size()) return;
      cut(chunks[c], part);
      copy(part);
      const size_t l = chunks[c].layer;
      const uint64_t bytes = chunks[c].bytes;
      // acq_rel: whoever takes a layer to 0 sees every thread's bytes of it.
      if (left[l].fetch_sub(bytes, std::memory_order_acq_rel) != bytes) continue;
      bool any = false;
      {
        std::lock_guard<std::mutex> lock(mu);
        landed[l] = 1;
        while (signalled < layers && landed[signalled]) {
          signal(signalled);
          ++signalled;
          any = true;
        }
      }
      // The write woke the loop thread, but under EEVDF a waking thread does not preempt
      // a running one before its slice ends (~3 ms measured on the 2-core dev VM, with
      // every core busy moving bytes): the layer would be handed over that much later.
      // Yielding the CPU lets the loop take the layer now; it costs ~1 us per layer, or
      // the loop's hand-over (~0.1 ms). With other processes' threads runnable too, a
      // yield hands this mover's CPU to them for a whole slice of theirs (measured: a
      // 256 MiB layered copy beside two CPU-bound processes took 3x copy_local's time,
      // a slice per layer): once one yield took longer than kYieldBudget, this job
      // yields no more (its layers are then handed over when the loop's turn comes).
      if (any && yielding.load(std::memory_order_relaxed)) {
        const auto t0 = std::chrono::steady_clock::now();
        sched_yield();
        if (std::chrono::steady_clock::now() - t0 > kYieldBudget)
          yielding.store(false, std::memory_order_relaxed);
      }
    }
  });
}

}  // namespace

long iov_max() {
  long v = sysconf(_SC_IOV_MAX);
  return v > 0 ? v : IOV_MAX;
}

CopyMode copy_mode() { return static_cast<CopyMode>(g_copy_mode.load(std::memory_order_relaxed)); }

void set_copy_mode(CopyMode mode) {
  int m = static_cast<int>(mode);
  if (m < static_cast<int>(CopyMode::AUTO) || m > static_cast<int>(CopyMode::STREAM))
    throw Error(Status::PARAM_INVALID, "copy mode must be AUTO (0), MEMCPY (1) or STREAM (2)");
  g_copy_mode.store(m, std::memory_order_relaxed);
}

bool stream_supported() { return cpu_has_avx2(); }

uint64_t stream_threshold() { return stream_min_total(); }

void copy_local(const Plan& plan, const std::vector<uint64_t>& src_bases, const std::vector<uint64_t>& dst_bases,
                Control& ctl, int threads) {
  std::vector<Piece> pieces = resolve_both(plan, src_bases, dst_bases);
  ctl.set_total(plan.total_bytes());
  const bool stream = use_stream(plan.total_bytes());
  size_t n = thread_count(plan.total_bytes(), threads);
  if (n == 1) {
    copy_pieces(pieces, ctl, stream);
    return;
  }
  auto parts = split_even(pieces, plan.total_bytes(), n);
  run_parallel(n, ctl, [&](size_t i) { copy_pieces(parts[i], ctl, stream); });
}

void cma_read(int pid, const Plan& plan, const std::vector<uint64_t>& remote_src,
              const std::vector<uint64_t>& local_dst, Control& ctl, int threads) {
  cma_run(pid, resolve_both(plan, remote_src, local_dst), plan.total_bytes(), true, ctl, threads);
}

void cma_write(int pid, const Plan& plan, const std::vector<uint64_t>& local_src,
               const std::vector<uint64_t>& remote_dst, Control& ctl, int threads) {
  cma_run(pid, resolve_both(plan, local_src, remote_dst), plan.total_bytes(), false, ctl, threads);
}

void copy_local_layered(const Plan& plan, const std::vector<uint64_t>& src_bases,
                        const std::vector<uint64_t>& dst_bases, const std::vector<uint64_t>& bounds,
                        Control& ctl, int threads, int efd, uint64_t lease_addr, uint64_t lease_gen_) {
  std::vector<Piece> pieces = resolve_both(plan, src_bases, dst_bases);
  const uint64_t total = plan.total_bytes();
  ctl.set_total(total);
  const bool stream = use_stream(total);  // on the whole transfer, not per layer
  run_layered(pieces, bounds, ctl, thread_count(total, threads), efd, lease_addr, lease_gen_,
              [&](const std::vector<Piece>& part) { copy_pieces(part, ctl, stream); });
}

void cma_read_layered(int pid, const Plan& plan, const std::vector<uint64_t>& remote_src,
                      const std::vector<uint64_t>& local_dst, const std::vector<uint64_t>& bounds,
                      Control& ctl, int threads, int efd, uint64_t lease_addr, uint64_t lease_gen_) {
  if (pid <= 0) throw Error(Status::PARAM_INVALID, "pid must be > 0");
  std::vector<Piece> pieces = resolve_both(plan, remote_src, local_dst);
  const uint64_t total = plan.total_bytes();
  ctl.set_total(total);
  run_layered(pieces, bounds, ctl, thread_count(total, threads), efd, lease_addr, lease_gen_,
              [&](const std::vector<Piece>& part) { cma_pieces(pid, part, true, ctl); });
}

StartedJob* start_layered(int pid, const Plan& plan, std::vector<uint64_t> src, std::vector<uint64_t> dst,
                          std::vector<uint64_t> bounds, Control& ctl, int threads, int efd,
                          uint64_t lease_addr, uint64_t lease_gen, int nice) {
  if (pid < 0) throw Error(Status::PARAM_INVALID, "pid must be >= 0 (0: a local copy)");
  auto body = [=, &plan, &ctl, src = std::move(src), dst = std::move(dst), bounds = std::move(bounds)]() {
    if (lease_addr != 0 && !lease_enter(lease_addr, lease_gen))
      throw Error(Status::STALE, "the peer's lease of the cache is not current: nothing moved");
    struct Leave {
      uint64_t addr;
      ~Leave() {
        if (addr != 0) lease_exit(addr);
      }
    } leave{lease_addr};
    if (pid == 0)
      copy_local_layered(plan, src, dst, bounds, ctl, threads, efd, lease_addr, lease_gen);
    else
      cma_read_layered(pid, plan, src, dst, bounds, ctl, threads, efd, lease_addr, lease_gen);
  };
  return new StartedJob(std::move(body), nice);
}

int cma_probe(int pid) {
  // Address 1 is never mapped: EFAULT means the kernel let us in (the
  // permission check comes first), EPERM / ESRCH say why it would not.
  char byte;
  struct iovec l{&byte, 1}, r{reinterpret_cast<void*>(1), 1};
  ssize_t n = process_vm_readv(pid, &l, 1, &r, 1, 0);
  if (n >= 0 || errno == EFAULT) return 0;
  return errno;
}

}  // namespace aiodd
