// Uses stepguard the way a training loop does, through the installed headers and library only.
#include <stepguard/stepguard.h>
#include <torch/torch.h>

#include <iostream>
#include <limits>

int main() {
  torch::manual_seed(0);
  torch::nn::Linear model(4, 1);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  stepguard::GuardedOptimizer guard(sgd, model->named_parameters());
  int failures = 0;
  for (int step = 1; step <= 3; ++step) {
    sgd.zero_grad();
    auto loss = torch::mse_loss(model->forward(torch::ones({2, 4})), torch::zeros({2, 1}));
    loss.backward();
    if (step == 2) model->weight.mutable_grad()[0][0] = std::numeric_limits<float>::quiet_NaN();
    const auto report = guard.step(loss);
    const auto expected = step == 2 ? stepguard::Outcome::kSkipped : stepguard::Outcome::kApplied;
    if (report.outcome != expected) ++failures;
    std::cout << "step " << report.step << " " << stepguard::to_string(report.outcome) << "\n";
  }
  std::cout << stepguard::build_info() << "\n";
  return failures == 0 ? 0 : 1;
}
