#include "csrc/scaling/lr_controller.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace stepguard {
namespace scaling {

void LrController::lower(double factor, double floor, std::int64_t recover_after,
                         std::int64_t recover_over) {
  auto require = [](bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("stepguard: lower_lr: ") + what);
  };
  require(factor > 0 && factor < 1, "factor must be in (0, 1)");
  require(floor > 0 && floor <= 1, "floor must be in (0, 1]");
  require(recover_after >= 0, "recover_after must be >= 0");
  require(recover_over >= 0, "recover_over must be >= 0");
  state_.factor = std::max(state_.factor * factor, floor);
  state_.recovery_start = state_.factor;
  state_.good_steps = 0;
  state_.recover_after = recover_after;
  state_.recover_over = recover_over;
  state_.recovered_steps = 0;
}

void LrController::on_step(bool good) {
  if (!good) {
    state_.good_steps = 0;
    return;
  }
  state_.good_steps += 1;
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
  state_.factor = state_.recovery_start + (1.0 - state_.recovery_start) * t;
}

}  // namespace scaling
}  // namespace stepguard
