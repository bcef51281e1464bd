// The deferred verdict: a step's update is gated on the device by what needs no decision (a
// NaN/Inf gradient or loss on any rank, a bad optimizer state), and the rest of the decision is
// made one step later, from a host copy of the summed step buffer that travelled meanwhile. The
// steady-state step has no host read and no host wait (on a device; on the CPU the copy is the
// buffer itself).
#include <ATen/record_function.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <utility>

#include "plugin/src/step_internal.h"

namespace stepguard {

StepEngine::DeferredBegin StepEngine::begin_deferred(const at::Tensor& loss) {
  RECORD_USER_SCOPE("stepguard::verdict");
  check_not_pending("begin_deferred()");
  TORCH_CHECK(options_.enabled(), "stepguard: the deferred verdict of a guard that is off");
  TORCH_CHECK(!controller_.loss_scaling(),
              "stepguard: deferred=True with the guard's loss scaling: the next backward would "
              "need this step's scale before it is decided; use bf16 or fp32, or the synchronous "
              "verdict");
  TORCH_CHECK(!replay_,
              "stepguard: deferred=True with set_replay(): a forensic replay runs the step's "
              "batch again, and that batch is gone when the deferred decision is made; leave "
              "replays off");
  // Refused before begin_step(), which lands the last snapshot and claims the step.
  auto framework_scale = port_.framework_loss_scale();
  TORCH_CHECK(!framework_scale,
              "stepguard: deferred=True under a framework's loss scaler: its scale for the next "
              "step would depend on a decision not yet made; use the synchronous verdict");
  const auto t = begin_step(loss, std::move(framework_scale));
  const std::int64_t step = step_ + 1;
  auto d = std::make_unique<DeferredStep>();
  d->step = step;
  consensus::StepBuffer& buffer = inspect_and_pack(loss, step, &d->agreed);
  d->state_checked = state_check_.ran();
  const auto t_agree = EngineClock::now();
  at::Tensor& summed = buffer.tensor();
  agree_or_abort([&] {
    RECORD_USER_SCOPE("stepguard::agree");
    consensus_->all_reduce_sum_on_stream(summed, step);
  });
  at::Tensor found_inf = buffer.skip_flag();
  if (summed.is_cpu()) {
    deferred_host_ = summed;  // summed on the host already: nothing to copy or wait for
  } else {
    if (!deferred_host_.defined() || !deferred_host_.is_pinned()) {
      deferred_host_ =
          at::empty(summed.sizes(), summed.options().device(at::kCPU).pinned_memory(true));
    }
    deferred_host_.copy_(summed, /*non_blocking=*/true);
    const c10::impl::VirtualGuardImpl impl(summed.device().type());
    d->copied.emplace(summed.device().type());
    d->copied->record(impl.getStream(summed.device()));
  }
  d->agreed.agree_seconds = seconds_since(t_agree);
  stage_seconds_.agree = d->agreed.agree_seconds;
  stage_seconds_.inspect = seconds_since(t) - d->agreed.agree_seconds;
  // This step's evidence goes with it; the next step's check_inputs(), probes and gradient watch
  // start afresh.
  d->input_check = std::move(input_check_);
  input_check_.reset();
  std::swap(d->probes, probes_);
  d->watched_grad_sum = std::exchange(watched_grad_sum_, at::Tensor());
  DeferredBegin out{std::move(found_inf), controller_.lr_factor()};
  deferred_ = std::move(d);
  return out;
}

at::Tensor StepEngine::deferred_grad_norm() const {
  TORCH_CHECK(deferred_ != nullptr,
              "stepguard: deferred_grad_norm() with no deferred step waiting for its decision");
  return step_buffer_->norm_on_device();
}

std::optional<StepReport> StepEngine::resolve_deferred(bool update_failed, bool batch_in_hand) {
  if (!deferred_) return std::nullopt;
  RECORD_USER_SCOPE("stepguard::settle");
  std::unique_ptr<DeferredStep> d = std::move(deferred_);
  if (d->copied) {
    RECORD_USER_SCOPE("stepguard::deferred_wait");
    d->copied->synchronize();  // issued a whole step ago: landed long since
  }
  const std::int64_t step = d->step;
  // The step's own evidence in place while it is judged; the next step's back afterwards.
  std::swap(input_check_, d->input_check);
  std::swap(probes_, d->probes);
  std::swap(watched_grad_sum_, d->watched_grad_sum);
  resolving_deferred_ = true;
  struct SwapBack {
    StepEngine* e;
    DeferredStep* d;
    ~SwapBack() {
      std::swap(e->input_check_, d->input_check);
      std::swap(e->probes_, d->probes);
      std::swap(e->watched_grad_sum_, d->watched_grad_sum);
      e->resolving_deferred_ = false;
    }
  } swap_back{this, d.get()};
  Pending p;
  p.agreed = std::move(d->agreed);
  const at::Tensor& host = deferred_host_;  // on the host: the pinned copy, or the buffer itself
  agree_or_abort(
      [&] { agree_counts(host, step_buffer_->rank_row(), step, d->state_checked, &p.agreed); });
  settle_snapshot();  // a restore reads the snapshot in flight
  decide_and_investigate(step, &p);
  const bool applied = !update_failed && !consensus::StepBuffer::skips_on_device(host);
  overrule(&p.decided, applied, step, /*late=*/true);
  const auto t = EngineClock::now();
  act(step, p.agreed.global, p.decided, p.findings.blamed, /*gradients_current=*/false);
  if (batch_in_hand && p.decided.decision.outcome == Outcome::kRolledBack) {
    // The batch of the step that resolves this one ran on the abandoned weights: its gradients
    // were dropped with the restore, and it is counted as skipped data.
    skipped_ranges_.push_back({data_position_, 1});
    ++data_position_;
  }
  stage_seconds_.act = seconds_since(t);
  return record(step, p.agreed, p.decided, p.findings);
}

}  // namespace stepguard
