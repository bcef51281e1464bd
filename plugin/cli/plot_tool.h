// `stepguard plot`: the CLI starts the Python tool that draws a run. Internal to the CLI and the
// demo (a library call does not start interpreters).
#pragma once

#include <string>
#include <vector>

namespace stepguard {
namespace cli {

/// Runs the Python tool that draws a run, `stepguard.plot` (python3 with matplotlib, torch and the
/// stepguard package), with `args`
/// (`TRACE.jsonl -o OUT.png [--around STEP] [--window N]`, or `--incident REPORT.json...`), its
/// output going to this process's stdout and stderr; returns its exit status (0 drawn, 2 bad
/// input, 1 matplotlib or the package missing). The interpreter: $STEPGUARD_PYTHON, else the Python
/// stepguard._C was built for (.venv), else python3 on PATH. The tool: plot.py of the package built
/// beside this program (BIN/../python/stepguard), run by its path, else `-m stepguard.plot` (an
/// installed package). Throws std::runtime_error when no interpreter can be started.
int run_plot_script(const std::vector<std::string>& args);

}  // namespace cli
}  // namespace stepguard
