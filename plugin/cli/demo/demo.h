/*
 * The demo training job behind `stepguard demo`: trains the character transformer under a
 * GuardedOptimizer, injects the faults asked for, shows progress, and writes the summary.
 */
#pragma once

#include "plugin/cli/demo/demo_options.h"

namespace stepguard {
namespace demo {

/// Runs the demo. Returns the process exit status: 0 trained to the end, 3 the policy aborted.
/// Throws on errors it cannot continue from (unreadable corpus, unwritable output files).
int run_demo(const DemoOptions& options);

}  // namespace demo
}  // namespace stepguard
