// The fast lane's copy (aiodatadist/_lanes.py): one small pull of blocks, on the calling
// thread, under the remote cache's lease. Geometries, address lists and the lease slot
// are fixed when the lane is made, so a pull costs its plan, the lease check and the copy.
#include "core.hpp"

namespace aiodd {

LaneCopy::LaneCopy(int pid, const Geometry& src, const Geometry& dst, std::vector<uint64_t> src_bases,
                   std::vector<uint64_t> dst_bases, uint64_t lease_addr, uint64_t lease_gen,
                   uint64_t max_bytes)
    : pid_(pid), src_(src), dst_(dst), src_bases_(std::move(src_bases)), dst_bases_(std::move(dst_bases)),
      lease_addr_(lease_addr), lease_gen_(lease_gen), max_bytes_(max_bytes) {
  if (pid_ < 0) throw Error(Status::PARAM_INVALID, "pid must be >= 0");
  if (src_bases_.size() != src_.num_tensors || dst_bases_.size() != dst_.num_tensors)
    throw Error(Status::PARAM_INVALID, "an address list does not match its geometry");
  if (lease_addr_ != 0 && lease_gen_ == 0) throw Error(Status::PARAM_INVALID, "a lease needs a generation");
}

int64_t LaneCopy::pull(const std::vector<int64_t>& src_blocks, const std::vector<int64_t>& dst_blocks,
                       uint64_t src_tensor_start, uint64_t dst_tensor_start, uint64_t tensor_count) const {
  Plan plan;
  try {
    plan = Plan::blocks(src_, dst_, src_blocks, dst_blocks, src_tensor_start, dst_tensor_start, tensor_count);
  } catch (const Error&) {
    return kLaneDeclined;  // the caller's whole path says what is wrong
  }
  if (plan.total_bytes() > max_bytes_) return kLaneDeclined;
  if (lease_addr_ != 0 && !lease_enter(lease_addr_, lease_gen_)) return kLaneStale;
  struct Exit {
    uint64_t addr;
    ~Exit() {
      if (addr != 0) lease_exit(addr);
    }
  } exit{lease_addr_};
  Control ctl;
  if (pid_ > 0) {
    cma_read(pid_, plan, src_bases_, dst_bases_, ctl, 1);
  } else {
    copy_local(plan, src_bases_, dst_bases_, ctl, 1);
  }
  if (lease_addr_ != 0 && lease_gen(lease_addr_) != lease_gen_) return kLaneRevoked;
  return static_cast<int64_t>(plan.total_bytes());
}

}  // namespace aiodd
