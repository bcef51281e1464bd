/*
 * `stepguard demo --ranks R`: starts R copies of the demo on this machine, torchrun-style (RANK,
 * WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT=a free port), waits for them, and
 * makes sure none is left behind: once one rank fails, the others get the collective deadline plus
 * a grace period to notice and exit, then are killed.
 */
#pragma once

#include "plugin/cli/demo/demo_options.h"

namespace stepguard {
namespace demo {

/// Runs the ranks; returns the launcher's exit status: 0 when every rank exited 0, 3 when the
/// policy aborted (every rank exited 3), otherwise 1.
int launch_ranks(const DemoOptions& options);

}  // namespace demo
}  // namespace stepguard
