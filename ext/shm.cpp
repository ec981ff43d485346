// POSIX shared-memory segments that another process can map by name.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <sstream>

#include "core.hpp"

namespace aiodd {

namespace {

void check_name(const std::string& name) {
  if (name.size() < 2 || name.size() > 250 || name[0] != '/' || name.find('/', 1) != std::string::npos)
    throw Error(Status::PARAM_INVALID, "shm name must look like '/name' (no other '/', at most 250 characters), got '" +
                                           name + "'");
}

[[noreturn]] void shm_fail(const std::string& what, const std::string& name, int e) {
  std::ostringstream os;
  os << what << " '" << name << "' failed: " << std::strerror(e);
  Status s = e == ENOENT ? Status::PARAM_INVALID
             : (e == ENOMEM || e == ENOSPC || e == EFBIG) ? Status::NO_MEMORY
             : (e == EACCES || e == EPERM) ? Status::PERMISSION_DENIED
                                           : Status::IO_ERROR;
  throw Error(s, os.str(), e);
}

}  // namespace

ShmSegment* ShmSegment::create(const std::string& name, uint64_t size) {
  check_name(name);
  if (size == 0) throw Error(Status::PARAM_INVALID, "shm size must be > 0");
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) shm_fail("shm_open", name, errno);
  // posix_fallocate reserves the pages now, so a full /dev/shm is an error
  // here instead of a SIGBUS on first touch in the middle of a transfer.
  int rc = ftruncate(fd, static_cast<off_t>(size));
  if (rc == 0) rc = posix_fallocate(fd, 0, static_cast<off_t>(size));
  else rc = errno;
  if (rc != 0) {
    ::close(fd);
    shm_unlink(name.c_str());
    shm_fail("allocating shared memory", name, rc);
  }
  void* addr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int e = errno;
  ::close(fd);
  if (addr == MAP_FAILED) {
    shm_unlink(name.c_str());
    shm_fail("mmap", name, e);
  }
  std::unique_ptr<ShmSegment> seg(new ShmSegment());
  seg->name_ = name;
  seg->size_ = size;
  seg->addr_ = addr;
  seg->owner_ = true;
  return seg.release();
}

ShmSegment* ShmSegment::open(const std::string& name, uint64_t size, bool writable) {
  check_name(name);
  int fd = shm_open(name.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC, 0);
  if (fd < 0) shm_fail("shm_open", name, errno);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    shm_fail("fstat", name, e);
  }
  if (size == 0 || static_cast<uint64_t>(st.st_size) < size) {
    ::close(fd);
    std::ostringstream os;
    os << "shm '" << name << "' holds " << st.st_size << " bytes, " << size << " expected";
    throw Error(Status::OUT_OF_RANGE, os.str());
  }
  void* addr = mmap(nullptr, size, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
  int e = errno;
  ::close(fd);
  if (addr == MAP_FAILED) shm_fail("mmap", name, e);
  std::unique_ptr<ShmSegment> seg(new ShmSegment());
  seg->name_ = name;
  seg->size_ = size;
  seg->addr_ = addr;
  seg->owner_ = false;
  seg->writable_ = writable;
  return seg.release();
}

void ShmSegment::unlink() {
  if (owner_ && !unlinked_) {
    shm_unlink(name_.c_str());
    unlinked_ = true;
  }
}

void ShmSegment::close() {
  if (addr_) {
    munmap(addr_, size_);
    addr_ = nullptr;
  }
  unlink();
}

ShmSegment::~ShmSegment() { close(); }

}  // namespace aiodd
