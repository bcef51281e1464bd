#include "plugin/cli/demo/launcher.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace stepguard {
namespace demo {

namespace {

using Clock = std::chrono::steady_clock;

// A port the kernel just handed out on loopback; free again once the socket closes.
int free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(std::string("demo: socket(): ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    throw std::runtime_error("demo: cannot find a free loopback port: " + why);
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

std::string describe(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" +
           strsignal(WTERMSIG(status)) + ")";
  }
  return "ended with wait status " + std::to_string(status);
}

// SIGTERM or SIGINT to the launcher: forwarded to every rank, so none is left training.
volatile std::sig_atomic_t g_stop_signal = 0;
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

void catch_stop_signals() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
}

// In the forked child: becomes rank `r` of `ranks` (torchrun's environment), running `argv`.
[[noreturn]] void exec_rank(int r, int ranks, int port, pid_t launcher, std::vector<char*>& argv) {
  // A rank dies with its launcher, however the launcher ends (even SIGKILL).
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher) std::_Exit(1);
  ::setenv("RANK", std::to_string(r).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(ranks).c_str(), 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  ::setenv("STEPGUARD_DEMO_LAUNCHED", "1", 1);
  ::execv("/proc/self/exe", argv.data());
  std::fprintf(stderr, "demo: exec of rank %d failed: %s\n", r, std::strerror(errno));
  std::_Exit(127);
}

// Forks one process per rank, each running this binary's demo with the same arguments.
std::vector<pid_t> start_ranks(const DemoOptions& o, int port) {
  std::vector<std::string> args = {"/proc/self/exe", "demo"};
  args.insert(args.end(), o.raw_args.begin(), o.raw_args.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  std::vector<pid_t> pids(o.ranks, -1);
  const pid_t launcher = ::getpid();
  for (int r = 0; r < o.ranks; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      for (pid_t p : pids) {
        if (p > 0) ::kill(p, SIGKILL);
      }
      throw std::runtime_error(std::string("demo: fork(): ") + std::strerror(errno));
    }
    if (pid == 0) exec_rank(r, o.ranks, port, launcher, argv);
    pids[r] = pid;
  }
  return pids;
}

// The ranks' wait statuses, in rank order, once every rank has ended. A stop signal to the
// launcher is forwarded; after a failure (or a stop) the ranks still running get a deadline, then
// are killed.
std::vector<int> wait_for_ranks(const DemoOptions& o, const std::vector<pid_t>& pids) {
  std::vector<int> status(o.ranks, 0);
  std::vector<bool> done(o.ranks, false);
  int remaining = o.ranks;
  bool failure_seen = false;
  Clock::time_point kill_at = Clock::time_point::max();
  const auto grace = std::chrono::seconds(o.collective_timeout_s) + std::chrono::seconds(15);
  bool forwarded = false;
  while (remaining > 0) {
    if (g_stop_signal != 0 && !forwarded) {
      std::fprintf(stderr, "stepguard demo: %s: stopping every rank\n", strsignal(g_stop_signal));
      for (int r = 0; r < o.ranks; ++r) {
        if (!done[r]) ::kill(pids[r], g_stop_signal);
      }
      forwarded = true;
      kill_at = std::min(kill_at, Clock::now() + std::chrono::seconds(10));
    }
    int st = 0;
    const pid_t pid = ::waitpid(-1, &st, WNOHANG);
    if (pid > 0) {
      for (int r = 0; r < o.ranks; ++r) {
        if (pids[r] != pid || done[r]) continue;
        done[r] = true;
        status[r] = st;
        --remaining;
        const bool ok = WIFEXITED(st) && (WEXITSTATUS(st) == 0 || WEXITSTATUS(st) == 3);
        if (!ok && !forwarded) {
          std::fprintf(stderr, "stepguard demo: rank %d %s\n", r, describe(st).c_str());
          if (!failure_seen) {
            failure_seen = true;
            kill_at = Clock::now() + grace;
          }
        }
      }
      continue;
    }
    if (pid < 0 && errno != EINTR) break;
    if (Clock::now() >= kill_at) {
      for (int r = 0; r < o.ranks; ++r) {
        if (!done[r]) {
          std::fprintf(stderr,
                       "stepguard demo: rank %d still running after the deadline; killing it\n", r);
          ::kill(pids[r], SIGKILL);
        }
      }
      kill_at = Clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return status;
}

// 0 when every rank exited 0, 3 when every rank exited 3 (the policy aborted), otherwise 1.
int launcher_status(const std::vector<int>& status) {
  bool all_ok = true, all_aborted = true;
  for (const int st : status) {
    const bool exited = WIFEXITED(st);
    all_ok = all_ok && exited && WEXITSTATUS(st) == 0;
    all_aborted = all_aborted && exited && WEXITSTATUS(st) == 3;
  }
  if (all_ok) return 0;
  if (all_aborted) return 3;
  return 1;
}

}  // namespace

int launch_ranks(const DemoOptions& o) {
  const int port = free_loopback_port();
  std::fprintf(stderr, "stepguard demo: launching %d ranks (gloo over 127.0.0.1:%d)\n", o.ranks,
               port);
  std::fflush(stderr);
  catch_stop_signals();
  const std::vector<pid_t> pids = start_ranks(o, port);
  const std::vector<int> status = wait_for_ranks(o, pids);
  if (g_stop_signal != 0) return 128 + g_stop_signal;
  return launcher_status(status);
}

}  // namespace demo
}  // namespace stepguard
