/*
 * The learning-rate factor: the one owner of the multiplier the guard applies to every param
 * group's learning rate. The policy lowers it (factor, floor); it recovers toward 1 on schedule:
 * after `recover_after` good steps in a row, linearly over `recover_over` good steps. A bad step
 * pauses recovery and restarts the count of good steps; lowering again restarts the schedule.
 *
 * Torch-free and deterministic; its state is a plain value. Not thread-safe.
 */
#pragma once

#include <cstdint>

namespace stepguard {
namespace scaling {

struct LrControllerState {
  double factor = 1.0;
  double recovery_start = 1.0;       ///< factor when recovery began
  std::int64_t good_steps = 0;       ///< good steps in a row since the last lowering or bad step
  std::int64_t recover_after = 0;    ///< good steps to wait before recovering
  std::int64_t recover_over = 0;     ///< good steps the recovery takes; 0 = no recovery planned
  std::int64_t recovered_steps = 0;  ///< good steps of recovery done
  bool operator==(const LrControllerState& o) const noexcept {
    return factor == o.factor && recovery_start == o.recovery_start && good_steps == o.good_steps &&
           recover_after == o.recover_after && recover_over == o.recover_over &&
           recovered_steps == o.recovered_steps;
  }
};

class LrController {
 public:
  /// factor in (0, 1), floor in (0, 1], recover_after >= 0, recover_over >= 0 (0 = stay lowered).
  /// Throws std::invalid_argument naming the parameter.
  void lower(double factor, double floor, std::int64_t recover_after, std::int64_t recover_over);
  /// After every step: whether it was good (applied, no detector fired).
  void on_step(bool good);

  double factor() const noexcept { return state_.factor; }
  const LrControllerState& state() const noexcept { return state_; }
  /// Throws std::invalid_argument naming the field when `state` is not one lower() and on_step()
  /// can reach: factor and recovery start in (0, 1], every count in [0, 2^52], a recovery
  /// under way not past its end. The arithmetic of on_step() is exact within these bounds.
  static void check(const LrControllerState& state);
  /// check(), then takes `state`.
  void restore(const LrControllerState& state);

 private:
  LrControllerState state_;
};

}  // namespace scaling
}  // namespace stepguard
