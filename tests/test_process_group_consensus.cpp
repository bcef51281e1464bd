// Several ranks as threads of one process, each with its own Gloo process group over loopback and a
// shared in-memory store: the real c10d path, without process start-up costs.
#include <gtest/gtest.h>
#include <stepguard/stepguard.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <chrono>
#include <functional>
#include <limits>
#include <string>
#include <thread>

#include "csrc/consensus/process_group_consensus.h"
#include "csrc/consensus/step_buffer.h"
#include "tests/support/guard_archive.h"

namespace stepguard {
namespace {

struct Group {
  c10::intrusive_ptr<c10d::Store> store;
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> ranks;
};

Group make_group(int world, std::chrono::milliseconds timeout) {
  Group g;
  g.store = c10::make_intrusive<c10d::HashStore>();
  g.ranks.resize(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      g.ranks[r] = make_gloo_process_group(c10::make_intrusive<c10d::PrefixStore>("gloo", g.store),
                                           r, world, timeout, "127.0.0.1");
    });
  }
  for (auto& t : threads) t.join();
  return g;
}

void run_ranks(int world, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(world);
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

TEST(ProcessGroupConsensus, SumsAcrossRanksInOneCollective) {
  const int world = 3;
  Group g = make_group(world, std::chrono::seconds(20));
  std::vector<at::Tensor> results(world);
  run_ranks(world, [&](int r) {
    consensus::ProcessGroupConsensus c(g.ranks[r], std::chrono::seconds(20), g.store);
    EXPECT_EQ(c.rank(), r);
    EXPECT_EQ(c.world_size(), world);
    EXPECT_STREQ(c.backend_name(), "gloo");
    auto buffer = at::full({5}, static_cast<double>(r + 1), at::kDouble);
    c.all_reduce_sum(buffer, 1);
    EXPECT_EQ(c.collectives(), 1);
    results[r] = buffer;
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(at::equal(results[r], at::full({5}, 6.0, at::kDouble))) << r;
  }
}

// The fault matrix at several world sizes: each rank trains its own replica; faults hit one rank
// at a time, after the gradient average (rank-local gradients), before it (a NaN loss that the
// average spreads to every rank), and in the weights (a finite drift of one replica). Every rank
// must decide the same, name the rank the fault came from and agree on its cause, and the step
// collective must carry the same number of bytes at every world size.
class FaultMatrix : public ::testing::TestWithParam<int> {};

TEST_P(FaultMatrix, EveryRankNamesTheOriginAndAgreesOnTheCause) {
  const int world = GetParam(), steps = 12;
  const int last = world - 1, middle = world / 2;
  Group g = make_group(world, std::chrono::seconds(60));
  struct Seen {
    std::vector<Outcome> outcomes;
    std::vector<std::vector<int>> ranks;
    std::vector<Cause> causes;
    std::vector<std::vector<RankCause>> rank_causes;
    std::vector<std::vector<Signal>> signals;
    std::vector<std::vector<std::string>> tensors;
    std::int64_t collectives = 0, first_step_bytes = 0, step_buffer_bytes = 0;
    std::vector<torch::Tensor> params_at_10;
  };
  std::vector<Seen> seen(world);
  const std::string policy =
      "version: 1\n"
      "detectors:\n  replica_divergence: {every: 4}\n"
      "rules:\n  - {name: skip-nonfinite, on: nonfinite, action: skip_batch}\n";
  run_ranks(world, [&](int r) {
    torch::nn::Linear model(6, 2);
    {
      // Identical replicas: the ranks share one process, so set the values explicitly.
      torch::NoGradGuard no_grad;
      model->weight.copy_(torch::linspace(-0.5, 0.5, 12).view({2, 6}));
      model->bias.copy_(torch::tensor({0.1f, -0.2f}));
    }
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
    GuardedOptimizer guard(
        adam, model->named_parameters(),
        GuardOptions().process_group(g.ranks[r]).store(g.store).policy_yaml(policy));
    Seen& me = seen[r];
    for (int step = 1; step <= steps; ++step) {
      adam.zero_grad();
      if (step == 11 && r == last) {
        torch::NoGradGuard no_grad;
        model->weight[0][0] += 0.25;  // a finite drift: this replica no longer equals the others
      }
      auto x = torch::full({4, 6}, 0.1 * (r + 1) * step);
      auto loss = model->forward(x).pow(2).mean();
      if (step == 9 && r == middle) loss = loss * std::numeric_limits<float>::quiet_NaN();
      loss.backward();
      // Average gradients with the group, as data-parallel training does (not counted by the
      // guard: those are the loop's collectives).
      for (auto& p : model->parameters()) {
        std::vector<at::Tensor> t{p.mutable_grad()};
        g.ranks[r]->allreduce(t)->wait();
        p.mutable_grad().div_(world);
      }
      if ((step == 3 && r == last) || (step == 5 && r == 1)) {
        model->weight.mutable_grad()[0][0] = std::numeric_limits<float>::quiet_NaN();
      }
      if (step == 7 && r == 0) loss = loss * std::numeric_limits<float>::infinity();
      const std::int64_t bytes_before = guard.stats().collective_bytes;
      const StepReport report = guard.step(loss);
      if (step == 1) me.first_step_bytes = guard.stats().collective_bytes - bytes_before;
      me.outcomes.push_back(report.outcome);
      me.ranks.push_back(report.incident ? report.incident->ranks : std::vector<int>{});
      me.causes.push_back(report.incident ? report.incident->cause : Cause::kUnknown);
      me.rank_causes.push_back(report.incident ? report.incident->rank_causes
                                               : std::vector<RankCause>{});
      me.signals.push_back(report.incident ? std::vector<Signal>{report.incident->signal}
                                           : std::vector<Signal>{});
      me.tensors.push_back(report.incident ? report.incident->tensors : std::vector<std::string>{});
      if (step == 10) {
        for (const auto& p : model->parameters()) me.params_at_10.push_back(p.detach().clone());
      }
    }
    me.collectives = guard.stats().collective_calls;
    me.step_buffer_bytes = guard.stats().step_buffer_bytes;
  });
  std::vector<Outcome> expected(steps, Outcome::kApplied);
  expected[2] = expected[4] = expected[6] = expected[8] = Outcome::kSkipped;
  auto causes_of = [](const std::vector<RankCause>& v) {
    std::vector<std::pair<int, Cause>> out;
    for (const auto& c : v) out.push_back({c.rank, c.cause});
    return out;
  };
  using Causes = std::vector<std::pair<int, Cause>>;
  for (int r = 0; r < world; ++r) {
    const Seen& me = seen[r];
    SCOPED_TRACE("world " + std::to_string(world) + ", rank " + std::to_string(r));
    EXPECT_EQ(me.outcomes, expected);
    EXPECT_EQ(me.ranks[2], std::vector<int>({last}));
    EXPECT_EQ(me.ranks[4], std::vector<int>({1}));
    EXPECT_EQ(me.ranks[6], std::vector<int>({0}));
    // The NaN loss of one rank reached every rank's gradients; the origin is still that rank,
    // and its cause is the forward pass, not a clean replay read as hardware.
    EXPECT_EQ(me.ranks[8], std::vector<int>({middle}));
    EXPECT_EQ(me.causes[8], Cause::kForward);
    EXPECT_EQ(causes_of(me.rank_causes[8]), (Causes{{middle, Cause::kForward}}));
    EXPECT_EQ(causes_of(me.rank_causes[2]), (Causes{{last, Cause::kBackward}}));
    // The drifted replica is named at the next replica check (step 12), as hardware.
    EXPECT_EQ(me.signals[11], std::vector<Signal>({Signal::kReplicaDivergence}));
    EXPECT_EQ(me.ranks[11], std::vector<int>({last}));
    EXPECT_EQ(causes_of(me.rank_causes[11]), (Causes{{last, Cause::kHardwareSuspect}}));
    // ... and the tensor that drifted (one more collective on that step), on every rank.
    EXPECT_EQ(me.tensors[11], std::vector<std::string>({"weight"}));
    // A NaN gradient made after the average on one rank: every rank's incident names it.
    EXPECT_EQ(me.tensors[2], std::vector<std::string>({"weight"}));
    EXPECT_EQ(me.tensors[4], std::vector<std::string>({"weight"}));
    // One at construction (the ranks' layouts), one per step; two more on each of the five
    // incident steps, two for the blamed names on the two steps whose NaN stayed on one rank,
    // and the tensors' fingerprints on the divergence step.
    EXPECT_EQ(me.collectives, 1 + steps + 2 * 5 + 2 * 2 + 1);
    // The step's payload does not grow with the job.
    EXPECT_EQ(me.first_step_bytes, consensus::StepBuffer::bytes());
    EXPECT_EQ(me.step_buffer_bytes, consensus::StepBuffer::bytes());
    EXPECT_LE(me.step_buffer_bytes, 1024);
    for (std::size_t i = 0; i < me.params_at_10.size(); ++i) {
      EXPECT_TRUE(torch::equal(me.params_at_10[i], seen[0].params_at_10[i])) << "param " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, FaultMatrix, ::testing::Values(2, 4, 16),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "Ranks";
                         });

// A replica that drifted, found on a step whose gradients also hold NaN: the replica check names
// the tensor whose values differ (0.weight), not the NaN gradients (1.weight), which stay the
// incident's tensors.
TEST(ProcessGroupConsensus, AReplicaCheckOnANanStepNamesTheTensorsThatDiffer) {
  const int world = 2;
  Group g = make_group(world, std::chrono::seconds(60));
  std::vector<std::vector<std::string>> evidence(world), tensors(world);
  const std::string policy =
      "version: 1\n"
      "detectors:\n  replica_divergence: {every: 4}\n"
      "rules:\n  - {name: skip-nonfinite, on: nonfinite, action: skip_batch}\n";
  run_ranks(world, [&](int r) {
    torch::nn::Sequential model(torch::nn::Linear(4, 4), torch::nn::Linear(4, 2));
    {
      torch::NoGradGuard no_grad;
      int i = 0;
      for (auto& p : model->parameters()) {
        p.copy_(torch::linspace(-0.3, 0.3, p.numel()).view_as(p) + i++);
      }
    }
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(1e-2));
    GuardedOptimizer guard(
        sgd, model->named_parameters(),
        GuardOptions().process_group(g.ranks[r]).store(g.store).policy_yaml(policy));
    for (int step = 1; step <= 4; ++step) {
      sgd.zero_grad();
      if (step == 4 && r == 1) {
        torch::NoGradGuard no_grad;
        model->parameters()[0][1][2] += 0.5;  // 0.weight of this replica drifts
      }
      auto loss = model->forward(torch::full({3, 4}, 0.1 * step)).pow(2).mean();
      loss.backward();
      for (auto& p : model->parameters()) {
        std::vector<at::Tensor> t{p.mutable_grad()};
        g.ranks[r]->allreduce(t)->wait();
        p.mutable_grad().div_(world);
      }
      if (step == 4) {  // 1.weight's gradient, on every rank
        model->parameters()[2].mutable_grad()[0][0] = std::numeric_limits<float>::quiet_NaN();
      }
      const StepReport report = guard.step(loss);
      if (step == 4 && report.incident) {
        evidence[r] = report.incident->evidence;
        tensors[r] = report.incident->tensors;
      }
    }
  });
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(tensors[r], std::vector<std::string>({"1.weight"}));
  }
  const auto& ev = evidence[1];
  EXPECT_NE(std::find(ev.begin(), ev.end(), "the tensors that differ: 0.weight"), ev.end())
      << ::testing::PrintToString(ev);
}

TEST(ProcessGroupConsensus, TamperedGuardStateIsCaughtAtTheNextStep) {
  const int world = 3;
  Group g = make_group(world, std::chrono::seconds(30));
  std::vector<StepReport> last(world);
  run_ranks(world, [&](int r) {
    auto p = torch::zeros({3}, torch::requires_grad());
    torch::optim::SGD sgd({p}, torch::optim::SGDOptions(0.1));
    GuardedOptimizer guard(sgd, GuardOptions().process_group(g.ranks[r]));
    for (int step = 1; step <= 2; ++step) {
      auto loss = (p - 1.0).pow(2).sum();
      sgd.zero_grad();
      loss.backward();
      ASSERT_TRUE(guard.step(loss).applied());
    }
    if (r == 1) {
      // A bug or a bit flip on one rank (its bad-step streak).
      testing_support::load_bytes(guard, testing_support::edited_bytes(
                                             guard, [](std::vector<std::int64_t>& w) { ++w[0]; }));
    }
    auto loss = (p - 1.0).pow(2).sum();
    sgd.zero_grad();
    loss.backward();
    last[r] = guard.step(loss);
    EXPECT_TRUE(guard.stats().aborted);
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(last[r].outcome, Outcome::kAborted) << r;
    ASSERT_TRUE(last[r].incident.has_value());
    EXPECT_STREQ(to_string(last[r].incident->signal), "rank_desync");
    EXPECT_EQ(last[r].incident->reason,
              "rank_desync (rank 1 diverged: guard state differs from the other ranks)");
  }
}

// A Gloo collective whose timed wait gives up just as the collective completes: the wait throws
// "Operation timed out!" although the work is done. Seen as a failed step on one rank while the
// other went on (the demo, one rank 1 s late to a step's exchange). The race, made certain:
class CompletesAsItsWaitTimesOut : public c10d::Work {
 public:
  explicit CompletesAsItsWaitTimesOut(std::exception_ptr error = nullptr) : error_(error) {}
  bool wait(std::chrono::milliseconds timeout) override {
    if (timeout == ::kNoTimeout) return c10d::Work::wait(timeout);
    finish(error_);
    TORCH_CHECK(false, "Operation timed out!");
  }

 private:
  std::exception_ptr error_;
};

TEST(ProcessGroupConsensus, ACollectiveThatCompletesAsAWaitSliceRunsOutIsComplete) {
  auto done = c10::make_intrusive<CompletesAsItsWaitTimesOut>();
  EXPECT_NO_THROW(consensus::wait_for_collective(done, nullptr, std::chrono::seconds(5), 4));
  // Completed with the backend's own error: that error, not the timed wait's.
  auto failed = c10::make_intrusive<CompletesAsItsWaitTimesOut>(
      std::make_exception_ptr(std::runtime_error("Connection closed by peer")));
  try {
    consensus::wait_for_collective(failed, nullptr, std::chrono::seconds(5), 4);
    ADD_FAILURE() << "a failed collective passed";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("Connection closed by peer"), std::string::npos)
        << e.what();
  }
}

TEST(ProcessGroupConsensus, ARankLateByMoreThanAWaitSliceIsWaitedFor) {
  // Rank 1 joins 1.3 s late (more than the first slice of 1 s and the next of 0.5 s): both ranks
  // get the sum, no failure.
  const int world = 2;
  Group g = make_group(world, std::chrono::seconds(20));
  std::vector<at::Tensor> results(world);
  run_ranks(world, [&](int r) {
    consensus::ProcessGroupConsensus c(g.ranks[r], std::chrono::seconds(20), g.store);
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1300));
    auto buffer = at::full({3}, static_cast<double>(r + 1), at::kDouble);
    c.all_reduce_sum(buffer, 4);
    results[r] = buffer;
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(at::equal(results[r], at::full({3}, 3.0, at::kDouble))) << r;
  }
}

TEST(ProcessGroupConsensus, AMissingRankFailsTheOthersWithinTheDeadline) {
  const int world = 3;
  // The group's own timeout bounds how long tearing it down waits for the absent rank.
  Group g = make_group(world, std::chrono::seconds(3));
  std::vector<std::string> errors(world);
  std::vector<double> seconds(world, 0.0);
  run_ranks(world, [&](int r) {
    auto p = torch::zeros({2}, torch::requires_grad());
    torch::optim::SGD sgd({p}, torch::optim::SGDOptions(0.1));
    // Construction is collective (the ranks' layouts): every rank builds its guard.
    GuardedOptimizer guard(sgd, GuardOptions()
                                    .process_group(g.ranks[r])
                                    .store(g.store)
                                    .collective_timeout(std::chrono::milliseconds(1500)));
    if (r == 2) return;  // this rank never arrives at step 1
    auto loss = (p - 1.0).pow(2).sum();
    loss.backward();
    const auto t0 = std::chrono::steady_clock::now();
    try {
      guard.step(loss);
      ADD_FAILURE() << "rank " << r << ": expected a consensus error";
    } catch (const consensus::ConsensusError& e) {
      errors[r] = e.what();
      EXPECT_EQ(e.step(), 1);
      EXPECT_EQ(e.missing_ranks(), std::vector<int>({2}));
    }
    seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_TRUE(guard.stats().aborted);
    EXPECT_THROW(guard.step(loss), c10::Error);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("rank " + std::to_string(r) +
                             ": the step 1 all-reduce over gloo (3 ranks, deadline 1500 ms) "
                             "failed; missing rank 2"),
              std::string::npos)
        << errors[r];
    EXPECT_LT(seconds[r], 1.5 + 1.5 + 2.0) << "deadline plus check-in grace, with slack";
  }
}

// Settings that must agree across ranks are compared at construction, in its one collective: a
// checkpoint_dir on rank 0 only (the "save on rank 0" habit) and two policies that decide
// differently are refused on every rank, naming what differs, never met as a mismatched
// collective (an abort) or two ranks deciding apart (a deadline).
TEST(ProcessGroupConsensus, SettingsThatMustAgreeAreComparedAtConstruction) {
  const int world = 2;
  Group g = make_group(world, std::chrono::seconds(20));
  const std::string dir = ::testing::TempDir() + "/sg_rank0_only_ckpt";
  const std::string z3 =
      "version: 1\ncheckpoint: {snapshot_every: 2}\ndetectors:\n  loss_spike: {z: 3, warmup: "
      "4}\nrules:\n"
      "  - {name: spike, on: loss_spike, action: rollback}\n";
  const std::string z300 =
      "version: 1\ncheckpoint: {snapshot_every: 2}\ndetectors:\n  loss_spike: {z: 300, warmup: "
      "4}\nrules:\n"
      "  - {name: spike, on: loss_spike, action: rollback}\n";
  std::vector<std::string> errors(world);
  for (int round = 0; round < 2; ++round) {
    run_ranks(world, [&](int r) {
      auto p = torch::zeros({2}, torch::requires_grad());
      torch::optim::SGD sgd({p}, torch::optim::SGDOptions(0.1));
      GuardOptions o = GuardOptions()
                           .process_group(g.ranks[r])
                           .store(g.store)
                           .collective_timeout(std::chrono::seconds(20));
      if (round == 0 && r == 0) o.checkpoint_dir(dir).checkpoint_every(2);
      if (round == 1) o.policy_yaml(r == 0 ? z3 : z300);
      try {
        GuardedOptimizer guard(sgd, o);
        ADD_FAILURE() << "rank " << r << ": settings that differ were accepted";
      } catch (const c10::Error& e) {
        errors[r] = e.msg();
      }
    });
    const std::string expected = round == 0
                                     ? "checkpoint_dir given (1) or not (0) (rank 0: 1, rank 1: 0)"
                                     : "the policy (rank 0: as rank 0's, rank 1: another)";
    for (int r = 0; r < world; ++r) {
      EXPECT_NE(
          errors[r].find("the ranks were given settings that must agree and do not: " + expected),
          std::string::npos)
          << errors[r];
    }
  }
}

TEST(Rendezvous, FromEnvironmentNamesTheBadVariable) {
  ::setenv("WORLD_SIZE", "4", 1);
  ::setenv("RANK", "2", 1);
  ::unsetenv("LOCAL_RANK");
  ::setenv("MASTER_ADDR", "10.1.2.3", 1);
  ::setenv("MASTER_PORT", "29555", 1);
  Rendezvous r = rendezvous_from_env();
  EXPECT_EQ(r.rank, 2);
  EXPECT_EQ(r.world_size, 4);
  EXPECT_EQ(r.local_rank, 2);
  EXPECT_EQ(r.master_addr, "10.1.2.3");
  EXPECT_EQ(r.master_port, 29555);

  ::setenv("RANK", "4", 1);
  try {
    rendezvous_from_env();
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(),
                 "stepguard: environment variable RANK='4' is not a whole number in [0, 3]");
  }
  ::setenv("RANK", "1", 1);
  ::setenv("MASTER_PORT", "http", 1);
  EXPECT_THROW(rendezvous_from_env(), std::invalid_argument);
  ::unsetenv("WORLD_SIZE");
  try {
    rendezvous_from_env();
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("WORLD_SIZE is not set"), std::string::npos);
  }
  for (const char* v : {"RANK", "MASTER_ADDR", "MASTER_PORT"}) ::unsetenv(v);
}

}  // namespace
}  // namespace stepguard
