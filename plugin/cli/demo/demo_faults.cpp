// The faults `stepguard demo --inject` puts into a run: where each lands and when.
#include <signal.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "plugin/cli/demo/demo_run.h"

namespace stepguard {
namespace demo {

namespace {

// Parameters the gradient faults land in: one in attention, one in an MLP.
constexpr const char* kNanGradParam = "blocks.1.qkv.weight";
constexpr const char* kInfGradParam = "blocks.0.fc_in.weight";
constexpr const char* kCorruptParam = "blocks.0.proj.weight";

torch::Tensor& grad_of(torch::OrderedDict<std::string, torch::Tensor>& named, const char* name) {
  auto* p = named.find(name);
  TORCH_CHECK(p != nullptr, "demo: no parameter named ", name);
  auto& g = p->mutable_grad();
  TORCH_CHECK(g.defined(), "demo: parameter ", name, " has no gradient");
  return g;
}

}  // namespace

// Whether `kind` hits this rank at the step in progress; an injection without a rank hits every
// rank.
bool DemoRun::injected(FaultKind kind) const {
  for (const auto& inj : o_.injections) {
    if (inj.kind == kind && inj.step == step_ && (inj.rank < 0 || inj.rank == world_.rank)) {
      return true;
    }
  }
  return false;
}

void DemoRun::inject_weight_faults() {
  if (injected(FaultKind::kCorruptWeights)) {
    torch::NoGradGuard no_grad;
    named_.find(kCorruptParam)->view(-1)[0].fill_(std::nan(""));
  }
  if (injected(FaultKind::kDriftWeights)) {
    torch::NoGradGuard no_grad;
    named_.find(kCorruptParam)->view(-1)[0].add_(0.5);  // finite: only a replica check sees it
  }
}

// Gradient faults land after the average: rank-local, as in a sharded optimizer or a bad GPU.
void DemoRun::inject_gradient_faults() {
  if (injected(FaultKind::kNanGrad)) {
    grad_of(named_, kNanGradParam).view(-1)[7].fill_(std::nan(""));
  }
  if (injected(FaultKind::kInfGrad)) {
    grad_of(named_, kInfGradParam).view(-1)[3].fill_(std::numeric_limits<float>::infinity());
  }
}

void DemoRun::inject_transient_fault() {
  if (injected(FaultKind::kTransientNan)) {
    // A silent corruption in this execution only: replaying the batch comes out clean.
    grad_of(named_, kNanGradParam).view(-1)[11].fill_(std::nan(""));
  }
}

// kill and kill_early: the process dies abruptly (SIGKILL), saying so first.
void DemoRun::die_if_injected(FaultKind kind) {
  if (!injected(kind)) return;
  progress_.note("[rank " + std::to_string(world_.rank) + "] injected " + to_string(kind) +
                 " at step " + std::to_string(step_));
  std::fflush(nullptr);
  raise(SIGKILL);
}

}  // namespace demo
}  // namespace stepguard
