// GuardedOptimizer: the LibTorch front end. It drives a torch::optim::Optimizer through the
// LibTorch port and hands every call to the step engine. Nothing else.
#include "stepguard/guarded_optimizer.h"

#include <torch/types.h>

#include "plugin/src/libtorch_port.h"
#include "plugin/src/step_engine.h"

namespace stepguard {

struct GuardedOptimizer::Impl {
  Impl(torch::optim::Optimizer& optimizer,
       const torch::OrderedDict<std::string, torch::Tensor>& named, std::vector<Placement> layout,
       GuardOptions options)
      : port(optimizer, named, std::move(layout)), engine(port, std::move(options)) {}
  LibTorchPort port;
  StepEngine engine;
  torch::Tensor recorded_loss;  ///< record_loss(), for the next step() without a loss
};

GuardedOptimizer::GuardedOptimizer(torch::optim::Optimizer& optimizer, GuardOptions options)
    : impl_(std::make_unique<Impl>(optimizer, torch::OrderedDict<std::string, torch::Tensor>(),
                                   std::vector<Placement>(), std::move(options))) {}

GuardedOptimizer::GuardedOptimizer(
    torch::optim::Optimizer& optimizer,
    const torch::OrderedDict<std::string, torch::Tensor>& named_parameters, GuardOptions options)
    : impl_(std::make_unique<Impl>(optimizer, named_parameters, std::vector<Placement>(),
                                   std::move(options))) {}

GuardedOptimizer::GuardedOptimizer(
    torch::optim::Optimizer& optimizer,
    const torch::OrderedDict<std::string, torch::Tensor>& named_parameters,
    std::vector<Placement> layout, GuardOptions options)
    : impl_(std::make_unique<Impl>(optimizer, named_parameters, std::move(layout),
                                   std::move(options))) {}

GuardedOptimizer::~GuardedOptimizer() = default;

StepReport GuardedOptimizer::step(const torch::Tensor& loss) {
  const torch::Tensor recorded = std::move(impl_->recorded_loss);
  impl_->recorded_loss = torch::Tensor();
  return impl_->engine.step(loss.defined() ? loss : recorded);
}
Verdict GuardedOptimizer::verdict(const torch::Tensor& loss) {
  Verdict v = impl_->engine.verdict(loss.defined() ? loss : impl_->recorded_loss);
  impl_->recorded_loss = torch::Tensor();  // used by this step only, once it has a verdict
  return v;
}
StepReport GuardedOptimizer::settle(const Verdict& verdict, bool applied) {
  return impl_->engine.settle(verdict, applied);
}
void GuardedOptimizer::clip_gradients(const Verdict& verdict) {
  impl_->engine.clip_gradients(verdict);
}
void GuardedOptimizer::record_loss(const torch::Tensor& loss) {
  TORCH_CHECK(loss.defined() && loss.numel() == 1 && loss.is_floating_point(),
              "stepguard: record_loss() takes a floating-point tensor of one element");
  impl_->recorded_loss = loss.detach();
}
GuardStats GuardedOptimizer::stats() const { return impl_->engine.stats(); }
std::string GuardedOptimizer::metrics_text() const { return impl_->engine.metrics_text(); }
std::string GuardedOptimizer::explain_policy() const { return impl_->engine.explain_policy(); }
torch::Tensor GuardedOptimizer::scale_loss(const torch::Tensor& loss) const {
  return impl_->engine.scale_loss(loss);
}
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
void GuardedOptimizer::set_data_position(std::int64_t position) {
  impl_->engine.set_data_position(position);
}
void GuardedOptimizer::commit_pending_checkpoint() { impl_->engine.commit_pending_checkpoint(); }
void GuardedOptimizer::wait_for_background_work() { impl_->engine.wait_for_background_work(); }
torch::optim::Optimizer& GuardedOptimizer::optimizer() noexcept { return impl_->port.optimizer(); }

namespace {

// The guard's record under "stepguard" in an archive: one int64 tensor per field, named as the
// keys of the Python state dict's 'stepguard' entry.
constexpr const char* kRecordKey = "stepguard";
constexpr const char* kOptimizerKey = "optimizer";

torch::Tensor words_tensor(const std::vector<std::int64_t>& words) {
  return torch::tensor(words, torch::kInt64);
}

std::vector<std::int64_t> read_words(torch::serialize::InputArchive& archive, const char* key) {
  torch::Tensor t;
  TORCH_CHECK(archive.try_read(key, t), "stepguard: load: the archive's '", kRecordKey,
              "' lacks the key '", key, "'");
  TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.dim() == 1, "stepguard: load: the archive's '",
              kRecordKey, "/", key, "' must be a 1-D int64 tensor, got ", t.scalar_type(), " of ",
              t.dim(), " dimensions");
  t = t.contiguous();
  return std::vector<std::int64_t>(t.data_ptr<std::int64_t>(),
                                   t.data_ptr<std::int64_t>() + t.numel());
}

std::int64_t read_count(torch::serialize::InputArchive& archive, const char* key) {
  const std::vector<std::int64_t> v = read_words(archive, key);
  TORCH_CHECK(v.size() == 1, "stepguard: load: the archive's '", kRecordKey, "/", key,
              "' must hold one value, got ", v.size());
  return v[0];
}

}  // namespace

void GuardedOptimizer::save(torch::serialize::OutputArchive& archive) const {
  const checkpoint::GuardRecord r = impl_->engine.record();
  torch::serialize::OutputArchive record;
  record.write("step", words_tensor({r.step}));
  record.write("data_position", words_tensor({r.data_position}));
  record.write("guard", words_tensor(r.guard));
  record.write("totals", words_tensor(r.totals));
  record.write("skipped_ranges", words_tensor(r.skipped_ranges));
  archive.write(kRecordKey, record);
  torch::serialize::OutputArchive optimizer;
  impl_->port.optimizer().save(optimizer);
  archive.write(kOptimizerKey, optimizer);
}

void GuardedOptimizer::load(torch::serialize::InputArchive& archive) {
  torch::serialize::InputArchive record;
  TORCH_CHECK(archive.try_read(kRecordKey, record),
              "stepguard: load: not a GuardedOptimizer archive (it lacks the key '", kRecordKey,
              "')");
  torch::serialize::InputArchive optimizer;
  TORCH_CHECK(archive.try_read(kOptimizerKey, optimizer),
              "stepguard: load: not a GuardedOptimizer archive (it lacks the key '", kOptimizerKey,
              "')");
  checkpoint::GuardRecord r;
  r.step = read_count(record, "step");
  r.data_position = read_count(record, "data_position");
  r.guard = read_words(record, "guard");
  r.totals = read_words(record, "totals");
  r.skipped_ranges = read_words(record, "skipped_ranges");
  // Checked whole before anything changes; both parts load, or neither.
  const checkpoint::GuardRecord before = impl_->engine.record();
  impl_->engine.load_record(r);
  try {
    impl_->port.optimizer().load(optimizer);
  } catch (...) {
    impl_->engine.load_record(before);
    throw;
  }
}

}  // namespace stepguard
