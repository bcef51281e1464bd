// The `stepguard` command.
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "integration/demo/demo.h"
#include "stepguard/version.h"

namespace {

constexpr const char* kUsage =
    "usage: stepguard <command> [args]\n"
    "\n"
    "commands:\n"
    "  demo      train the demo model under stepguard with injected faults\n"
    "  version   print the version and build facts\n"
    "\n"
    "Run 'stepguard demo --help' for the demo's flags.\n";

int run_demo_command(const std::vector<std::string>& args) {
  std::string error;
  bool help = false;
  const auto options = stepguard::demo::parse_demo_args(args, &error, &help);
  if (!options) {
    if (help) {
      std::cout << error;
      return 0;
    }
    std::cerr << "stepguard demo: " << error << "\n";
    return 2;
  }
  return stepguard::demo::run_demo(*options);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    (args.empty() ? std::cerr : std::cout) << kUsage;
    return args.empty() ? 2 : 0;
  }
  const std::string command = args[0];
  args.erase(args.begin());
  try {
    if (command == "demo") return run_demo_command(args);
    if (command == "version" || command == "--version") {
      std::cout << stepguard::build_info() << "\n";
      return 0;
    }
    if (command == "policy" || command == "replay" || command == "ckpt" || command == "incident") {
      std::cerr << "stepguard: '" << command
                << "' is not available in this build yet; see the CHANGELOG\n";
      return 2;
    }
    std::cerr << "stepguard: unknown command '" << command << "'\n" << kUsage;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "stepguard " << command << ": error: " << e.what() << "\n";
    return 1;
  }
}
