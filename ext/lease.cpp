// Leases: one-sided access to a peer's cache under a generation word in shared memory.
//
// A lease page is a sealed memfd segment of slots; its owner (the process whose
// caches the slots describe) writes each cache's generation into its slot, a
// peer maps the page and brackets every one-sided copy of that cache with
// lease_enter / lease_exit. The owner revokes by marking the generation revoked
// and waiting (futex, shared between processes) until no reader is left.
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>

#include "core.hpp"

namespace aiodd {

namespace {

static_assert(sizeof(LeaseSlot) == kLeaseSlotBytes, "a lease slot is 16 bytes");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "lease words must be lock-free");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "lease words must be lock-free");

LeaseSlot* slot_at(uint64_t addr) {
  if (addr == 0 || addr % alignof(LeaseSlot) != 0)
    throw Error(Status::PARAM_INVALID, "lease slot address is null or misaligned");
  return reinterpret_cast<LeaseSlot*>(addr);
}

// Shared futex (no FUTEX_PRIVATE_FLAG): the waiter and the waker live in different processes.
long futex(std::atomic<uint32_t>* word, int op, uint32_t val, const struct timespec* ts) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, ts, nullptr, 0);
}

}  // namespace

bool lease_enter(uint64_t addr, uint64_t gen) {
  LeaseSlot* s = slot_at(addr);
  s->readers.fetch_add(1, std::memory_order_seq_cst);
  // seq_cst on both sides: either the revoker sees our reader count, or we see its
  // revoked generation (never neither).
  if (s->gen.load(std::memory_order_seq_cst) != gen) {
    lease_exit(addr);
    return false;
  }
  return true;
}

void lease_exit(uint64_t addr) {
  LeaseSlot* s = slot_at(addr);
  uint32_t prev = s->readers.fetch_sub(1, std::memory_order_seq_cst);
  if (prev == 1 && (s->gen.load(std::memory_order_seq_cst) & kLeaseRevoked) != 0)
    futex(&s->readers, FUTEX_WAKE, INT_MAX, nullptr);
}

void lease_publish(uint64_t addr, uint64_t gen) {
  slot_at(addr)->gen.store(gen, std::memory_order_seq_cst);
}

uint64_t lease_gen(uint64_t addr) { return slot_at(addr)->gen.load(std::memory_order_seq_cst); }

uint32_t lease_readers(uint64_t addr) {
  return slot_at(addr)->readers.load(std::memory_order_seq_cst);
}

void lease_set_fences(uint64_t addr, uint32_t n) {
  slot_at(addr)->fences.store(n, std::memory_order_seq_cst);
}

uint32_t lease_fences(uint64_t addr) {
  return slot_at(addr)->fences.load(std::memory_order_seq_cst);
}

bool lease_revoke(uint64_t addr, double timeout_s) {
  LeaseSlot* s = slot_at(addr);
  if (!(timeout_s >= 0) || std::isinf(timeout_s)) throw Error(Status::PARAM_INVALID, "lease timeout must be >= 0 and finite");
  uint64_t old = s->gen.load(std::memory_order_seq_cst);
  s->gen.store(old | kLeaseRevoked, std::memory_order_seq_cst);
  using clock = std::chrono::steady_clock;
  auto end = clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
  for (;;) {
    uint32_t r = s->readers.load(std::memory_order_seq_cst);
    if (r == 0) return true;
    auto left = end - clock::now();
    if (left <= clock::duration::zero()) break;
    auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    struct timespec ts;
    ts.tv_sec = static_cast<time_t>(ns / 1000000000);
    ts.tv_nsec = static_cast<long>(ns % 1000000000);
    // Sleeps until a reader's exit wakes us (or r changed already: EAGAIN), never polls.
    futex(&s->readers, FUTEX_WAIT, r, &ts);
  }
  // Still read at the bound: the lease stands as it was.
  s->gen.store(old, std::memory_order_seq_cst);
  return false;
}

}  // namespace aiodd
