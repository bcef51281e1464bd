// GuardedOptimizer: the LibTorch front end. It drives a torch::optim::Optimizer through the
// LibTorch port and hands every call to the step engine. Nothing else.
#include "stepguard/guarded_optimizer.h"

#include "plugin/src/libtorch_port.h"
#include "plugin/src/step_engine.h"

namespace stepguard {

struct GuardedOptimizer::Impl {
  Impl(torch::optim::Optimizer& optimizer,
       const torch::OrderedDict<std::string, torch::Tensor>& named, GuardOptions options)
      : port(optimizer, named), engine(port, std::move(options)) {}
  LibTorchPort port;
  StepEngine engine;
};

GuardedOptimizer::GuardedOptimizer(torch::optim::Optimizer& optimizer, GuardOptions options)
    : impl_(std::make_unique<Impl>(optimizer, torch::OrderedDict<std::string, torch::Tensor>(),
                                   std::move(options))) {}

GuardedOptimizer::GuardedOptimizer(
    torch::optim::Optimizer& optimizer,
    const torch::OrderedDict<std::string, torch::Tensor>& named_parameters, GuardOptions options)
    : impl_(std::make_unique<Impl>(optimizer, named_parameters, std::move(options))) {}

GuardedOptimizer::~GuardedOptimizer() = default;

StepReport GuardedOptimizer::step(const torch::Tensor& loss) { return impl_->engine.step(loss); }
GuardState GuardedOptimizer::state() const { return impl_->engine.state(); }
void GuardedOptimizer::restore_state(const GuardState& state) {
  impl_->engine.restore_state(state);
}
int GuardedOptimizer::rank() const noexcept { return impl_->engine.rank(); }
int GuardedOptimizer::world_size() const noexcept { return impl_->engine.world_size(); }
std::string GuardedOptimizer::metrics_endpoint() const { return impl_->engine.metrics_endpoint(); }
std::string GuardedOptimizer::metrics_text() const { return impl_->engine.metrics_text(); }
torch::Tensor GuardedOptimizer::scale_loss(const torch::Tensor& loss) const {
  return impl_->engine.scale_loss(loss);
}
double GuardedOptimizer::loss_scale() const noexcept { return impl_->engine.loss_scale(); }
double GuardedOptimizer::lr_factor() const noexcept { return impl_->engine.lr_factor(); }
InputVerdict GuardedOptimizer::check_inputs(const std::vector<torch::Tensor>& inputs,
                                            const torch::Tensor& mask) {
  return impl_->engine.check_inputs(inputs, mask);
}
void GuardedOptimizer::set_replay(std::function<torch::Tensor(ReplayMode)> recompute) {
  impl_->engine.set_replay(std::move(recompute));
}
torch::Tensor GuardedOptimizer::probe(const std::string& name, const torch::Tensor& output) {
  return impl_->engine.probe(name, output);
}
void GuardedOptimizer::track_buffers(
    const torch::OrderedDict<std::string, torch::Tensor>& named_buffers) {
  std::vector<torch::Tensor> buffers;
  for (const auto& item : named_buffers) {
    if (item.value().defined()) buffers.push_back(item.value());
  }
  impl_->engine.track_buffers(std::move(buffers));
}
std::int64_t GuardedOptimizer::resume(const std::string& dir) { return impl_->engine.resume(dir); }
std::int64_t GuardedOptimizer::data_position() const noexcept {
  return impl_->engine.data_position();
}
void GuardedOptimizer::set_data_position(std::int64_t position) {
  impl_->engine.set_data_position(position);
}
const std::vector<std::pair<std::int64_t, std::int64_t>>& GuardedOptimizer::skipped_ranges()
    const noexcept {
  return impl_->engine.skipped_ranges();
}
std::int64_t GuardedOptimizer::checkpoints_written() const noexcept {
  return impl_->engine.checkpoints_written();
}
void GuardedOptimizer::commit_pending_checkpoint() { impl_->engine.commit_pending_checkpoint(); }
void GuardedOptimizer::synchronize() { impl_->engine.synchronize(); }
std::size_t GuardedOptimizer::snapshots_held() const { return impl_->engine.snapshots_held(); }
std::int64_t GuardedOptimizer::snapshot_bytes() const { return impl_->engine.snapshot_bytes(); }
std::int64_t GuardedOptimizer::step_count() const noexcept { return impl_->engine.step_count(); }
GuardTotals GuardedOptimizer::totals() const noexcept { return impl_->engine.totals(); }
bool GuardedOptimizer::aborted() const noexcept { return impl_->engine.aborted(); }
std::int64_t GuardedOptimizer::collectives() const noexcept { return impl_->engine.collectives(); }
std::int64_t GuardedOptimizer::collective_bytes() const noexcept {
  return impl_->engine.collective_bytes();
}
const StageSeconds& GuardedOptimizer::last_stage_seconds() const noexcept {
  return impl_->engine.last_stage_seconds();
}
std::int64_t GuardedOptimizer::step_buffer_bytes() const noexcept {
  return consensus::StepBuffer::bytes();
}
const std::vector<torch::Tensor>& GuardedOptimizer::parameters() const noexcept {
  return impl_->port.parameters();
}
const std::vector<std::string>& GuardedOptimizer::parameter_names() const noexcept {
  return impl_->port.parameter_names();
}
const GuardOptions& GuardedOptimizer::options() const noexcept { return impl_->engine.options(); }
torch::optim::Optimizer& GuardedOptimizer::optimizer() noexcept { return impl_->port.optimizer(); }

}  // namespace stepguard
