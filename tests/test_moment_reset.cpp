// The reset_moments action (SPAM's momentum reset) on a real torch::optim::AdamW through the guard:
// the moments of the tensors the step blames are zeroed after the step, the others and the step
// counters kept; with nothing blamed, every parameter's.
#include <gtest/gtest.h>
#include <stepguard/stepguard.h>
#include <torch/torch.h>

#include <cmath>
#include <optional>
#include <string>

#include "plugin/src/moment_reset.h"
#include "tests/support/model_fixture.h"

namespace stepguard {
namespace {

constexpr const char* kPolicy =
    "version: 1\n"
    "rules:\n"
    "  - {on: nonfinite, action: skip_batch}\n"
    "  - {on: nonfinite, action: reset_moments}\n";

torch::optim::AdamWParamState& state_of(torch::optim::AdamW& opt, const torch::Tensor& p) {
  return static_cast<torch::optim::AdamWParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
}

TEST(MomentReset, ResettableMomentsAreTheAveragesOfPastGradientsOnly) {
  for (const char* name : {"3.exp_avg", "3.exp_avg_sq", "0.max_exp_avg_sq", "1.momentum_buffer",
                           "2.square_avg", "exp_avg"}) {
    EXPECT_TRUE(resettable_moment(name)) << name;
  }
  for (const char* name : {"3.step", "1.prev", "1.step_size", "2.sum", "0.exp_avg_sq_row"}) {
    EXPECT_FALSE(resettable_moment(name)) << name;
  }
  EXPECT_EQ(state_index("12.exp_avg"), std::optional<std::size_t>(12));
  for (const char* name : {"exp_avg", ".exp_avg", "1a.exp_avg", "group0.tensor0.exp_avg"}) {
    EXPECT_EQ(state_index(name), std::nullopt) << name;
  }
}

TEST(MomentReset, ZeroesTheBlamedTensorsMomentsAfterTheStepOrEveryOneWhenNoneIsBlamed) {
  auto model = make_model(31);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  GuardedOptimizer guard(opt, model->named_parameters(), GuardOptions().policy_yaml(kPolicy));
  const auto params = model->parameters();  // 0.weight, 0.bias, 2.weight, 2.bias
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    auto loss = loss_of(model, step);
    loss.backward();
    ASSERT_TRUE(guard.step(loss).applied());
  }
  const auto before = adamw_state(opt);  // per parameter: exp_avg, exp_avg_sq, step
  opt.zero_grad();
  auto loss = loss_of(model, 3);
  loss.backward();
  params[0].grad().view(-1)[0] = std::nan("");
  const StepReport r = guard.step(loss);
  ASSERT_EQ(r.outcome, Outcome::kSkipped);
  EXPECT_EQ(r.actions, std::vector<Action>({Action::kSkipBatch, Action::kResetMoments}));
  ASSERT_TRUE(r.incident.has_value());
  EXPECT_EQ(r.incident->tensors, std::vector<std::string>({"0.weight"}));
  EXPECT_EQ(state_of(opt, params[0]).exp_avg().abs().sum().item<double>(), 0.0);
  EXPECT_EQ(state_of(opt, params[0]).exp_avg_sq().abs().sum().item<double>(), 0.0);
  const auto after = adamw_state(opt);
  EXPECT_TRUE(bitwise_equal(after[2], before[2]));   // 0.weight's step counter kept
  for (std::size_t i = 3; i < before.size(); ++i) {  // the other parameters' state untouched
    EXPECT_TRUE(bitwise_equal(after[i], before[i])) << i;
  }
  // A non-finite loss with finite gradients blames no gradient: every parameter's moments.
  opt.zero_grad();
  loss = loss_of(model, 4);
  loss.backward();
  ASSERT_EQ(guard.step(loss * std::nan("")).outcome, Outcome::kSkipped);
  for (const auto& p : params) {
    EXPECT_EQ(state_of(opt, p).exp_avg().abs().sum().item<double>(), 0.0);
    EXPECT_EQ(state_of(opt, p).exp_avg_sq().abs().sum().item<double>(), 0.0);
  }
  EXPECT_NE(guard.explain_policy().find("zero the optimizer's moments"), std::string::npos);
  // Training goes on from zeroed moments: the next update is finite.
  opt.zero_grad();
  loss = loss_of(model, 5);
  loss.backward();
  ASSERT_TRUE(guard.step(loss).applied());
  for (const auto& p : params) EXPECT_TRUE(torch::isfinite(p).all().item<bool>());
}

}  // namespace
}  // namespace stepguard
