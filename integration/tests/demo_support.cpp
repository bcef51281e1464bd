#include "integration/tests/demo_support.h"

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

namespace stepguard {
namespace demo_test {

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string temp_path(const std::string& name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return ::testing::TempDir() + "/sg_" + info->name() + "_" + name;
}

ProcessResult run_stepguard(const std::string& args) {
  const std::string out = temp_path("stdout"), err = temp_path("stderr");
  const std::string cmd =
      std::string("'") + STEPGUARD_BIN + "' " + args + " >'" + out + "' 2>'" + err + "' </dev/null";
  const int raw = std::system(cmd.c_str());
  ProcessResult r;
  if (WIFEXITED(raw)) {
    r.status = WEXITSTATUS(raw);
    // /bin/sh reports a child killed by a signal as 128 + signal.
  } else if (WIFSIGNALED(raw)) {
    r.status = 128 + WTERMSIG(raw);
  }
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(slurp(path)); }

std::vector<nlohmann::json> json_lines(const std::string& text) {
  std::vector<nlohmann::json> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

std::vector<std::string> outcomes_in(const std::string& trace) {
  std::ifstream in(trace);
  std::vector<std::string> outcomes;
  std::string line;
  while (std::getline(in, line)) outcomes.push_back(nlohmann::json::parse(line)["outcome"]);
  return outcomes;
}

int processes_mentioning(const std::string& needle) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(entry.path() / "cmdline", std::ios::binary);
    std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (cmdline.find(needle) != std::string::npos) ++count;
  }
  return count;
}

void expect_summary(const nlohmann::json& s, const SummaryCheck& check) {
  if (check.ranks_) {
    EXPECT_EQ(s["ranks"], *check.ranks_);
  }
  if (check.steps_) {
    EXPECT_EQ(s["steps"], *check.steps_);
  }
  if (check.applied_) {
    EXPECT_EQ(s["applied"], *check.applied_);
  }
  if (check.skipped_) {
    EXPECT_EQ(s["skipped"], *check.skipped_);
  }
  if (check.rollbacks_) {
    EXPECT_EQ(s["rollbacks"], *check.rollbacks_);
  }
  if (check.min_rollbacks_) {
    EXPECT_GE(s["rollbacks"], *check.min_rollbacks_);
  }
  if (check.aborted_) {
    EXPECT_EQ(s["aborted"], *check.aborted_);
  }
  if (check.params_finite_) {
    EXPECT_EQ(s["params_finite"], *check.params_finite_);
  }
  if (check.outcomes_agree_) {
    EXPECT_EQ(s["outcomes_agree"], *check.outcomes_agree_);
  }
  if (check.collectives_) {
    EXPECT_EQ(s["collectives"], *check.collectives_);
  }
  if (check.step_buffer_bytes_) {
    EXPECT_EQ(s["step_buffer_bytes"], *check.step_buffer_bytes_);
  }
  if (check.param_hashes_) {
    ASSERT_EQ(s["param_hashes"].size(), *check.param_hashes_);
  }
  if (check.replicas_equal_) {
    for (const auto& h : s["param_hashes"]) EXPECT_EQ(h, s["param_hashes"][0]);
  }
  if (check.learned_) {
    const double initial = s["initial_loss"], final_loss = s["final_loss"];
    EXPECT_LT(final_loss, 0.8 * initial) << "initial " << initial << " final " << final_loss;
  }
}

}  // namespace demo_test
}  // namespace stepguard
