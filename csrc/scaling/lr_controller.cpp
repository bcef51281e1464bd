#include "csrc/scaling/lr_controller.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "csrc/common/bits.h"

namespace stepguard {
namespace scaling {

void LrController::lower(double factor, double floor, std::int64_t recover_after,
                         std::int64_t recover_over) {
  auto require = [](bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("stepguard: lower_lr: ") + what);
  };
  require(factor > 0 && factor < 1, "factor must be in (0, 1)");
  require(floor > 0 && floor <= 1, "floor must be in (0, 1]");
  require(recover_after >= 0 && recover_after <= kMaxDecodedCount,
          "recover_after must be in [0, 2^52]");
  require(recover_over >= 0 && recover_over <= kMaxDecodedCount,
          "recover_over must be in [0, 2^52]");
  state_.factor = std::max(state_.factor * factor, floor);
  state_.recovery_start = state_.factor;
  state_.good_steps = 0;
  state_.recover_after = recover_after;
  state_.recover_over = recover_over;
  state_.recovered_steps = 0;
}

void LrController::check(const LrControllerState& s) {
  auto require = [](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("the LR controller's " + what);
  };
  auto count = [&require](const char* name, std::int64_t v) {
    require(v >= 0 && v <= kMaxDecodedCount,
            std::string(name) + " " + std::to_string(v) + " is not in [0, 2^52]");
  };
  require(s.factor > 0 && s.factor <= 1,
          "LR factor " + std::to_string(s.factor) + " is not in (0, 1]");
  // The factor recovers linearly from recovery_start to 1: a start outside (0, 1] would walk the
  // factor below 0 (gradient ascent) or above 1.
  require(s.recovery_start > 0 && s.recovery_start <= 1,
          "recovery start " + std::to_string(s.recovery_start) + " is not in (0, 1]");
  count("good_steps", s.good_steps);
  count("recover_after", s.recover_after);
  count("recover_over", s.recover_over);
  count("recovered_steps", s.recovered_steps);
  // on_step() ends a recovery when recovered_steps reaches recover_over.
  require(s.recover_over == 0 || s.recovered_steps < s.recover_over,
          "recovered_steps " + std::to_string(s.recovered_steps) + " is past recover_over " +
              std::to_string(s.recover_over));
}

void LrController::restore(const LrControllerState& state) {
  check(state);
  state_ = state;
}

void LrController::on_step(bool good) {
  if (!good) {
    state_.good_steps = 0;
    return;
  }
  // Saturating: a count at the bound stays there (2^52 steps are never reached by a run).
  state_.good_steps = std::min(state_.good_steps + 1, kMaxDecodedCount);
  if (state_.factor >= 1.0 || state_.recover_over == 0) return;
  if (state_.good_steps <= state_.recover_after) return;
  state_.recovered_steps += 1;
  if (state_.recovered_steps >= state_.recover_over) {
    state_.factor = 1.0;
    state_.recover_over = 0;
    return;
  }
  // Linear from the lowered factor to 1, computed from the start so errors do not accumulate.
  const double t =
      static_cast<double>(state_.recovered_steps) / static_cast<double>(state_.recover_over);
  state_.factor = std::clamp(state_.recovery_start + (1.0 - state_.recovery_start) * t,
                             state_.recovery_start, 1.0);
}

}  // namespace scaling
}  // namespace stepguard
