// Forensics through the guard: input checks, probes and the evidence they give the classifier.
#include <gtest/gtest.h>
#include <stepguard/stepguard.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

namespace stepguard {
namespace {

bool has_line(const std::vector<std::string>& lines, const std::string& text) {
  return std::find(lines.begin(), lines.end(), text) != lines.end();
}

// A masked mean over a batch where one sequence is all padding: 0/0, a NaN loss from the data.
TEST(Forensics, AnAllPaddingRowIsData) {
  auto w = torch::ones({3}, torch::requires_grad());
  torch::optim::SGD sgd({w}, torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(sgd);
  auto x = torch::randn({2, 5, 3});
  auto mask = torch::ones({2, 5}, torch::kBool);
  mask[1].fill_(false);
  EXPECT_FALSE(guard.check_inputs({x}, mask));
  auto per_token = (x * w).sum(-1) * mask;
  auto loss = (per_token.sum(1) / mask.sum(1)).mean();  // row 1: 0 / 0
  loss.backward();
  const StepReport r = guard.step(loss);
  ASSERT_TRUE(r.incident.has_value());
  EXPECT_STREQ(to_string(r.incident->cause), "data");
  EXPECT_EQ(r.incident->evidence[0],
            "the batch itself is bad: 1 of 2 sequences are empty or all padding (every position "
            "masked)");
  // The next step's inputs are checked afresh: a clean batch clears the evidence.
  EXPECT_TRUE(guard.check_inputs({x}, torch::ones({2, 5}, torch::kBool)));
  EXPECT_THROW(guard.check_inputs({x}, torch::ones({2}, torch::kBool)), c10::Error);
}

// log of a negative number in the second layer: the probes name where the NaN appeared.
TEST(Forensics, ProbesNameTheFirstNonFiniteOutputInForwardOrder) {
  torch::manual_seed(3);
  auto l1 = torch::nn::Linear(4, 4);
  auto l2 = torch::nn::Linear(4, 1);
  std::vector<torch::Tensor> params = l1->parameters();
  for (const auto& p : l2->parameters()) params.push_back(p);
  torch::optim::SGD sgd(params, torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(sgd);
  auto x = torch::randn({8, 4});
  auto h = guard.probe("l1", l1->forward(x));
  auto bad = guard.probe("log", torch::log(h - 100.0));  // log of a negative: NaN
  auto out = guard.probe("l2", l2->forward(bad));
  auto loss = out.pow(2).mean();
  loss.backward();
  const StepReport r = guard.step(loss);
  ASSERT_TRUE(r.incident.has_value());
  EXPECT_STREQ(to_string(r.incident->cause), "forward");
  EXPECT_TRUE(has_line(r.incident->evidence, "the first non-finite output in forward order: log"))
      << r.incident->evidence.size();
}

// sqrt at 0 has an infinite derivative: the forward is finite, the backward is not.
TEST(Forensics, ProbesNameTheFirstNonFiniteGradientInBackwardOrder) {
  auto w = torch::ones({4}, torch::requires_grad());
  torch::optim::SGD sgd({w}, torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(sgd);
  auto a = guard.probe("a", w * 2.0);
  auto b = guard.probe("b", torch::sqrt(a * 0.0));  // finite forward (0), 0 * inf in backward
  auto loss = b.sum() + w.sum();
  loss.backward();
  const StepReport r = guard.step(loss);
  ASSERT_TRUE(r.incident.has_value());
  EXPECT_STREQ(to_string(r.incident->cause), "backward");
  EXPECT_TRUE(
      has_line(r.incident->evidence, "the first non-finite gradient in backward order reached a"));
}

// With a replay closure, a fault that does not come back is a hardware suspect; one that does,
// under anomaly mode, names the op.
TEST(Forensics, ReplayTellsTransientFromReproducibleFaults) {
  auto w = torch::ones({4}, torch::requires_grad());
  torch::optim::SGD sgd({w}, torch::optim::SGDOptions(0.1));
  const std::string dir = ::testing::TempDir() + "/sg_forensics_quiet";
  std::filesystem::remove_all(dir);
  GuardedOptimizer guard(sgd, GuardOptions().incident_dir(dir));
  bool first = true;
  auto compute = [&]() {
    auto loss = (w * 3.0).pow(2).sum();
    loss.backward();
    if (first) w.mutable_grad()[1] = std::numeric_limits<float>::quiet_NaN();  // a bit flip
    first = false;
    return loss;
  };
  guard.set_replay([&](ReplayMode) { return compute(); });
  const auto loss = compute();
  StepReport r = guard.step(loss);
  ASSERT_TRUE(r.incident.has_value());
  EXPECT_STREQ(to_string(r.incident->cause), "hardware_suspect");
  EXPECT_TRUE(torch::equal(w, torch::ones({4})));  // replays never step the optimizer

  // A clean step ends the streak (replays run at the first bad step of a streak).
  sgd.zero_grad();
  auto clean = w.sum() * 0.0;
  clean.backward();
  EXPECT_TRUE(guard.step(clean).applied());

  // A reproducible NaN from an op: log(0) * 0 in the forward makes a NaN loss.
  guard.set_replay([&](ReplayMode) {
    auto l = (torch::log(w - 1.0) * 0.0).sum();
    l.backward();
    return l;
  });
  sgd.zero_grad();
  auto l = (torch::log(w - 1.0) * 0.0).sum();
  l.backward();
  // Anomaly mode's warnings (glog's "Logging before InitGoogleLogging", the forward traceback)
  // go into the report, never to the terminal.
  ::testing::internal::CaptureStderr();
  r = guard.step(l);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find("anomaly_mode"), std::string::npos) << err;
  EXPECT_EQ(err.find("InitGoogleLogging"), std::string::npos) << err;
  EXPECT_EQ(err.find("Traceback"), std::string::npos) << err;
  ASSERT_TRUE(r.incident.has_value());
  EXPECT_STREQ(to_string(r.incident->cause), "forward");
  bool named = false;
  for (const auto& e : r.incident->evidence)
    named = named || e.rfind("anomaly mode names ", 0) == 0;
  EXPECT_TRUE(named) << r.incident->evidence.front();
  std::ifstream in(dir + "/incident-step-000000003.json");
  std::stringstream report;
  report << in.rdbuf();
  const auto j = nlohmann::json::parse(report.str());
  EXPECT_NE(j["replay"].value("traceback", "").find("Error detected in"), std::string::npos)
      << j["replay"].dump();
}

// Dropout-like randomness: replays draw exactly what the original forward drew, and the training's
// random stream goes on as if no replay had run.
TEST(Forensics, ReplaysSeeTheOriginalRandomnessAndLeaveTheStreamAlone) {
  auto w = torch::ones({4}, torch::requires_grad());
  torch::optim::SGD sgd({w}, torch::optim::SGDOptions(0.1));
  GuardedOptimizer guard(sgd);
  std::vector<torch::Tensor> draws;
  auto compute = [&] {
    auto mask = torch::rand({4});
    draws.push_back(mask.clone());
    auto loss = (w * mask).sum() * std::numeric_limits<double>::quiet_NaN();
    loss.backward();
    return loss;
  };
  guard.set_replay([&](ReplayMode) { return compute(); });
  guard.check_inputs({torch::zeros({1})});
  const auto loss = compute();
  const at::Tensor after_forward = at::detail::getDefaultCPUGenerator().get_state();
  const StepReport r = guard.step(loss);
  ASSERT_TRUE(r.incident.has_value());
  ASSERT_GE(draws.size(), 3u);  // the original, as is, anomaly mode
  for (std::size_t i = 1; i < draws.size(); ++i) EXPECT_TRUE(torch::equal(draws[i], draws[0]));
  EXPECT_TRUE(torch::equal(at::detail::getDefaultCPUGenerator().get_state(), after_forward));
}

}  // namespace
}  // namespace stepguard
