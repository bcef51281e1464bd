/*
 * The reset_moments action (SPAM's momentum reset): after the step, the wrapped optimizer's
 * moment estimates of the affected tensors are set to zero, so that a spike folded into them
 * stops steering the next updates. The moments are the state keys of torch.optim, torch::optim,
 * DeepSpeed and Megatron that average past gradients (exp_avg, exp_avg_sq, max_exp_avg_sq,
 * momentum_buffer, square_avg, grad_avg, acc_delta, exp_inf); step counters and anything else
 * an optimizer keeps (Rprop's step sizes, ...) stay as they are.
 *
 * Internal to the engine. Not thread-safe: the training thread drives it.
 */
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "plugin/src/optimizer_port.h"

namespace stepguard {

/// The index in "<index>.<key>" (a port's state tensor name; OptimizerPort::state_owner() says
/// what it belongs to); nothing when the name is not of that form.
std::optional<std::size_t> state_index(const std::string& name);

/// The key in "<index>.<key>" (the field after the last '.'; the name itself without one).
std::string state_key(const std::string& name);

/// Whether a state tensor of this name ("<index>.<key>") is a moment the reset zeroes.
bool resettable_moment(const std::string& name);

/// Zeroes the moments of the parameters named in `affected` (the step's blamed gradients) on
/// this rank, or of every parameter when `affected` is empty or names none of the state's owners
/// (a state kept per flat partition: DeepSpeed's). In place, on the tensors' own devices; no host
/// read. Returns the number of state tensors zeroed.
std::int64_t reset_moments(OptimizerPort& port, const std::vector<std::string>& affected);

}  // namespace stepguard
