// run_plot_script(): starts the Python tool that draws a run (plugin/python/stepguard/plot.py) and
// waits for it. Nothing is drawn here. The CLI's, not the library's: a library call does not
// start interpreters.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "plugin/cli/plot_tool.h"

extern char** environ;

namespace stepguard {
namespace cli {

namespace {

std::string python_interpreter() {
  const char* chosen = std::getenv("STEPGUARD_PYTHON");
  if (chosen != nullptr && *chosen != '\0') return chosen;
#ifdef STEPGUARD_BUILD_PYTHON
  // The Python stepguard._C was built for (.venv: it has matplotlib, pinned).
  if (::access(STEPGUARD_BUILD_PYTHON, X_OK) == 0) return STEPGUARD_BUILD_PYTHON;
#endif
  return "python3";
}

// plot.py of the package built beside this program (build/bin/stepguard ->
// build/python/stepguard), or "" when there is none.
std::string plot_script_beside_program() {
  std::error_code ec;
  const auto program = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return {};
  const auto script = program.parent_path().parent_path() / "python" / "stepguard" / "plot.py";
  return std::filesystem::is_regular_file(script, ec) ? script.lexically_normal().string() : "";
}

}  // namespace

int run_plot_script(const std::vector<std::string>& args) {
  std::vector<std::string> command = {python_interpreter()};
  // By its path, plot.py loads the package beside it (its files go through the extension's file
  // layer); an installed package is found by module name.
  const std::string script = plot_script_beside_program();
  if (!script.empty()) {
    command.push_back(script);
  } else {
    command.insert(command.end(), {"-m", "stepguard.plot"});
  }
  command.insert(command.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& word : command) argv.push_back(word.data());
  argv.push_back(nullptr);

  pid_t pid = 0;
  const int rc = ::posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), environ);
  if (rc != 0) {
    throw std::runtime_error("cannot start " + command[0] + " (" + std::strerror(rc) +
                             "): drawing needs Python 3 with matplotlib");
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) throw std::runtime_error(std::string("waitpid: ") + std::strerror(errno));
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

}  // namespace cli
}  // namespace stepguard
