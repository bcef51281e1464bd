// End to end on loopback, with real processes started and stopped by the test: the demo serves
// metrics, a real Prometheus scrapes it with the shipped rules, a real Alertmanager routes with
// the shipped configuration, and a webhook receiver here records what reaches on-call.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/http_get.h"

namespace {

using Clock = std::chrono::steady_clock;
using stepguard::testing_support::http_get;
namespace fs = std::filesystem;

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A child process, stopped (TERM, then KILL) when this goes out of scope.
class Child {
 public:
  Child(std::vector<std::string> argv, const std::string& log) : log_(log) {
    pid_ = ::fork();
    if (pid_ == 0) {
      std::FILE* f = std::fopen(log.c_str(), "w");
      if (f) {
        ::dup2(::fileno(f), 1);
        ::dup2(::fileno(f), 2);
      }
      std::vector<char*> args;
      for (auto& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      std::_Exit(127);
    }
  }
  ~Child() { stop(); }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    int status = 0;
    while (::waitpid(pid_, &status, WNOHANG) == 0) {
      if (Clock::now() > deadline) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    pid_ = -1;
  }
  std::string log() const { return slurp(log_); }

 private:
  pid_t pid_ = -1;
  std::string log_;
};

// Records every POST it receives; answers 200.
class WebhookReceiver {
 public:
  WebhookReceiver() {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    ::listen(fd_, 16);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~WebhookReceiver() {
    stop_ = true;
    thread_.join();
    ::close(fd_);
  }
  int port() const { return port_; }
  // (path, body) of every POST so far.
  std::vector<std::pair<std::string, std::string>> posts() {
    std::lock_guard<std::mutex> lock(mu_);
    return posts_;
  }

 private:
  void serve() {
    while (!stop_) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      const int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) continue;
      timeval timeout{2, 0};
      ::setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
      std::string req;
      char buf[4096];
      ssize_t n;
      std::size_t need = std::string::npos;
      while ((n = ::recv(c, buf, sizeof buf, 0)) > 0) {
        req.append(buf, static_cast<std::size_t>(n));
        const auto head = req.find("\r\n\r\n");
        if (head != std::string::npos && need == std::string::npos) {
          std::smatch m;
          const std::string headers = req.substr(0, head);
          if (std::regex_search(headers, m,
                                std::regex("Content-Length: *([0-9]+)", std::regex::icase))) {
            need = head + 4 + std::stoul(m[1]);
          } else {
            need = head + 4;
          }
        }
        if (need != std::string::npos && req.size() >= need) break;
      }
      const std::string ok = "HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
      ::send(c, ok.data(), ok.size(), MSG_NOSIGNAL);
      ::close(c);
      const auto sp1 = req.find(' '), sp2 = req.find(' ', sp1 + 1);
      const auto head = req.find("\r\n\r\n");
      if (req.rfind("POST ", 0) == 0 && sp2 != std::string::npos && head != std::string::npos) {
        std::lock_guard<std::mutex> lock(mu_);
        posts_.emplace_back(req.substr(sp1 + 1, sp2 - sp1 - 1), req.substr(head + 4));
      }
    }
  }
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::mutex mu_;
  std::vector<std::pair<std::string, std::string>> posts_;
};

bool wait_until(const std::function<bool()>& ready, std::chrono::seconds limit) {
  const auto deadline = Clock::now() + limit;
  while (Clock::now() < deadline) {
    if (ready()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  return ready();
}

bool http_ok(int port, const std::string& path) {
  int status = 0;
  http_get("127.0.0.1", port, path, &status);
  return status == 200;
}

// Prometheus + Alertmanager configured from the shipped files, with test-sized intervals.
class AlertingStack {
 public:
  AlertingStack(const std::string& name, int demo_port, int receiver_port) {
    dir_ = ::testing::TempDir() + "/sg_alerting_" + name;
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    const std::string src = STEPGUARD_SOURCE_DIR;
    // Alertmanager: the shipped routing, pointed at the test receiver, waiting 1 s instead of
    // tens of seconds before sending.
    std::string am = slurp(src + "/configs/alertmanager/alertmanager.yml");
    am = std::regex_replace(am, std::regex("http://127\\.0\\.0\\.1:9095"),
                            "http://127.0.0.1:" + std::to_string(receiver_port));
    am = std::regex_replace(am, std::regex("group_wait: [0-9]+[sm]"), "group_wait: 1s");
    am = std::regex_replace(am, std::regex("group_interval: [0-9]+[sm]"), "group_interval: 1s");
    std::ofstream(dir_ + "/alertmanager.yml") << am;
    am_port_ = free_port();
    alertmanager_ = std::make_unique<Child>(
        std::vector<std::string>{"/usr/bin/prometheus-alertmanager",
                                 "--config.file=" + dir_ + "/alertmanager.yml",
                                 "--storage.path=" + dir_ + "/am-data",
                                 "--web.listen-address=127.0.0.1:" + std::to_string(am_port_),
                                 "--cluster.listen-address="},
        dir_ + "/alertmanager.log");
    std::ofstream(dir_ + "/prometheus.yml")
        << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        << "rule_files:\n  - " << src << "/configs/prometheus/stepguard.rules.yml\n"
        << "alerting:\n  alertmanagers:\n    - static_configs:\n        - targets: ['127.0.0.1:"
        << am_port_ << "']\n"
        << "scrape_configs:\n  - job_name: stepguard\n    static_configs:\n"
        << "      - targets: ['127.0.0.1:" << demo_port << "']\n";
    prom_port_ = free_port();
    prometheus_ = std::make_unique<Child>(
        std::vector<std::string>{"/usr/bin/prometheus", "--config.file=" + dir_ + "/prometheus.yml",
                                 "--storage.tsdb.path=" + dir_ + "/prom-data",
                                 "--web.listen-address=127.0.0.1:" + std::to_string(prom_port_)},
        dir_ + "/prometheus.log");
  }
  bool ready() {
    return wait_until(
        [&] { return http_ok(prom_port_, "/-/ready") && http_ok(am_port_, "/-/ready"); },
        std::chrono::seconds(60));
  }
  // The answer to an instant query (discarded when Prometheus refused it).
  nlohmann::json instant_query(const std::string& promql) {
    int status = 0;
    std::string q;
    for (char c : promql) {
      if (std::isalnum(static_cast<unsigned char>(c)) || c == '_') {
        q += c;
      } else {
        char hex[4];
        std::snprintf(hex, sizeof hex, "%%%02X", static_cast<unsigned char>(c));
        q += hex;
      }
    }
    const std::string body = http_get("127.0.0.1", prom_port_, "/api/v1/query?query=" + q, &status);
    if (status != 200) return nlohmann::json::value_t::discarded;
    return nlohmann::json::parse(body, nullptr, false);
  }
  // The value of an instant query's first result, or NaN.
  double query(const std::string& promql) {
    const nlohmann::json j = instant_query(promql);
    if (j.is_discarded() || j["data"]["result"].empty()) return std::nan("");
    return std::stod(j["data"]["result"][0]["value"][1].get<std::string>());
  }
  // How many series an instant query returns (-1 when the query fails).
  long series(const std::string& promql) {
    const nlohmann::json j = instant_query(promql);
    if (j.is_discarded() || j.value("status", "") != "success") return -1;
    return static_cast<long>(j["data"]["result"].size());
  }
  std::size_t active_alerts() {
    int status = 0;
    const std::string body = http_get("127.0.0.1", prom_port_, "/api/v1/alerts", &status);
    const auto j = nlohmann::json::parse(body, nullptr, false);
    return j.is_discarded() ? 0 : j["data"]["alerts"].size();
  }
  std::string logs() const { return prometheus_->log() + "\n---\n" + alertmanager_->log(); }

 private:
  std::string dir_;
  int am_port_ = 0;
  int prom_port_ = 0;
  std::unique_ptr<Child> alertmanager_;
  std::unique_ptr<Child> prometheus_;
};

// Waits up to 60 s (rule evaluation, Alertmanager's group wait, the webhook) for `name` to reach
// the receiver; fills the alert and the receiver path it came to.
bool wait_for_alert(WebhookReceiver& receiver, const std::string& name, nlohmann::json* alert,
                    std::string* path) {
  return wait_until(
      [&] {
        for (const auto& [p, body] : receiver.posts()) {
          const auto j = nlohmann::json::parse(body, nullptr, false);
          if (j.is_discarded()) continue;
          for (const auto& a : j["alerts"]) {
            if (a["labels"]["alertname"] == name) {
              *alert = a;
              *path = p;
              return true;
            }
          }
        }
        return false;
      },
      std::chrono::seconds(60));
}

std::vector<std::string> demo_args(int port, const std::string& run, const std::string& extra) {
  std::vector<std::string> args = {STEPGUARD_BIN,        "demo",       "--metrics-port",
                                   std::to_string(port), "--run-name", run};
  std::istringstream in(extra);
  std::string word;
  while (in >> word) args.push_back(word);
  return args;
}

TEST(Telemetry, LiveMetricsPassPromtoolCheckMetrics) {
  const int port = free_port();
  Child demo(demo_args(port, "lint", "--steps 20 --inject nan_grad@3 --linger 20"),
             ::testing::TempDir() + "/sg_lint_demo.log");
  ASSERT_TRUE(wait_until([&] { return http_ok(port, "/metrics"); }, std::chrono::seconds(300)))
      << demo.log();
  int status = 0;
  const std::string text = http_get("127.0.0.1", port, "/metrics", &status);
  const std::string file = ::testing::TempDir() + "/sg_lint_metrics.txt";
  std::ofstream(file) << text;
  const std::string out = ::testing::TempDir() + "/sg_lint_out.txt";
  const int rc =
      std::system(("promtool check metrics < '" + file + "' > '" + out + "' 2>&1").c_str());
  EXPECT_EQ(rc, 0) << slurp(out);
  EXPECT_EQ(slurp(out), "") << "promtool found problems";
  EXPECT_NE(text.find("stepguard_steps_total{"), std::string::npos);
}

TEST(Telemetry, NonFiniteStepsReachTheTicketReceiverWithTheirLabels) {
  WebhookReceiver receiver;
  const int demo_port = free_port();
  AlertingStack stack("faulty", demo_port, receiver.port());
  ASSERT_TRUE(stack.ready()) << stack.logs();
  // The faults may come before or after Prometheus first scrapes the run: the rule fires either
  // way.
  Child demo(demo_args(demo_port, "e2e",
                       "--steps 150 --inject nan_grad@100 --inject inf_grad@110 "
                       "--linger 40"),
             ::testing::TempDir() + "/sg_e2e_demo.log");
  // The event the deadline counts from: Prometheus has scraped the faulty counter. Reaching it is
  // a matter of progress only (a loaded machine trains slower), so its bound is generous.
  ASSERT_TRUE(
      wait_until([&] { return stack.query("stepguard_nonfinite_steps_total{run=\"e2e\"}") >= 1; },
                 std::chrono::seconds(600)))
      << demo.log() << stack.logs();
  nlohmann::json alert;
  std::string path;
  const bool arrived = wait_for_alert(receiver, "StepguardNonFiniteSteps", &alert, &path);
  ASSERT_TRUE(arrived) << "no alert reached the receiver within 60 s of the fault being scraped\n"
                       << demo.log() << stack.logs();
  EXPECT_EQ(path, "/ticket");  // severity=ticket routes to the ticket receiver
  EXPECT_EQ(alert["labels"]["severity"], "ticket");
  EXPECT_EQ(alert["labels"]["run"], "e2e");
  EXPECT_EQ(alert["labels"]["rank"], "0");
  EXPECT_EQ(alert["labels"]["job"], "stepguard");
  EXPECT_EQ(alert["annotations"]["runbook_url"], "docs/runbook.md#stepguardnonfinitesteps");
  EXPECT_NE(alert["annotations"]["summary"].get<std::string>().find("Run e2e"), std::string::npos);
  // Nothing paged: two skipped steps are a ticket, not a burst.
  for (const auto& [p, body] : receiver.posts()) EXPECT_NE(p, "/page") << body;
}

// A fault that does not come back when its batch is replayed: the machine is the suspect, and
// on-call is paged with the host and rank to drain.
TEST(Telemetry, AHardwareSuspectPagesNamingTheHost) {
  WebhookReceiver receiver;
  const int demo_port = free_port();
  AlertingStack stack("hardware", demo_port, receiver.port());
  ASSERT_TRUE(stack.ready()) << stack.logs();
  // The fault may come before Prometheus first scrapes the run (the counter is then first seen
  // at 1): the rule fires on that too.
  Child demo(demo_args(demo_port, "hw", "--steps 150 --inject transient_nan@100 --linger 40"),
             ::testing::TempDir() + "/sg_hw_demo.log");
  ASSERT_TRUE(wait_until(
      [&] {
        return stack.query(
                   "stepguard_incident_causes_total{run=\"hw\",cause=\"hardware_suspect\"}") >= 1;
      },
      std::chrono::seconds(600)))
      << demo.log() << stack.logs();
  nlohmann::json alert;
  std::string path;
  const bool arrived = wait_for_alert(receiver, "StepguardHardwareSuspect", &alert, &path);
  ASSERT_TRUE(arrived) << "no page within 60 s of the cause being scraped\n"
                       << demo.log() << stack.logs();
  EXPECT_EQ(path, "/page");
  EXPECT_EQ(alert["labels"]["severity"], "page");
  EXPECT_EQ(alert["labels"]["run"], "hw");
  EXPECT_EQ(alert["labels"]["rank"], "0");
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  EXPECT_EQ(alert["labels"]["host"], std::string(host));
  EXPECT_NE(
      alert["annotations"]["description"].get<std::string>().find(std::string("drain ") + host),
      std::string::npos)
      << alert.dump();
}

// Every query of the shipped Grafana dashboard, with its variables filled in, parses and returns
// data from the real Prometheus scraping a live demo (with checkpoints and a fault).
TEST(Telemetry, EveryDashboardQueryReturnsData) {
  const auto dashboard = nlohmann::json::parse(
      slurp(std::string(STEPGUARD_SOURCE_DIR) + "/configs/grafana/stepguard.json"));
  std::vector<std::string> queries;
  for (const auto& panel : dashboard["panels"]) {
    for (const auto& target : panel["targets"]) queries.push_back(target["expr"]);
  }
  ASSERT_GE(queries.size(), 15u);
  WebhookReceiver receiver;
  const int demo_port = free_port();
  AlertingStack stack("dashboard", demo_port, receiver.port());
  ASSERT_TRUE(stack.ready()) << stack.logs();
  const std::string ckpt = ::testing::TempDir() + "/sg_dashboard_ckpt";
  fs::remove_all(ckpt);
  Child demo(demo_args(demo_port, "dash",
                       "--steps 40 --inject nan_grad@5 --checkpoint-dir " + ckpt +
                           " --checkpoint-every 10 --linger 60"),
             ::testing::TempDir() + "/sg_dashboard_demo.log");
  // The event: Prometheus has seen the whole run (rates need two samples after it).
  ASSERT_TRUE(wait_until([&] { return stack.query("stepguard_last_step{run=\"dash\"}") >= 40; },
                         std::chrono::seconds(600)))
      << demo.log() << stack.logs();
  std::this_thread::sleep_for(std::chrono::seconds(3));
  for (std::string q : queries) {
    q = std::regex_replace(q, std::regex("\\$run"), "dash");
    q = std::regex_replace(q, std::regex("\\$rank"), ".*");
    q = std::regex_replace(q, std::regex("\\$__rate_interval"), "1m");
    EXPECT_GT(stack.series(q), 0) << q << "\n" << stack.logs();
  }
}

TEST(Telemetry, ACleanRunRaisesNoAlert) {
  WebhookReceiver receiver;
  const int demo_port = free_port();
  AlertingStack stack("clean", demo_port, receiver.port());
  ASSERT_TRUE(stack.ready()) << stack.logs();
  Child demo(demo_args(demo_port, "clean", "--steps 40 --linger 40"),
             ::testing::TempDir() + "/sg_clean_demo.log");
  // Wait until Prometheus has seen the whole run, then give rules and routing time to act.
  ASSERT_TRUE(wait_until([&] { return stack.query("stepguard_last_step{run=\"clean\"}") >= 40; },
                         std::chrono::seconds(600)))  // progress only; the check counts from it
      << demo.log() << stack.logs();
  std::this_thread::sleep_for(std::chrono::seconds(8));
  EXPECT_EQ(stack.active_alerts(), 0u);
  EXPECT_TRUE(receiver.posts().empty()) << receiver.posts().front().second;
}

}  // namespace
