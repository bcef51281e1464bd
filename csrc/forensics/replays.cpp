#include "csrc/forensics/replays.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/version.h>

#include <string>

namespace stepguard {
namespace forensics {

namespace {

#if TORCH_VERSION_MAJOR >= 2
using WarningHandlerGuard = c10::WarningUtils::WarningHandlerGuard;
#else
using WarningHandlerGuard = c10::Warning::WarningHandlerGuard;
#endif

// What anomaly mode warns while a replay runs ("enabled only for debugging", then the forward
// traceback of the op that produced the NaN): kept for the report instead of reaching the
// terminal through glog (with its "Logging before InitGoogleLogging" line and raw stack frames).
class CapturedWarnings final : public c10::WarningHandler {
 public:
#if TORCH_VERSION_MAJOR >= 2
  void process(const c10::Warning& warning) override { keep(warning.msg()); }
#else
  void process(const c10::SourceLocation&, const std::string& msg, const bool) override {
    keep(msg);
  }
#endif
  const std::string& text() const noexcept { return text_; }

 private:
  static constexpr std::size_t kMaxBytes = 4096;
  void keep(const std::string& msg) {
    if (msg.find("should be enabled only for debugging") != std::string::npos) return;
    if (text_.size() >= kMaxBytes) return;
    if (!text_.empty()) text_ += "\n";
    text_ += msg.substr(0, kMaxBytes - text_.size());
  }
  std::string text_;
};

// Anomaly mode reports the first backward function that returned NaN by throwing; its message
// names it as "Function 'MulBackward0' returned nan values ...".
ReplayResult read_anomaly(const std::string& what, ReplayMode mode, Evidence* ev) {
  const std::string first_line = what.substr(0, what.find('\n'));
  const auto at = what.find("Function '");
  if (mode != ReplayMode::kAnomaly || at == std::string::npos) {
    ev->anomaly_message = "the replay closure failed: " + first_line;
    return ReplayResult::kNotRun;
  }
  const auto end = what.find('\'', at + 10);
  ev->anomaly_op = what.substr(at + 10, end == std::string::npos ? end : end - at - 10);
  ev->anomaly_message = first_line;
  return ReplayResult::kReproduced;
}

// One replay in `mode`: whether the loss or any gradient came out non-finite.
ReplayResult replay_once(const Recompute& recompute, const std::function<void()>& before,
                         const std::vector<at::Tensor>& params, ReplayMode mode, Evidence* ev) {
  before();
  for (const auto& p : params) {
    auto& g = const_cast<at::Tensor&>(p).mutable_grad();
    if (g.defined()) g.zero_();
  }
  bool bad = false;
  try {
    at::Tensor loss;
    if (mode == ReplayMode::kAnomaly) {
      CapturedWarnings captured;
      try {
        WarningHandlerGuard quiet(&captured);
        torch::autograd::DetectAnomalyGuard anomaly;
        loss = recompute(mode);
      } catch (...) {
        ev->anomaly_traceback = captured.text();
        throw;
      }
      ev->anomaly_traceback = captured.text();
    } else {
      loss = recompute(mode);
    }
    bad = !loss.defined() || !at::isfinite(loss.detach()).all().item<bool>();
  } catch (const std::exception& e) {
    return read_anomaly(e.what(), mode, ev);
  }
  for (const auto& p : params) {
    const auto& g = p.grad();
    if (g.defined() && !at::isfinite(g).all().item<bool>()) bad = true;
  }
  return bad ? ReplayResult::kReproduced : ReplayResult::kVanished;
}

}  // namespace

void run_replays(const Recompute& recompute, const std::function<void()>& before_each,
                 const std::vector<at::Tensor>& params, bool loss_scaling, Evidence* ev) {
  ev->rerun = replay_once(recompute, before_each, params, ReplayMode::kAsIs, ev);
  if (ev->rerun == ReplayResult::kReproduced && loss_scaling) {
    ev->fp32 = replay_once(recompute, before_each, params, ReplayMode::kFp32, ev);
  }
  if (ev->rerun == ReplayResult::kReproduced) {
    (void)replay_once(recompute, before_each, params, ReplayMode::kAnomaly, ev);
  }
}

}  // namespace forensics
}  // namespace stepguard
