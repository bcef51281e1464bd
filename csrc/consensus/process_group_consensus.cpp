#include "csrc/consensus/process_group_consensus.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>
#include <thread>

namespace stepguard {
namespace consensus {

namespace {
using Clock = std::chrono::steady_clock;
constexpr auto kCheckInGrace = std::chrono::seconds(5);
// A collective that runs longer than this starts looking for failures reported by other ranks.
constexpr auto kQuiet = std::chrono::milliseconds(1000);
constexpr auto kLookEvery = std::chrono::milliseconds(500);

std::string check_in_key(std::int64_t step, int rank) {
  return "stepguard/failed_step/" + std::to_string(step) + "/" + std::to_string(rank);
}
std::string failures_key(std::int64_t step) {
  return "stepguard/failed_step/" + std::to_string(step) + "/count";
}
}  // namespace

void wait_for_collective(const c10::intrusive_ptr<c10d::Work>& work, c10d::Store* store,
                         std::chrono::milliseconds timeout, std::int64_t step) {
  const auto deadline = Clock::now() + timeout;
  auto slice = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::min<Clock::duration>(kQuiet, timeout));
  while (true) {
    try {
      if (work->wait(slice)) return;
      throw std::runtime_error("the collective was aborted");
    } catch (const std::exception&) {
      // A timed wait throws when its slice runs out, and the collective may complete between
      // that throw and this look: then it is done, and an untimed wait returns at once (or
      // rethrows the backend's own failure).
      if (work->isCompleted()) {
        if (work->wait()) return;
        throw std::runtime_error("the collective was aborted");
      }
    }
    // Still running: a slow step, or a peer that is gone.
    if (store != nullptr) {
      bool reported = false;
      try {
        reported = store->check({failures_key(step)});
      } catch (const std::exception&) {
        // The store is not needed for the step itself; the deadline still holds.
      }
      if (reported) {
        throw std::runtime_error("another rank reported that this step's collective failed");
      }
    }
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) {
      throw std::runtime_error("no answer within the deadline");
    }
    slice = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::min<Clock::duration>(kLookEvery, left));
    if (slice.count() < 1) slice = std::chrono::milliseconds(1);
  }
}

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
  all_reduce_tensors(tensors, step, "all-reduce");
}

void ProcessGroupConsensus::do_all_reduce_sum_on_stream(at::Tensor& buffer, std::int64_t step) {
  std::vector<at::Tensor> tensors{buffer};
  all_reduce_tensors(tensors, step, "all-reduce", /*host_waits=*/false);
}

void ProcessGroupConsensus::all_reduce_tensors(std::vector<at::Tensor>& tensors, std::int64_t step,
                                               const std::string& what, bool host_waits) {
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  options.timeout = timeout_;
  try {
    auto work = group_->allreduce(tensors, options);
    if (!host_waits && !tensors.empty() && !tensors.front().is_cpu()) {
      // An untimed wait orders the caller's stream after the collective; the host goes on.
      if (!work->wait()) throw std::runtime_error("the collective was aborted");
    } else {
      wait_for_collective(work, store_.get(), timeout_, step);
    }
  } catch (const std::exception& e) {
    std::string note;
    std::vector<int> missing = find_missing_ranks(step, &note);
    std::ostringstream msg;
    // Step 0 is the guard's construction (the ranks' layouts are checked there).
    msg << "stepguard: rank " << rank_ << ": the "
        << (step == 0 ? std::string("construction") : "step " + std::to_string(step)) << " " << what
        << " over " << backend_ << " (" << world_size_ << " ranks, deadline " << timeout_.count()
        << " ms) failed";
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
    // Ranks still waiting in this step's collective see the count and check in too.
    store_->add(failures_key(step), 1);
    const auto deadline = Clock::now() + grace;
    while (true) {
      std::vector<int> absent;
      for (int r = 0; r < world_size_; ++r) {
        if (r != rank_ && !store_->check({check_in_key(step, r)})) absent.push_back(r);
      }
      missing = std::move(absent);
      polled = true;
      if (missing.empty() || Clock::now() >= deadline) break;
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
