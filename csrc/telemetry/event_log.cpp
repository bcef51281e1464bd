#include "csrc/telemetry/event_log.h"
#include "csrc/common/json_text.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <system_error>

namespace stepguard {
namespace telemetry {

namespace {
// JSON has no NaN/Inf: a non-finite number is written as null.
nlohmann::json number(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); }
}  // namespace

namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error("stepguard: cannot open event log '" + path + "': " + what);
}

// `path` opened for appending and locked by this guard; -1 when another holder has the lock.
int open_locked(const std::string& path, int flags) {
  // O_NONBLOCK: a FIFO without a reader is an error, not a hang (no effect on regular files).
  // O_NOFOLLOW: a link planted at the trace's name is refused, never appended through.
  const int fd =
      ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW | flags, 0644);
  if (fd < 0) {
    if (errno == EEXIST) return -2;
    fail(path, errno == ELOOP ? std::string("it is a symbolic link; give the trace a path of its "
                                            "own")
                              : std::string(std::strerror(errno)));
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    ::close(fd);
    if (error == EWOULDBLOCK) return -1;
    fail(path, std::strerror(error));
  }
  return fd;
}

}  // namespace

EventLog::EventLog(const std::string& path, bool every_step)
    : path_(path), every_step_(every_step) {
  // Its folder is made, as incident_dir's is (a missing one is an error of open() otherwise).
  const std::filesystem::path folder = std::filesystem::path(path).parent_path();
  if (!folder.empty()) {
    std::error_code ignored;  // a folder that cannot be made: open() says why, naming the path
    std::filesystem::create_directories(folder, ignored);
  }
  for (int attempt = 0; attempt < 8 && fd_ < 0; ++attempt) {
    const int fd = open_locked(path, O_CREAT);
    if (fd == -1) {
      fail(path,
           "another live guard writes it (another run, or another guard in this process); "
           "give each guard its own trace_path");
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int error = errno;
      ::close(fd);
      fail(path, std::strerror(error));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      fail(path, "not a regular file");
    }
    if (st.st_size == 0) {
      fd_ = fd;
      break;
    }
    // An earlier run's trace: keep it under the first free PATH.N, then start a new file (held
    // before the rename, so no live guard's trace is ever moved).
    std::string kept;
    for (int n = 1; n < 100000 && kept.empty(); ++n) {
      const std::string candidate = path + "." + std::to_string(n);
      struct stat other {};
      if (::lstat(candidate.c_str(), &other) != 0 && errno == ENOENT) kept = candidate;
    }
    if (kept.empty() || ::rename(path.c_str(), kept.c_str()) != 0) {
      const int error = errno;
      ::close(fd);
      fail(path, std::string("cannot keep the earlier trace aside: ") + std::strerror(error));
    }
    ::close(fd);
    kept_as_ = kept;
    const int fresh = open_locked(path, O_CREAT | O_EXCL);
    if (fresh >= 0) fd_ = fresh;  // else someone else made it in between: look again
  }
  if (fd_ < 0) fail(path, "it keeps changing under this guard");
  if (!kept_as_.empty()) {
    std::fprintf(stderr, "stepguard: the trace '%s' of an earlier run is kept as '%s'\n",
                 path.c_str(), kept_as_.c_str());
  }
}

EventLog::~EventLog() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

std::string trace_line(const StepReport& report, const GlobalStats& stats, const Signals& signals,
                       const Decision& decision, const std::vector<std::string>& tensors) {
  nlohmann::json line;
  line["step"] = report.step;
  line["loss"] = number(report.loss);
  line["grad_norm"] = number(report.grad_norm);
  line["nonfinite"] = report.nonfinite_count;
  line["nan"] = stats.nan_count;
  line["inf"] = stats.inf_count;
  line["loss_nonfinite_ranks"] = stats.loss_nonfinite_ranks;
  // What the decision read beyond the mean loss, so that `stepguard replay` decides the same: the
  // bound of the largest rank loss (when a rank stands out) and an overflow ruled out.
  if (std::isfinite(stats.loss_max_bound) && stats.loss_max_bound > stats.loss) {
    line["loss_max_bound"] = stats.loss_max_bound;
  }
  if (stats.overflow_ruled_out) line["overflow_ruled_out"] = true;
  // The trend detectors': the ranks (one rank's loss against the others') and the LR (a stall).
  if (stats.world_size > 1) {
    line["world_size"] = stats.world_size;
    line["loss_given_ranks"] = stats.loss_given_ranks;
  }
  if (std::isfinite(stats.largest_lr)) line["largest_lr"] = stats.largest_lr;
  if (stats.state_checked) line["state_bad"] = stats.state_bad_count;  // the state check ran
  if (stats.framework_loss_scale > 0) {
    line["framework_loss_scale"] = stats.framework_loss_scale;
    line["framework_min_scale"] = stats.framework_min_scale;
  }
  if (!report.loss_given) line["loss_given"] = false;  // step() without a loss: null is not NaN
  line["loss_scale"] = number(report.loss_scale);
  line["lr_factor"] = number(report.lr_factor);
  line["outcome"] = to_string(report.outcome);
  nlohmann::json actions = nlohmann::json::array();
  for (Action a : report.actions) actions.push_back(to_string(a));
  line["actions"] = std::move(actions);
  line["action"] = to_string(report.action);
  line["batches_to_skip"] = report.batches_to_skip;
  if (report.rolled_back_to > 0) line["rolled_back_to"] = report.rolled_back_to;
  if (report.deferred) line["deferred"] = true;
  if (signals.any()) {
    nlohmann::json raised = nlohmann::json::array();
    for (Signal s : signals.raised) raised.push_back(to_string(s));
    line["signals"] = std::move(raised);
  }
  if (!decision.rules.empty()) line["rules"] = decision.rules;
  if (decision.has(Action::kClip)) line["clip_norm"] = number(decision.clip_norm);
  if (!decision.reason.empty()) line["reason"] = decision.reason;
  if (!stats.faulty_ranks.empty()) line["faulty_ranks"] = stats.faulty_ranks;
  if (!stats.diverged_replicas.empty()) line["diverged_replicas"] = stats.diverged_replicas;
  if (report.incident) {
    const Incident& incident = *report.incident;
    line["cause"] = to_string(incident.cause);
    if (!incident.ranks.empty()) line["origin_ranks"] = incident.ranks;
    if (incident.origin_unknown) line["origin_unknown"] = true;
    if (!incident.rank_causes.empty()) {
      nlohmann::json causes = nlohmann::json::object();
      for (const RankCause& c : incident.rank_causes) {
        causes[std::to_string(c.rank)] = to_string(c.cause);
      }
      line["rank_causes"] = std::move(causes);
    }
  }
  if (!tensors.empty()) line["tensors"] = tensors;
  return dump_json(line);
}

void EventLog::record(const StepReport& report, const GlobalStats& stats, const Signals& signals,
                      const Decision& decision, const std::vector<std::string>& tensors) {
  const bool plain_apply = report.outcome == Outcome::kApplied && !report.incident.has_value();
  if (plain_apply && !every_step_) return;
  const std::string line = trace_line(report, stats, signals, decision, tensors) + '\n';
  // One write per line (O_APPEND): a crash loses at most the line being written.
  std::size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw std::runtime_error("stepguard: write to event log '" + path_ +
                               "' failed: " + std::strerror(errno));
    }
    done += static_cast<std::size_t>(n);
  }
}

}  // namespace telemetry
}  // namespace stepguard
