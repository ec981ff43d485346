// Shared-memory segments: nameless, sealed memfds passed between processes as fds.
//
// A segment is a memfd (nothing in /dev/shm, so nothing outlives a killed process)
// whose size is sealed (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL): a process that
// maps a segment it received can rely on the file never shrinking under its
// mapping, so no copy through it can die with SIGBUS, whatever its creator does.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <sstream>
#include <system_error>

#include "core.hpp"

#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#endif
#ifndef MFD_ALLOW_SEALING
#define MFD_ALLOW_SEALING 0x0002U
#endif

namespace aiodd {

namespace {

void check_name(const std::string& name) {
  if (name.size() < 2 || name.size() > 240 || name[0] != '/' || name.find('/', 1) != std::string::npos)
    throw Error(Status::PARAM_INVALID,
                "shm label must look like '/name' (no other '/', at most 240 characters), got '" + name + "'");
}

[[noreturn]] void shm_fail(const std::string& what, const std::string& name, int e) {
  std::ostringstream os;
  os << what << " '" << name << "' failed: " << std::strerror(e);
  Status s = (e == ENOMEM || e == ENOSPC || e == EFBIG) ? Status::NO_MEMORY
             : (e == EACCES || e == EPERM)             ? Status::PERMISSION_DENIED
             : (e == EBADF || e == EINVAL)             ? Status::PARAM_INVALID
                                                       : Status::IO_ERROR;
  throw Error(s, os.str(), e);
}

#ifndef MADV_POPULATE_READ  // Linux 5.14; older headers
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

constexpr int kSizeSeals = F_SEAL_SHRINK | F_SEAL_GROW;
constexpr uint64_t kHugeAlign = 2ull << 20;
// Page tables are filled this much at a time, so that close() waits at most one step.
constexpr uint64_t kPopulateStep = 32ull << 20;

// mmap of the whole fd, starting on a 2 MiB boundary from 2 MiB on (so every whole
// 2 MiB of it can be one huge page where shmem_enabled allows, and the tensors of an
// allocated cache, at 2 MiB strides, start on one); page-aligned below.
void* map_aligned(int fd, uint64_t size, int prot) {
  if (size < kHugeAlign) return mmap(nullptr, size, prot, MAP_SHARED, fd, 0);
  void* area = mmap(nullptr, size + kHugeAlign, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (area == MAP_FAILED) return MAP_FAILED;
  uintptr_t start = reinterpret_cast<uintptr_t>(area);
  uintptr_t aligned = (start + kHugeAlign - 1) & ~(kHugeAlign - 1);
  void* addr = mmap(reinterpret_cast<void*>(aligned), size, prot, MAP_SHARED | MAP_FIXED, fd, 0);
  if (addr == MAP_FAILED) {
    int e = errno;
    munmap(area, size + kHugeAlign);
    errno = e;
    return MAP_FAILED;
  }
  // Give back the reservation around it.
  if (aligned > start) munmap(area, aligned - start);
  uintptr_t end = aligned + size, area_end = start + size + kHugeAlign;
  if (area_end > end) munmap(reinterpret_cast<void*>(end), area_end - end);
  return addr;
}

// Fills the page tables of [addr, addr + size) (no page faults on later access): one
// madvise per step; a kernel without MADV_POPULATE_* (< 5.14) gets a read of every page.
void populate_range(void* addr, uint64_t size, bool write) {
  if (madvise(addr, size, write ? MADV_POPULATE_WRITE : MADV_POPULATE_READ) == 0) return;
  if (errno != EINVAL) return;  // nothing to gain (ENOMEM, EFAULT): access will fault as usual
  const long page = sysconf(_SC_PAGESIZE);
  const volatile char* p = static_cast<const volatile char*>(addr);
  for (uint64_t off = 0; off < size; off += static_cast<uint64_t>(page)) (void)p[off];
}

}  // namespace

ShmSegment* ShmSegment::create(const std::string& name, uint64_t size) {
  check_name(name);
  if (size == 0) throw Error(Status::PARAM_INVALID, "shm size must be > 0");
  int fd = memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) shm_fail("memfd_create", name, errno);
  // posix_fallocate reserves the pages now, so a full tmpfs is an error here
  // instead of a SIGBUS on first touch in the middle of a transfer.
  int rc = ftruncate(fd, static_cast<off_t>(size));
  if (rc == 0) rc = posix_fallocate(fd, 0, static_cast<off_t>(size));
  else rc = errno;
  if (rc != 0) {
    ::close(fd);
    shm_fail("allocating shared memory", name, rc);
  }
  void* addr = map_aligned(fd, size, PROT_READ | PROT_WRITE);
  if (addr == MAP_FAILED) {
    int e = errno;
    ::close(fd);
    shm_fail("mmap", name, e);
  }
  // Zero-fill and map every page now, once, at allocation: the creator's first writes
  // then take no page faults (a write fault per 4 KiB page otherwise), and the pages are
  // up to date, so a peer's mapping of them faults in 64 KiB steps instead of per page.
  populate_range(addr, size, true);
  // Sealed after the mapping: F_SEAL_WRITE is not among them, so the mapping
  // stays writable; the size can never change again, by anyone.
  if (fcntl(fd, F_ADD_SEALS, kSizeSeals | F_SEAL_SEAL) != 0) {
    int e = errno;
    munmap(addr, size);
    ::close(fd);
    shm_fail("sealing", name, e);
  }
  std::unique_ptr<ShmSegment> seg(new ShmSegment());
  seg->name_ = name;
  seg->size_ = size;
  seg->addr_ = addr;
  seg->fd_ = fd;
  seg->owner_ = true;
  return seg.release();
}

ShmSegment* ShmSegment::from_fd(int fd, uint64_t size, bool writable, const std::string& name) {
  if (fd < 0) throw Error(Status::PARAM_INVALID, "shm fd must be >= 0");
  if (size == 0) throw Error(Status::PARAM_INVALID, "shm size must be > 0");
  struct stat st;
  if (fstat(fd, &st) != 0) shm_fail("fstat", name, errno);
  if (!S_ISREG(st.st_mode))
    throw Error(Status::PERMISSION_DENIED, "shm segment '" + name + "' is not a memfd (refused)");
  // Only a segment that can never shrink is safe to map: a shorter file would
  // turn our next access past its end into a SIGBUS.
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    std::ostringstream os;
    os << "shm segment '" << name << "' is not sealed against shrinking (refused: a peer could "
       << "truncate it under our mapping)";
    throw Error(Status::PERMISSION_DENIED, os.str(), seals < 0 ? errno : 0);
  }
  if (static_cast<uint64_t>(st.st_size) < size) {
    std::ostringstream os;
    os << "shm segment '" << name << "' holds " << st.st_size << " bytes, " << size << " expected";
    throw Error(Status::OUT_OF_RANGE, os.str());
  }
  int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) shm_fail("dup", name, errno);
  void* addr = map_aligned(own, size, writable ? PROT_READ | PROT_WRITE : PROT_READ);
  if (addr == MAP_FAILED) {
    int e = errno;
    ::close(own);
    shm_fail("mmap", name, e);
  }
  std::unique_ptr<ShmSegment> seg(new ShmSegment());
  seg->name_ = name;
  seg->size_ = size;
  seg->addr_ = addr;
  seg->fd_ = own;
  seg->owner_ = false;
  seg->writable_ = writable;
  seg->start_populate();
  return seg.release();
}

// A mapping of a peer's segment gets its page tables filled on a thread of its own, at
// once: copies through it then take no page faults, from the first pull of any block on
// (the cost, ~0.1 s per GiB here, is what faulting it in would cost anyway), and neither
// the caller (an event loop) nor the first transfer waits for it.
void ShmSegment::start_populate() {
  try {
    populater_ = std::thread([this] {
      char* base = static_cast<char*>(addr_);
      for (uint64_t off = 0; off < size_ && !stop_.load(std::memory_order_relaxed); off += kPopulateStep)
        populate_range(base + off, std::min(kPopulateStep, size_ - off), writable_);
      populated_.store(!stop_.load(std::memory_order_relaxed), std::memory_order_release);
    });
  } catch (const std::system_error&) {
    // No thread: copies fault the pages in as they go, as without this.
  }
}

void ShmSegment::close() {
  if (populater_.joinable()) {
    // Never unmap under it: it would fill the page tables of whatever is mapped there next.
    stop_.store(true, std::memory_order_relaxed);
    populater_.join();
  }
  if (addr_) {
    munmap(addr_, size_);
    addr_ = nullptr;
  }
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

ShmSegment::~ShmSegment() { close(); }

}  // namespace aiodd
