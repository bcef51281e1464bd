// The offline tools behind the CLI (stepguard/tools.h) and the trace writer on hostile text:
// deep JSON is an error, not a stack overflow; invalid UTF-8 in names never stops a trace line;
// a picture attached to an incident report.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>

#include "csrc/telemetry/event_log.h"
#include "stepguard/tools.h"
#include "tests/support/fresh_dir.h"

namespace stepguard {
namespace {

TEST(Tools, ADeeplyNestedIncidentReportIsAnErrorNotACrash) {
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  try {
    render_incident_report(deep, "deep.json");
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "deep.json: not an incident report (nested deeper than 64 levels)");
  }
  EXPECT_THROW(render_incident_report("{\"step\": 1}", "x.json"), std::invalid_argument);
  const std::string md = render_incident_report(
      R"({"step": 7, "cause": "data", "signal": "nonfinite_loss", "action": "skip_batch"})",
      "ok.json");
  EXPECT_NE(md.find("data"), std::string::npos);
}

TEST(Tools, AReportWithWrongTypesOrEscapeCodesIsSafeToShow) {
  try {
    render_incident_report(R"({"step": 1, "cause": "data", "evidence": 5, "fixes": {"a": 1}})",
                           "typed.json");
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()).rfind("typed.json: not an incident report (a field has the "
                                          "wrong type: ",
                                          0),
              0u)
        << e.what();
  }
  const std::string md = render_incident_report(
      "{\"step\": 2, \"cause\": \"data\", \"reason\": \"\\u001b[2J\\u001b]0;owned\\u0007x\"}",
      "escape.json");
  EXPECT_EQ(md.find('\x1b'), std::string::npos) << md;
  EXPECT_EQ(md.find('\x07'), std::string::npos) << md;
  EXPECT_NE(md.find("?[2J"), std::string::npos) << md;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(Tools, AnAttachedPictureIsLinkedFromTheReportByItsFileName) {
  const std::string dir = fresh_dir("attach_picture");
  const std::string report = dir + "/incident-step-000000007.json";
  std::ofstream(report) << R"({"step": 7, "cause": "data", "signal": "nonfinite_loss"})";
  attach_incident_picture(report, dir + "/incident-step-000000007.png");
  const auto json = nlohmann::json::parse(read_text(report));
  EXPECT_EQ(json["picture"], dir + "/incident-step-000000007.png");
  EXPECT_EQ(json["step"], 7);
  const std::string md = read_text(dir + "/incident-step-000000007.md");
  EXPECT_EQ(md.rfind("# Incident at step 7: data\n\n- signal: `nonfinite_loss`\n", 0), 0u) << md;
  EXPECT_NE(md.find("\n![steps around the incident](incident-step-000000007.png)\n"),
            std::string::npos)
      << md;

  try {
    attach_incident_picture(dir + "/none.json", "x.png");
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), dir + "/none.json: cannot read: No such file or directory");
  }
  const std::string summary = dir + "/summary.json";
  std::ofstream(summary) << R"({"steps": 3})";
  try {
    attach_incident_picture(summary, "x.png");
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), summary + ": not an incident report (no 'step' and 'cause')");
  }
  EXPECT_EQ(read_text(summary), R"({"steps": 3})");  // untouched
}

TEST(Tools, TraceLinesReplaceInvalidUtf8InsteadOfThrowing) {
  StepReport report;
  report.step = 3;
  Decision decision;
  decision.rules = {"caf\xe9"};
  decision.reason = "rule caf\xe9 fired";
  const std::string line = telemetry::trace_line(report, GlobalStats{}, Signals{}, decision, {});
  const auto j = nlohmann::json::parse(line);
  EXPECT_EQ(j["rules"][0], "caf\xef\xbf\xbd");  // U+FFFD
}

// `stepguard incident show` reads a regular file of bounded size: a FIFO does not hang it, a
// device or a sparse terabyte is refused before a byte is read.
TEST(IncidentShow, OnlyABoundedRegularFileIsRead) {
  const std::string dir = fresh_dir("incident_show");
  const std::string fifo = dir + "/report.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto refusal = [](const std::string& path) {
    try {
      render_incident_report_file(path);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(refusal(fifo), fifo + ": cannot read: a FIFO, not a regular file");
  EXPECT_EQ(refusal("/dev/zero"), "/dev/zero: cannot read: a device, not a regular file");
  const std::string huge = dir + "/huge.json";
  std::ofstream(huge).close();
  ASSERT_EQ(::truncate(huge.c_str(), off_t{1} << 40), 0);
  EXPECT_EQ(refusal(huge), huge +
                               ": cannot read: 1099511627776 bytes, more than the 16777216 "
                               "this file can hold");
  EXPECT_EQ(refusal(dir + "/none.json"),
            dir + "/none.json: cannot read: No such file or directory");
}

// A trace belongs to one live guard: a second one on the same path is refused, and a trace an
// earlier run left is kept aside, never truncated.
TEST(EventLog, ATraceIsHeldByOneGuardAndAnEarlierOneIsKept) {
  const std::string dir = fresh_dir("event_log_lock");
  const std::string path = dir + "/trace.jsonl";
  StepReport report;
  report.step = 1;
  {
    telemetry::EventLog first(path, true);
    first.record(report, GlobalStats{}, Signals{}, Decision{}, {});
    try {
      telemetry::EventLog second(path, true);
      FAIL() << "a second live guard got the trace";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("another live guard writes it"), std::string::npos)
          << e.what();
    }
  }
  telemetry::EventLog again(path, true);
  EXPECT_EQ(again.kept_as(), path + ".1");
  std::ifstream kept(path + ".1");
  std::string line;
  ASSERT_TRUE(std::getline(kept, line));
  EXPECT_NE(line.find("\"step\":1"), std::string::npos) << line;
  std::ifstream now(path);
  EXPECT_FALSE(std::getline(now, line));  // the new trace starts empty
  const std::string fifo = dir + "/fifo.jsonl";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_THROW(telemetry::EventLog(fifo, true), std::runtime_error);  // refused, not blocked on
}

}  // namespace
}  // namespace stepguard
