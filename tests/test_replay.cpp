// Replay: a hand-written trace through a hand-written policy gives the decisions derived by hand
// in tests/data/replay/expected.jsonl (and tabled in configs/policies/README.md); a bad trace is a
// clear error naming the file and line.
#include <gtest/gtest.h>
#include <stepguard/replay.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

namespace stepguard {
namespace {

const std::string kData = std::string(STEPGUARD_SOURCE_DIR) + "/tests/data/replay/";

std::vector<nlohmann::json> lines_of(const std::string& text) {
  std::vector<nlohmann::json> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

TEST(Replay, HandWrittenTraceGivesTheDocumentedDecisions) {
  std::ostringstream out;
  const ReplaySummary s = replay_trace({kData + "policy.yaml", kData + "trace.jsonl", false}, out);
  std::ifstream expected_file(kData + "expected.jsonl");
  std::stringstream expected_text;
  expected_text << expected_file.rdbuf();
  const auto expected = lines_of(expected_text.str());
  const auto got = lines_of(out.str());
  ASSERT_EQ(got.size(), expected.size()) << out.str();
  for (std::size_t i = 0; i < got.size(); ++i) {
    for (const char* key : {"step", "outcome", "actions", "loss_scale", "lr_factor"}) {
      EXPECT_EQ(got[i][key], expected[i][key]) << "line " << i + 1 << ", " << key;
    }
  }
  EXPECT_EQ(got[8]["signals"], nlohmann::json::array({"loss_spike"}));
  EXPECT_EQ(got[8]["rules"], nlohmann::json::array({"skip-spike"}));
  EXPECT_EQ(got[5]["rules"], nlohmann::json::array({"skip-nan", "halve-lr"}));
  EXPECT_EQ(s.steps, 14);
  EXPECT_EQ(s.applied, 7);
  EXPECT_EQ(s.skipped, 6);
  EXPECT_TRUE(s.aborted);
  EXPECT_EQ(s.abort_step, 14);
  EXPECT_EQ(s.loss_scale, 64);
}

TEST(Replay, AFrameworkIntegrationsTraceRunsWithoutTheGuardsScaler) {
  // The same trace as a framework integration's (--framework-scale): the policy's loss_scale
  // section turns no scaler on, so the scale is 1 throughout and the same steps are skipped,
  // with no scale drop (the trace carries no framework scale: bf16 or fp32).
  std::ostringstream out;
  ReplayOptions options{kData + "policy.yaml", kData + "trace.jsonl", false};
  options.framework_scale = true;
  const ReplaySummary s = replay_trace(options, out);
  EXPECT_EQ(s.steps, 14);
  EXPECT_EQ(s.skipped, 6);
  EXPECT_TRUE(s.aborted);
  EXPECT_EQ(s.loss_scale, 1);
  for (const auto& line : lines_of(out.str())) EXPECT_EQ(line["loss_scale"], 1) << line;
}

std::string replay_error(const std::string& trace_text) {
  const std::string path = ::testing::TempDir() + "/sg_replay_trace.jsonl";
  std::ofstream(path) << trace_text;
  std::ostringstream out;
  try {
    replay_trace({kData + "policy.yaml", path, false}, out);
  } catch (const std::runtime_error& e) {
    std::remove(path.c_str());
    std::string what = e.what();
    return what.substr(what.find("sg_replay_trace.jsonl"));
  }
  std::remove(path.c_str());
  return "no error";
}

TEST(Replay, BadTraceLinesNameFileAndLine) {
  EXPECT_EQ(replay_error("{\"step\": 1, \"loss\": 1}\n{oops\n"),
            "sg_replay_trace.jsonl:2: not a JSON object: [json.exception.parse_error.101] parse "
            "error at line 1, column 2: syntax error while parsing object key - invalid literal; "
            "last read: '{o'; expected string literal");
  EXPECT_EQ(replay_error("{\"step\": 2, \"loss\": 1}\n{\"step\": 2, \"loss\": 1}\n"),
            "sg_replay_trace.jsonl:2: 'step' must be a whole number above the previous line's "
            "(2)");
  EXPECT_EQ(replay_error("{\"step\": 1}\n"),
            "sg_replay_trace.jsonl:1: needs 'loss' (a number, "
            "or null)");
  EXPECT_EQ(replay_error("{\"step\": 1, \"loss\": \"low\"}\n"),
            "sg_replay_trace.jsonl:1: 'loss' must be a number or null, got \"low\"");
  EXPECT_EQ(replay_error("{\"step\": 1, \"loss\": 1, \"nan\": -3}\n"),
            "sg_replay_trace.jsonl:1: 'nan' must be a whole number >= 0, got -3");
  EXPECT_EQ(replay_error("[1, 2]\n"), "sg_replay_trace.jsonl:1: not a JSON object");
  EXPECT_EQ(replay_error("\n\n"), "no error");  // an empty trace replays nothing
  // A number beyond fp64 and nesting 200,000 deep: errors with file and line, not a crash.
  EXPECT_EQ(replay_error("{\"step\": 1, \"loss\": 1e999}\n").rfind("sg_replay_trace.jsonl:1: ", 0),
            0u);
  const std::string deep = "{\"step\": 1, \"loss\": " + std::string(200000, '[') + "\n";
  EXPECT_EQ(replay_error(deep),
            "sg_replay_trace.jsonl:1: not a JSON object: nested deeper than 64 levels");
}

// What the trend detectors read is in the trace (world_size, loss_given_ranks, largest_lr): a
// replay of a 2-rank run decides as it did.
TEST(Replay, TheTrendDetectorsReadWhatTheTraceRecords) {
  const std::string dir = ::testing::TempDir();
  const std::string policy = dir + "/sg_trend_policy.yaml";
  const std::string trace = dir + "/sg_trend_trace.jsonl";
  std::ofstream(policy) << "version: 1\ndetectors:\n  stall: {steps: 3}\n"
                           "  rank_loss_shift: {warmup: 10}\nrules:\n  - {on: stall, action: "
                           "alert}\n  - {on: rank_loss_shift, action: skip_batch}\n";
  {
    std::ofstream t(trace);
    for (int step = 1; step <= 30; ++step) {
      nlohmann::json line = {{"step", step},
                             {"grad_norm", 1.0},
                             {"world_size", 2},
                             {"loss_given_ranks", 2},
                             {"largest_lr", step <= 20 ? 1e-3 : 0.0}};
      const double a = 2.0 + 0.01 * (step % 3);
      const double b = step > 12 && step <= 18 ? 3.0 * a : a;  // rank 1 apart for 6 steps
      line["loss"] = (a + b) / 2;
      if (b > a) line["loss_max_bound"] = b;
      t << line.dump() << "\n";
    }
  }
  std::ostringstream out;
  const ReplaySummary s = replay_trace({policy, trace, false}, out);
  std::vector<int> shifted, stalled;
  for (const auto& line : lines_of(out.str())) {
    const auto signals = line.value("signals", nlohmann::json::array());
    for (const auto& sig : signals) {
      if (sig == "rank_loss_shift") shifted.push_back(line["step"]);
      if (sig == "stall") stalled.push_back(line["step"]);
    }
  }
  EXPECT_EQ(shifted, (std::vector<int>{15, 16, 17, 18, 19, 20})) << out.str();
  EXPECT_EQ(stalled, (std::vector<int>{23, 26, 29})) << out.str();
  EXPECT_EQ(s.skipped, 6);
  std::remove(policy.c_str());
  std::remove(trace.c_str());
  EXPECT_EQ(replay_error("{\"step\": 1, \"loss\": 1, \"world_size\": 0}\n"),
            "sg_replay_trace.jsonl:1: 'world_size' must be a whole number in [1, 2^30], got 0");
}

TEST(Replay, MissingFilesAreClearErrors) {
  std::ostringstream out;
  try {
    replay_trace({kData + "policy.yaml", "/nonexistent/trace.jsonl", false}, out);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()),
              "/nonexistent/trace.jsonl: cannot read trace: No such file or directory");
  }
  EXPECT_THROW(replay_trace({"/nonexistent/policy.yaml", kData + "trace.jsonl", false}, out),
               std::runtime_error);
  EXPECT_TRUE(out.str().empty());
}

}  // namespace
}  // namespace stepguard
