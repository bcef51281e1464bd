#include "plugin/cli/demo/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>

namespace stepguard {
namespace demo {

Progress::Progress(std::int64_t total, std::int64_t log_every)
    : total_(total), tty_(isatty(STDERR_FILENO) == 1) {
  every_ = log_every > 0 ? log_every : std::max<std::int64_t>(1, total / 10);
}

void Progress::update(const StepReport& r, double tokens_per_s, const GuardedOptimizer& guard) {
  const bool last = r.step == total_;
  // The loss scale only matters (and is shown) under fp16 loss scaling.
  char scale[48] = "";
  if (r.loss_scale != 1.0) std::snprintf(scale, sizeof scale, "  scale %g", r.loss_scale);
  if (tty_) {
    const auto now = std::chrono::steady_clock::now();
    if (!last && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    const std::int64_t skipped = guard.stats().totals.skipped;
    std::fprintf(stderr,
                 "\r\033[K  step %6" PRId64 "/%" PRId64
                 "  loss %7.4f  %8.0f tok/s  skipped %" PRId64 "%s",
                 r.step, total_, r.loss, tokens_per_s, skipped, scale);
    if (last) std::fputc('\n', stderr);
    std::fflush(stderr);
  } else if (r.step % every_ == 0 || last || r.step == 1) {
    const std::int64_t skipped = guard.stats().totals.skipped;
    std::fprintf(stderr,
                 "step %" PRId64 "/%" PRId64 " loss %.4f tok/s %.0f skipped %" PRId64 "%s\n",
                 r.step, total_, r.loss, tokens_per_s, skipped, scale);
  }
}

void Progress::note(const std::string& line) {
  if (tty_) std::fputs("\r\033[K", stderr);
  std::fprintf(stderr, "%s\n", line.c_str());
}

}  // namespace demo
}  // namespace stepguard
