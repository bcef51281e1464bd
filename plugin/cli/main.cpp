// The `stepguard` command.
#include <c10/util/Exception.h>
#include <malloc.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "plugin/cli/demo/demo.h"
#include "plugin/cli/plot_tool.h"
#include "stepguard/replay.h"
#include "stepguard/tools.h"
#include "stepguard/version.h"

namespace {

// The message of an error without LibTorch's C++ backtrace: a person reads it.
std::string message_of(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

}  // namespace

namespace {

constexpr const char* kUsage =
    "usage: stepguard <command> [args]\n"
    "\n"
    "commands:\n"
    "  demo                     train the demo model under stepguard with injected faults\n"
    "  policy check POLICY...   validate policies (exit 0 valid, 2 with FILE:LINE:COL lines)\n"
    "  policy explain POLICY    print a policy's ladder in plain words\n"
    "  policy show PRESET       print a shipped preset's YAML\n"
    "  policy list              name the shipped presets\n"
    "  replay --policy POLICY --trace TRACE.jsonl [--loss-scaling]\n"
    "                           rerun a policy offline over a recorded trace; prints the per-step\n"
    "                           decisions as JSONL\n"
    "  ckpt ls DIR              list the checkpoints under DIR with their state\n"
    "  ckpt verify DIR          check every checkpoint's files (exit 0 all valid, 1 naming each\n"
    "                           bad file)\n"
    "  incident show FILE       print an incident report (the .json a guard wrote)\n"
    "  plot TRACE.jsonl -o OUT.png [--around STEP] [--window N]\n"
    "                           draw a run from its trace: loss and grad norm with every incident\n"
    "                           and rollback marked, loss scale and LR factor (python3 with\n"
    "                           matplotlib)\n"
    "  version                  print the version and build facts\n"
    "\n"
    "POLICY is a YAML file or a shipped preset's name (default, megatron, ...).\n"
    "Run 'stepguard COMMAND --help' for a command's usage.\n";

// -h or --help anywhere among a command's arguments: its usage on stdout, exit 0 (as git does).
bool wants_help(const std::vector<std::string>& args) {
  for (const auto& a : args) {
    if (a == "-h" || a == "--help") return true;
  }
  return false;
}

// Prints every issue of `path` (a file or a preset's name) to stderr; true when it is valid.
bool report_policy_issues(const std::string& path) {
  const auto issues = stepguard::check_policy_file(path);
  for (const auto& issue : issues) std::cerr << issue << "\n";
  return issues.empty();
}

// What the preset is for: the first sentence of its leading comment, whole.
std::string preset_summary(const std::string& name) {
  std::istringstream text(stepguard::policy_preset_text(name));
  std::string line, comment;
  while (std::getline(text, line) && line.rfind("#", 0) == 0) {
    comment += (comment.empty() ? "" : " ") + line.substr(line.rfind("# ", 0) == 0 ? 2 : 1);
  }
  const std::size_t end = comment.find(". ");
  if (end != std::string::npos) comment.resize(end + 1);
  return comment;
}

// `text` in lines of at most `width` characters (broken at spaces; a longer word stands alone),
// every line after the first indented by `indent` spaces.
std::string wrapped(const std::string& text, std::size_t width, std::size_t indent) {
  std::istringstream words(text);
  std::string word, out, line;
  while (words >> word) {
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      out += line + "\n" + std::string(indent, ' ');
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
  }
  return out + line;
}

int run_policy_command(const std::vector<std::string>& args) {
  const std::string usage =
      "usage: stepguard policy check POLICY...   validate (exit 0 valid, 2 with FILE:LINE:COL "
      "lines)\n"
      "       stepguard policy explain POLICY    the policy's ladder in plain words\n"
      "       stepguard policy show PRESET       a shipped preset's YAML (to start a file from)\n"
      "       stepguard policy list              the shipped presets\n"
      "POLICY is a YAML file or a shipped preset's name (stepguard policy list).\n";
  if (wants_help(args)) {
    std::cout << usage;
    return 0;
  }
  if (args.empty()) {
    std::cerr << usage;
    return 2;
  }
  const std::vector<std::string> files(args.begin() + 1, args.end());
  if (args[0] == "check" && !files.empty()) {
    bool all_valid = true;
    for (const auto& file : files) {
      if (report_policy_issues(file)) {
        std::cout << file << ": ok\n";
      } else {
        all_valid = false;
      }
    }
    return all_valid ? 0 : 2;
  }
  if (args[0] == "explain" && files.size() == 1) {
    if (!report_policy_issues(files[0])) return 2;
    std::cout << stepguard::explain_policy_file(files[0]);
    return 0;
  }
  if (args[0] == "show" && files.size() == 1) {
    std::cout << stepguard::policy_preset_text(files[0]);  // invalid_argument: exit 2, named
    return 0;
  }
  if (args[0] == "list" && files.empty()) {
    for (const auto& name : stepguard::policy_preset_names()) {
      // The whole first sentence, wrapped under its column (nothing cut with "...").
      std::printf("%-16s %s\n", name.c_str(), wrapped(preset_summary(name), 63, 17).c_str());
    }
    return 0;
  }
  std::cerr << "stepguard policy: unexpected arguments\n" << usage;
  return 2;
}

int run_replay_command(const std::vector<std::string>& args) {
  const std::string usage =
      "usage: stepguard replay --policy POLICY --trace TRACE.jsonl [--loss-scaling | "
      "--framework-scale]\n"
      "POLICY is a YAML file or a shipped preset's name (stepguard policy list).\n"
      "--framework-scale: the trace is a framework integration's (DeepSpeed, Megatron-core,\n"
      "Lightning, HF): the framework decided the loss scale, and the policy's loss_scale\n"
      "section turns no scaler of the guard's on.\n";
  if (wants_help(args)) {
    std::cout << usage;
    return 0;
  }
  stepguard::ReplayOptions options;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--policy" || a == "--trace") {
      if (i + 1 == args.size()) {
        std::cerr << "stepguard replay: " << a << " needs a value\n" << usage;
        return 2;
      }
      (a == "--policy" ? options.policy_file : options.trace_file) = args[++i];
    } else if (a == "--loss-scaling") {
      options.loss_scaling = true;
    } else if (a == "--framework-scale") {
      options.framework_scale = true;
    } else {
      std::cerr << "stepguard replay: unexpected argument '" << a << "'\n" << usage;
      return 2;
    }
  }
  if (options.policy_file.empty() || options.trace_file.empty()) {
    std::cerr << "stepguard replay: --policy and --trace are required\n" << usage;
    return 2;
  }
  if (!report_policy_issues(options.policy_file)) return 2;
  try {
    const stepguard::ReplaySummary s = stepguard::replay_trace(options, std::cout);
    std::cerr << "replayed " << s.steps << " steps: " << s.applied << " applied, " << s.skipped
              << " skipped, " << s.rolled_back << " rolled back"
              << (s.aborted ? ", aborted at step " + std::to_string(s.abort_step) : "")
              << "; loss scale " << s.loss_scale << ", lr factor " << s.lr_factor << "\n";
  } catch (const std::exception& e) {
    std::cerr << "stepguard replay: " << message_of(e) << "\n";
    return 2;
  }
  return 0;
}

int run_ckpt_command(const std::vector<std::string>& args) {
  const std::string usage =
      "usage: stepguard ckpt ls DIR       list the checkpoints under DIR with their state\n"
      "       stepguard ckpt verify DIR   check every checkpoint's files (exit 0 all valid, 1 "
      "naming each bad file)\n";
  if (wants_help(args)) {
    std::cout << usage;
    return 0;
  }
  if (args.size() != 2 || (args[0] != "ls" && args[0] != "verify")) {
    std::cerr << usage;
    return 2;
  }
  const std::string& dir = args[1];
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    std::cerr << "stepguard ckpt: " << dir << ": not a directory\n";
    return 2;
  }
  const auto reports = stepguard::verify_checkpoints(dir);
  if (args[0] == "ls") {
    std::printf("%-12s %-6s %-12s %-16s %s\n", "step", "ranks", "bytes", "run", "state");
    for (const auto& r : reports) {
      std::string state = r.ok() ? "valid" : !r.complete ? "incomplete" : "BAD";
      const std::string run = r.run.empty() ? "-" : r.run;
      std::printf("%-12" PRId64 " %-6d %-12" PRId64 " %-16s %s  %s\n", r.step, r.world_size,
                  r.bytes, run.c_str(), state.c_str(), r.dir.c_str());
    }
    if (reports.empty()) std::printf("(no checkpoints in %s)\n", dir.c_str());
    return 0;
  }
  int bad = 0, valid = 0, incomplete = 0;
  for (const auto& r : reports) {
    if (r.ok()) {
      ++valid;
      std::cout << r.dir << ": ok (step " << r.step << ", run " << (r.run.empty() ? "-" : r.run)
                << ", " << r.world_size << " rank" << (r.world_size > 1 ? "s" : "") << ", "
                << r.bytes << " bytes)\n";
    } else if (!r.complete) {
      // Never committed (pending, a crash while writing, or a discarded state). Never loaded;
      // not an error. An unreadable directory or manifest is not this: it is bad.
      ++incomplete;
      std::cout << r.dir << ": incomplete, ignored (" << r.problems.front() << ")\n";
    } else {
      ++bad;
      for (const auto& p : r.problems) std::cerr << p << "\n";
    }
  }
  std::cout << valid << " valid, " << bad << " bad, " << incomplete << " incomplete\n";
  if (valid + bad == 0) {
    std::cerr << "stepguard ckpt verify: no complete checkpoint in " << dir << "\n";
    return 1;
  }
  return bad > 0 ? 1 : 0;
}

int run_incident_command(const std::vector<std::string>& args) {
  const std::string usage = "usage: stepguard incident show FILE   print an incident report\n";
  if (wants_help(args)) {
    std::cout << usage;
    return 0;
  }
  if (args.size() != 2 || args[0] != "show") {
    std::cerr << usage;
    return 2;
  }
  try {
    std::cout << stepguard::render_incident_report_file(args[1]);
  } catch (const std::invalid_argument& e) {
    std::cerr << "stepguard incident: " << e.what() << "\n";
    return 2;
  }
  return 0;
}

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
  if (!options->policy.empty()) {
    if (!report_policy_issues(options->policy)) return 2;
  }
  // Steady host memory for the training loop (this program's choice, not the library's): with
  // glibc's moving thresholds, the optimizer's per-step temporaries are at times mapped fresh and
  // fault every page in again; pinned, a demo iteration on 2 cores took 65 ms instead of 149 ms
  // (benchmarks/bench_step.cpp). Forked ranks run this same path.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
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
    if (command == "policy") return run_policy_command(args);
    if (command == "version" || command == "--version") {
      std::cout << stepguard::build_info() << "\n";
      return 0;
    }
    if (command == "replay") return run_replay_command(args);
    if (command == "ckpt") return run_ckpt_command(args);
    if (command == "incident") return run_incident_command(args);
    if (command == "plot") return stepguard::cli::run_plot_script(args);
    std::cerr << "stepguard: unknown command '" << command << "'\n" << kUsage;
    return 2;
  } catch (const std::invalid_argument& e) {
    std::cerr << "stepguard " << command << ": " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "stepguard " << command << ": error: " << message_of(e) << "\n";
    return 1;
  }
}
