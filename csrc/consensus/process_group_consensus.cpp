#include "csrc/consensus/process_group_consensus.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>
#include <thread>

namespace stepguard {
namespace consensus {

namespace {
constexpr auto kCheckInGrace = std::chrono::seconds(5);

std::string check_in_key(std::int64_t step, int rank) {
  return "stepguard/failed_step/" + std::to_string(step) + "/" + std::to_string(rank);
}
}  // namespace

ProcessGroupConsensus::ProcessGroupConsensus(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                             std::chrono::milliseconds timeout,
                                             c10::intrusive_ptr<c10d::Store> store)
    : group_(std::move(group)), store_(std::move(store)), timeout_(timeout) {
  TORCH_CHECK(group_, "stepguard: ProcessGroupConsensus needs a process group");
  TORCH_CHECK(timeout_.count() > 0, "stepguard: collective timeout must be positive, got ",
              timeout_.count(), " ms");
  rank_ = group_->getRank();
  world_size_ = group_->getSize();
  backend_ = group_->getBackendName();
}

void ProcessGroupConsensus::do_all_reduce_sum(at::Tensor& buffer, std::int64_t step) {
  std::vector<at::Tensor> tensors{buffer};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  options.timeout = timeout_;
  try {
    auto work = group_->allreduce(tensors, options);
    if (!work->wait(timeout_)) {
      throw std::runtime_error("the collective was aborted");
    }
  } catch (const std::exception& e) {
    std::string note;
    std::vector<int> missing = find_missing_ranks(step, &note);
    std::ostringstream msg;
    msg << "stepguard: rank " << rank_ << ": the step " << step << " all-reduce over " << backend_
        << " (" << world_size_ << " ranks, deadline " << timeout_.count() << " ms) failed";
    if (!missing.empty()) {
      msg << "; missing rank" << (missing.size() > 1 ? "s" : "");
      for (std::size_t i = 0; i < missing.size(); ++i) msg << (i ? ", " : " ") << missing[i];
    }
    if (!note.empty()) msg << "; " << note;
    // The backend's own text last: it is long and names addresses rather than ranks.
    std::string cause = e.what();
    if (const auto nl = cause.find('\n'); nl != std::string::npos) cause.resize(nl);
    msg << " (" << cause << ")";
    throw ConsensusError(msg.str(), step, std::move(missing));
  }
}

std::vector<int> ProcessGroupConsensus::find_missing_ranks(std::int64_t step, std::string* note) {
  if (!store_) return {};
  // Survivors fail at about the same time; a short grace lets them all check in.
  const auto grace = std::min<std::chrono::milliseconds>(timeout_, kCheckInGrace);
  std::vector<int> missing;
  bool polled = false;
  try {
    store_->setTimeout(grace);
    store_->set(check_in_key(step, rank_), std::vector<uint8_t>{1});
    const auto deadline = std::chrono::steady_clock::now() + grace;
    while (true) {
      std::vector<int> absent;
      for (int r = 0; r < world_size_; ++r) {
        if (r != rank_ && !store_->check({check_in_key(step, r)})) absent.push_back(r);
      }
      missing = std::move(absent);
      polled = true;
      if (missing.empty() || std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  } catch (const std::exception&) {
    // The store lives with rank 0 under torchrun-style rendezvous; when it goes away after a
    // poll, that poll's answer stands.
    if (!polled)
      *note = "the rendezvous store is unreachable (its host, usually rank 0, may be gone)";
  }
  return missing;
}

}  // namespace consensus
}  // namespace stepguard
