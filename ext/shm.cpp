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

#include <cerrno>
#include <cstring>
#include <memory>
#include <sstream>

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

constexpr int kSizeSeals = F_SEAL_SHRINK | F_SEAL_GROW;

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
  void* addr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (addr == MAP_FAILED) {
    int e = errno;
    ::close(fd);
    shm_fail("mmap", name, e);
  }
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
  void* addr = mmap(nullptr, size, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, own, 0);
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
  return seg.release();
}

void ShmSegment::close() {
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
