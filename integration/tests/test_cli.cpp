// The `stepguard` command's conventions, as git's: -h/--help at every level prints usage on stdout
// and exits 0; a missing value names its option; a shipped preset's name works wherever a policy
// file's path does (check, explain, replay, demo), and `policy show|list` print the presets.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "integration/tests/demo_support.h"

namespace stepguard {
namespace demo_test {
namespace {

TEST(Cli, HelpAtEveryLevelIsUsageOnStdoutAndExitZero) {
  for (const char* args :
       {"--help", "-h", "help", "policy --help", "policy check --help", "policy explain -h",
        "policy show --help", "policy list --help", "ckpt --help", "ckpt verify --help",
        "incident --help", "incident show -h", "replay --help", "replay --policy default --help",
        "demo --help", "plot --help"}) {
    const ProcessResult r = run_stepguard(args);
    EXPECT_EQ(r.status, 0) << args << ": " << r.err;
    EXPECT_NE(r.out.find("usage: stepguard"), std::string::npos) << args << ": " << r.out;
    EXPECT_EQ(r.err, "") << args;
  }
  // No command at all is a usage error (stderr, 2), as an unknown one is.
  ProcessResult r = run_stepguard("");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("usage: stepguard"), std::string::npos) << r.err;
  r = run_stepguard("frobnicate");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("unknown command 'frobnicate'"), std::string::npos) << r.err;
}

TEST(Cli, AMissingValueNamesItsOption) {
  ProcessResult r = run_stepguard("replay --trace t.jsonl --policy");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("stepguard replay: --policy needs a value"), std::string::npos) << r.err;
  r = run_stepguard("demo --steps");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--steps"), std::string::npos) << r.err;
}

TEST(Cli, PresetsByNameInCheckExplainReplayAndDemo) {
  ProcessResult r = run_stepguard("policy check default palm-rollback");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "default: ok\npalm-rollback: ok\n");

  r = run_stepguard("policy explain palm-rollback");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("Rules, checked in this order"), std::string::npos) << r.out;
  r = run_stepguard("policy explain default");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("[rollback-diverged-replica] on a rank whose parameters differ from the "
                       "other replicas': roll back"),
            std::string::npos)
      << r.out;

  // A misspelt name: what it is not, the closest preset and the list; nothing else printed.
  r = run_stepguard("policy check defualt");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err,
            "defualt: no policy file of that name and no shipped preset (did you mean "
            "'default'?) (presets: debug-strict, deepspeed-fp16, default, megatron, "
            "palm-rollback)\n");
  EXPECT_EQ(r.out, "");
  // A path is a path: its own error, no preset talk.
  r = run_stepguard("policy check ./default");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("./default: cannot read policy file: No such file"), std::string::npos)
      << r.err;

  const std::string summary = temp_path("s.json");
  const std::string trace = temp_path("t.jsonl");
  r = run_stepguard("demo --steps 12 --inject nan_grad@5 --policy palm-rollback --summary-json '" +
                    summary + "' --trace '" + trace + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto s = read_json(summary);
  EXPECT_EQ(s["policy"], "palm-rollback");
  EXPECT_EQ(s["skipped"], 1) << s.dump();

  r = run_stepguard("replay --policy default --trace '" + trace + "'");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("replayed 12 steps: 11 applied, 1 skipped"), std::string::npos) << r.err;
}

TEST(Cli, PolicyListNamesThePresetsAndShowPrintsOneThatChecks) {
  ProcessResult r = run_stepguard("policy list");
  ASSERT_EQ(r.status, 0) << r.err;
  for (const char* name :
       {"default", "megatron", "deepspeed-fp16", "palm-rollback", "debug-strict"}) {
    EXPECT_NE(("\n" + r.out).find(std::string("\n") + name + " "), std::string::npos)
        << name << " in:\n"
        << r.out;
  }
  EXPECT_NE(r.out.find("PaLM paper"), std::string::npos) << r.out;  // each with what it is for

  r = run_stepguard("policy show palm-rollback");
  ASSERT_EQ(r.status, 0) << r.err;
  const std::string shipped =
      slurp(std::string(STEPGUARD_SOURCE_DIR) + "/configs/policies/palm-rollback.yaml");
  EXPECT_EQ(r.out, shipped);  // the file, comments included: a start for one's own
  const std::string copy = temp_path("mine.yaml");
  std::ofstream(copy) << r.out;
  EXPECT_EQ(run_stepguard("policy check '" + copy + "'").status, 0);

  r = run_stepguard("policy show nope");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("no shipped policy preset 'nope' (presets: debug-strict,"),
            std::string::npos)
      << r.err;
}

TEST(Cli, TheDemoIncidentTableKeepsItsColumnsApart) {
  // Two ranks: the ranks column holds "1:backward", wider than its header; every column still
  // starts where its header does.
  const ProcessResult r = run_stepguard("demo --ranks 2 --steps 8 --inject nan_grad@4:1");
  ASSERT_EQ(r.status, 0) << r.err;
  std::istringstream out(r.out);
  std::string line, header;
  std::vector<std::string> rows;
  while (std::getline(out, line)) {
    if (line.find("    step") == 0) header = line;
    if (!header.empty() && line != header && line.rfind("    ", 0) == 0 &&
        line.find("nonfinite_grad") != std::string::npos) {
      rows.push_back(line);
    }
  }
  ASSERT_FALSE(header.empty()) << r.out;
  ASSERT_EQ(rows.size(), 1u) << r.out;
  for (const char* column : {"signal", "action", "cause", "ranks"}) {
    const std::size_t at = header.find(column);
    ASSERT_NE(at, std::string::npos) << header;
    EXPECT_EQ(rows[0][at - 2], ' ') << column << "\n" << header << "\n" << rows[0];
    EXPECT_EQ(rows[0][at - 1], ' ') << column << "\n" << header << "\n" << rows[0];
    EXPECT_NE(rows[0][at], ' ') << column << "\n" << header << "\n" << rows[0];
  }
  EXPECT_NE(rows[0].find("1:backward"), std::string::npos) << rows[0];
}

}  // namespace
}  // namespace demo_test
}  // namespace stepguard
