// The one file layer (csrc/common/safe_file.h) and every C++ reader and writer that uses it: a
// FIFO, a device, a folder or an oversized file is refused unread (a FIFO never hangs a reader),
// and no write goes through a link planted at the target or at its temporary name. Torch-free.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <stepguard/replay.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "csrc/common/safe_file.h"
#include "csrc/policy/policy_file.h"
#include "csrc/telemetry/event_log.h"
#include "tests/support/fresh_dir.h"

namespace stepguard {
namespace {

namespace fs = std::filesystem;

std::string contents(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// A file outside the folder a writer writes into, and a link to it planted at `at`.
std::string plant_link(const std::string& dir, const std::string& at) {
  const std::string outside = dir + "/../" + fs::path(dir).filename().string() + "_outside.txt";
  std::ofstream(outside) << "not yours\n";
  fs::remove(at);
  fs::create_symlink(outside, at);
  return outside;
}

std::string refusal_of_read(const std::string& path, std::int64_t max_bytes) {
  std::string text, why;
  EXPECT_FALSE(read_regular_file(path, max_bytes, &text, &why));
  EXPECT_TRUE(text.empty());
  return why;
}

TEST(SafeFile, ReadsOnlyABoundedRegularFile) {
  const std::string dir = fresh_dir("safe_read");
  const std::string fifo = dir + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto started = std::chrono::steady_clock::now();
  EXPECT_EQ(refusal_of_read(fifo, 100), "a FIFO, not a regular file");
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(5));
  EXPECT_EQ(refusal_of_read("/dev/zero", 100), "a device, not a regular file");
  EXPECT_EQ(refusal_of_read(dir, 100), "a directory, not a file");
  EXPECT_EQ(refusal_of_read(dir + "/none", 100), "No such file or directory");
  const std::string sparse = dir + "/sparse";
  std::ofstream(sparse).close();
  ASSERT_EQ(::truncate(sparse.c_str(), off_t{1} << 30), 0);
  EXPECT_EQ(refusal_of_read(sparse, 1 << 20),
            "1073741824 bytes, more than the 1048576 this file can hold");
  // A link to a regular file is read; a link to a FIFO is a FIFO.
  std::ofstream(dir + "/plain") << "text";
  fs::create_symlink(dir + "/plain", dir + "/to_plain");
  fs::create_symlink(fifo, dir + "/to_fifo");
  std::string text, why;
  EXPECT_TRUE(read_regular_file(dir + "/to_plain", 100, &text, &why));
  EXPECT_EQ(text, "text");
  EXPECT_EQ(refusal_of_read(dir + "/to_fifo", 100), "a FIFO, not a regular file");
}

TEST(SafeFile, LinesStopAtALineOverTheLimit) {
  const std::string dir = fresh_dir("safe_lines");
  const std::string path = dir + "/lines";
  std::ofstream(path) << "one\n\ntwo" << std::string(100, 'x') << "\nlast";
  {
    RegularFileLines lines(path, 1 << 20, 1000, "trace");
    std::string line;
    ASSERT_TRUE(lines.next(&line));
    EXPECT_EQ(line, "one");
    ASSERT_TRUE(lines.next(&line));
    EXPECT_EQ(line, "");
    ASSERT_TRUE(lines.next(&line));
    EXPECT_EQ(line, "two" + std::string(100, 'x'));
    ASSERT_TRUE(lines.next(&line));
    EXPECT_EQ(line, "last");
    EXPECT_FALSE(lines.next(&line));
  }
  RegularFileLines short_lines(path, 1 << 20, 50, "trace");
  std::string line;
  ASSERT_TRUE(short_lines.next(&line));
  ASSERT_TRUE(short_lines.next(&line));
  try {
    short_lines.next(&line);
    FAIL() << "a line over the limit was read";
  } catch (const FileError& e) {
    EXPECT_EQ(std::string(e.what()), path + ": a line longer than 50 bytes");
  }
  try {
    RegularFileLines zeros("/dev/zero", 1 << 20, 50, "trace");
    FAIL() << "/dev/zero was opened";
  } catch (const FileError& e) {
    EXPECT_EQ(std::string(e.what()), "/dev/zero: cannot read trace: a device, not a regular file");
  }
}

TEST(SafeFile, AWriteNeverGoesThroughAPlantedLink) {
  const std::string dir = fresh_dir("safe_write");
  const std::string target = dir + "/report.json";
  // At the target: the link is replaced by the new file, its target keeps its bytes.
  const std::string outside = plant_link(dir, target);
  write_file_atomically(target, "mine\n");
  EXPECT_EQ(contents(outside), "not yours\n");
  EXPECT_FALSE(fs::is_symlink(target));
  EXPECT_EQ(contents(target), "mine\n");
  // At the predictable temporary name: unlinked, never written through.
  const std::string tmp = target + ".tmp." + std::to_string(::getpid());
  plant_link(dir, tmp);
  write_file_atomically(target, "again\n");
  EXPECT_EQ(contents(outside), "not yours\n");
  EXPECT_EQ(contents(target), "again\n");
  EXPECT_FALSE(fs::exists(tmp));
  // A folder at the target is left alone.
  fs::create_directory(dir + "/folder");
  EXPECT_THROW(write_file_atomically(dir + "/folder", "x"), FileError);
  EXPECT_TRUE(fs::is_directory(dir + "/folder"));
  EXPECT_FALSE(fs::exists(dir + "/folder.tmp." + std::to_string(::getpid())));
}

TEST(SafeFile, TheTraceRefusesALinkAtItsName) {
  const std::string dir = fresh_dir("safe_trace_link");
  const std::string path = dir + "/trace.jsonl";
  const std::string outside = plant_link(dir, path);
  std::ofstream(outside, std::ios::trunc).close();  // empty: the case the old code appended to
  try {
    telemetry::EventLog log(path, true);
    FAIL() << "a trace was opened through a link";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("it is a symbolic link"), std::string::npos) << e.what();
  }
  EXPECT_EQ(contents(outside), "");
}

// Each reader of a file the user names, given a FIFO (no writer: the old readers blocked forever),
// /dev/zero (they read until memory ran out) and a sparse gigabyte (read whole before its error).
TEST(SafeFile, PolicyAndTraceReadersRefuseWhatIsNotABoundedFile) {
  const std::string dir = fresh_dir("safe_readers");
  const std::string fifo = dir + "/policy.yaml";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string sparse = dir + "/big.yaml";
  std::ofstream(sparse).close();
  ASSERT_EQ(::truncate(sparse.c_str(), off_t{1} << 30), 0);
  const auto started = std::chrono::steady_clock::now();
  const auto policy_issue = [](const std::string& path) {
    const auto issues = policy::check_policy_file(path, nullptr);
    EXPECT_EQ(issues.size(), 1u);
    return issues.empty() ? std::string() : issues[0].format();
  };
  EXPECT_EQ(policy_issue(fifo), fifo + ": cannot read policy file: a FIFO, not a regular file");
  EXPECT_EQ(policy_issue("/dev/zero"),
            "/dev/zero: cannot read policy file: a device, not a regular file");
  EXPECT_EQ(policy_issue(sparse), sparse +
                                      ": cannot read policy file: 1073741824 bytes, more than "
                                      "the 1048576 this file can hold");
  const std::string policy = std::string(STEPGUARD_SOURCE_DIR) + "/tests/data/replay/policy.yaml";
  const auto replay_error = [&policy](const std::string& trace) {
    std::ostringstream out;
    try {
      replay_trace({policy, trace, false}, out);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(replay_error(fifo), fifo + ": cannot read trace: a FIFO, not a regular file");
  EXPECT_EQ(replay_error("/dev/zero"),
            "/dev/zero: cannot read trace: a device, not a regular file");
  const std::string long_line = dir + "/trace.jsonl";
  std::ofstream(long_line).close();
  ASSERT_EQ(::truncate(long_line.c_str(), off_t{8} << 20), 0);  // 8 MB of NUL, no newline
  EXPECT_EQ(replay_error(long_line), long_line + ": a line longer than 1048576 bytes");
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(20));
}

}  // namespace
}  // namespace stepguard
