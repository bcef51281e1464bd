// The /metrics HTTP endpoint over real loopback sockets: what it answers, and that slow, idle,
// non-reading or numerous clients never stop a scrape or the endpoint's shutdown. Every wait is
// bounded; the bounds are generous upper limits counted from the event, never expected durations.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "csrc/telemetry/http_endpoint.h"

namespace stepguard {
namespace {

using telemetry::HttpEndpoint;
using telemetry::HttpEndpointLimits;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using std::chrono::seconds;

const char kBody[] = "stepguard_steps_total{outcome=\"applied\"} 3\n";

// Limits whose deadline never closes a client during a test, so a test shows that the loop, not
// the deadline, keeps scrapes going.
HttpEndpointLimits patient() {
  HttpEndpointLimits limits;
  limits.deadline = seconds(300);
  return limits;
}

// A blocking client socket connected to 127.0.0.1:port (-1 on failure); reads time out after 20 s.
int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  timeval timeout{20, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool send_all(int fd, const std::string& data) {
  for (std::size_t sent = 0; sent < data.size();) {
    const ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return false;
    sent += static_cast<std::size_t>(n);
  }
  return true;
}

// Reads until the server closes (or 20 s pass without a byte).
std::string read_all(int fd) {
  std::string out;
  char buf[65536];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof buf, 0)) > 0) out.append(buf, static_cast<std::size_t>(n));
  return out;
}

// Sends `request` on a fresh connection and returns the raw response ("" when none).
std::string send_request(int port, const std::string& request) {
  const int fd = connect_to(port);
  if (fd < 0) return {};
  std::string response = send_all(fd, request) ? read_all(fd) : std::string();
  ::close(fd);
  return response;
}

std::string scrape(int port, const std::string& method = "GET",
                   const std::string& path = "/metrics") {
  return send_request(port, method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
}

int status_of(const std::string& response) {
  if (response.rfind("HTTP/1.1 ", 0) != 0 || response.size() < 12) return 0;
  return std::stoi(response.substr(9, 3));
}

std::string header_of(const std::string& response, const std::string& name) {
  const std::string key = "\r\n" + name + ": ";
  const std::size_t at = response.find(key);
  if (at == std::string::npos || at > response.find("\r\n\r\n")) return {};
  const std::size_t from = at + key.size();
  return response.substr(from, response.find("\r\n", from) - from);
}

std::string body_of(const std::string& response) {
  const std::size_t split = response.find("\r\n\r\n");
  return split == std::string::npos ? std::string() : response.substr(split + 4);
}

// True while the server has neither closed nor reset `fd` (nothing to read, no EOF).
bool still_open(int fd) {
  char ch;
  return ::recv(fd, &ch, 1, MSG_PEEK | MSG_DONTWAIT) < 0 &&
         (errno == EAGAIN || errno == EWOULDBLOCK);
}

// A client that sends a request one byte at a time, `every` apart, until told to stop, the
// request is out, or the server closes.
class SlowClient {
 public:
  SlowClient(int port, milliseconds every, std::size_t padding) : fd_(connect_to(port)) {
    EXPECT_GE(fd_, 0);
    const std::string request =
        "GET /metrics HTTP/1.1\r\nX-Slow: " + std::string(padding, 'a') + "\r\n\r\n";
    thread_ = std::thread([this, request, every] {
      for (char ch : request) {
        if (::send(fd_, &ch, 1, MSG_NOSIGNAL) != 1) break;
        ++sent_;
        std::unique_lock<std::mutex> lock(mutex_);
        if (wake_.wait_for(lock, every, [this] { return stop_; })) break;
      }
      finished_ = true;
    });
  }
  ~SlowClient() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
    ::close(fd_);
  }
  int fd() const { return fd_; }
  std::size_t sent() const { return sent_; }
  bool finished() const { return finished_; }
  // Waits (at most 10 s) until it has sent `bytes`.
  bool wait_sent(std::size_t bytes) const {
    const auto give_up = Clock::now() + seconds(10);
    while (sent_ < bytes && Clock::now() < give_up) std::this_thread::sleep_for(milliseconds(5));
    return sent_ >= bytes;
  }

 private:
  int fd_;
  std::atomic<std::size_t> sent_{0};
  std::atomic<bool> finished_{false};
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

TEST(HttpEndpoint, AnswersMetricsAndRejectsEverythingElse) {
  HttpEndpoint server("127.0.0.1", 0, [] { return std::string(kBody); });
  const int port = server.port();
  ASSERT_GT(port, 0);

  std::string r = scrape(port);
  EXPECT_EQ(status_of(r), 200) << r;
  EXPECT_EQ(body_of(r), kBody);
  EXPECT_EQ(header_of(r, "Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(header_of(r, "Content-Length"), std::to_string(sizeof kBody - 1));
  EXPECT_EQ(header_of(r, "Connection"), "close");

  r = scrape(port, "GET", "/metrics?name[]=x");
  EXPECT_EQ(status_of(r), 200) << r;
  EXPECT_EQ(body_of(r), kBody);
  r = send_request(port, "GET /metrics HTTP/1.0\r\nContent-Length: 0\r\n\r\n");
  EXPECT_EQ(status_of(r), 200) << r;

  r = scrape(port, "HEAD");
  EXPECT_EQ(status_of(r), 200) << r;
  EXPECT_EQ(header_of(r, "Content-Length"), std::to_string(sizeof kBody - 1));
  EXPECT_EQ(header_of(r, "Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(body_of(r), "");
  EXPECT_EQ(r.substr(r.size() - 4), "\r\n\r\n");

  r = scrape(port, "GET", "/other");
  EXPECT_EQ(status_of(r), 404) << r;
  EXPECT_NE(body_of(r).find("/metrics"), std::string::npos);

  r = scrape(port, "POST");
  EXPECT_EQ(status_of(r), 405) << r;
  EXPECT_EQ(header_of(r, "Allow"), "GET, HEAD");

  r = send_request(port, "GET /metrics HTTP/1.1\r\nContent-Length: 10\r\n\r\n0123456789");
  EXPECT_EQ(status_of(r), 413) << r;
  r = send_request(port, "GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n");
  EXPECT_EQ(status_of(r), 413) << r;

  r = send_request(port,
                   "GET /metrics HTTP/1.1\r\nX-Pad: " + std::string(20 * 1024, 'a') + "\r\n\r\n");
  EXPECT_EQ(status_of(r), 431) << r.substr(0, 200);

  r = send_request(port, "garbage\r\n\r\n");
  EXPECT_EQ(status_of(r), 400) << r;
  r = send_request(port, "GET metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(status_of(r), 400) << r;
  r = send_request(port, "GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n");
  EXPECT_EQ(status_of(r), 400) << r;

  // Still serving after all that.
  EXPECT_EQ(status_of(scrape(port)), 200);
}

// Several pages, each with its own type (the guard's /metrics and /policy); an unknown path names
// them all.
TEST(HttpEndpoint, ServesEachPageWithItsType) {
  HttpEndpoint server(
      "127.0.0.1", 0,
      {{"/metrics",
        {"text/plain; version=0.0.4; charset=utf-8", [] { return std::string(kBody); }}},
       {"/policy", {"text/plain; charset=utf-8", [] { return std::string("skip NaN\n"); }}}});
  std::string r = scrape(server.port(), "GET", "/policy");
  EXPECT_EQ(status_of(r), 200) << r;
  EXPECT_EQ(body_of(r), "skip NaN\n");
  EXPECT_EQ(header_of(r, "Content-Type"), "text/plain; charset=utf-8");
  r = scrape(server.port());
  EXPECT_EQ(body_of(r), kBody);
  r = scrape(server.port(), "GET", "/other");
  EXPECT_EQ(status_of(r), 404) << r;
  EXPECT_EQ(body_of(r), "not found; try /metrics or /policy\n");
}

TEST(HttpEndpoint, ARenderThatThrowsIsA500) {
  HttpEndpoint server("127.0.0.1", 0, []() -> std::string { throw std::runtime_error("boom"); });
  const std::string r = scrape(server.port());
  EXPECT_EQ(status_of(r), 500) << r;
  EXPECT_EQ(status_of(scrape(server.port())), 500);
}

TEST(HttpEndpoint, BadAddressOrBusyPortIsAnError) {
  auto render = [] { return std::string(); };
  try {
    HttpEndpoint server("nohost", 0, render);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "'nohost' is not an IPv4 address");
  }
  HttpEndpoint first("127.0.0.1", 0, render);
  EXPECT_THROW(HttpEndpoint("127.0.0.1", first.port(), render), std::runtime_error);
  EXPECT_THROW(HttpEndpoint("127.0.0.1", 70000, render), std::runtime_error);
}

TEST(HttpEndpoint, ASlowClientDoesNotBlockScrapes) {
  HttpEndpoint server(
      "127.0.0.1", 0, [] { return std::string(kBody); }, patient());
  SlowClient slow(server.port(), milliseconds(300), 1000);  // would take 5 minutes
  ASSERT_TRUE(slow.wait_sent(2));
  for (int i = 0; i < 5; ++i) {
    const std::string r = scrape(server.port());
    EXPECT_EQ(status_of(r), 200) << "scrape " << i;
    EXPECT_EQ(body_of(r), kBody);
  }
  EXPECT_FALSE(slow.finished());
  EXPECT_TRUE(still_open(slow.fd()));
}

TEST(HttpEndpoint, IdleConnectionsDoNotStopAScrape) {
  HttpEndpoint server(
      "127.0.0.1", 0, [] { return std::string(kBody); }, patient());
  std::vector<int> idle;
  for (int i = 0; i < 40; ++i) idle.push_back(connect_to(server.port()));
  for (int fd : idle) ASSERT_GE(fd, 0);
  const std::string r = scrape(server.port());
  EXPECT_EQ(status_of(r), 200) << r;
  EXPECT_EQ(body_of(r), kBody);
  for (int fd : idle) EXPECT_TRUE(still_open(fd));
  for (int fd : idle) ::close(fd);
}

TEST(HttpEndpoint, WhenFullTheOldestConnectionMakesRoom) {
  HttpEndpointLimits limits = patient();
  limits.max_connections = 4;
  HttpEndpoint server(
      "127.0.0.1", 0, [] { return std::string(kBody); }, limits);
  std::vector<int> idle;
  for (int i = 0; i < 4; ++i) idle.push_back(connect_to(server.port()));
  for (int fd : idle) ASSERT_GE(fd, 0);
  EXPECT_EQ(status_of(scrape(server.port())), 200);
  char ch;
  EXPECT_EQ(::recv(idle[0], &ch, 1, 0), 0);  // closed for the scrape (blocks at most 20 s)
  for (std::size_t i = 1; i < idle.size(); ++i) EXPECT_TRUE(still_open(idle[i])) << i;
  for (int fd : idle) ::close(fd);
}

TEST(HttpEndpoint, AConnectionPastItsDeadlineIsClosed) {
  HttpEndpointLimits limits;
  limits.deadline = milliseconds(200);
  HttpEndpoint server(
      "127.0.0.1", 0, [] { return std::string(kBody); }, limits);
  const auto connected = Clock::now();
  const int idle = connect_to(server.port());
  ASSERT_GE(idle, 0);
  char ch;
  EXPECT_EQ(::recv(idle, &ch, 1, 0), 0);  // blocks at most 20 s
  const auto waited = Clock::now() - connected;
  EXPECT_GE(waited, milliseconds(200));
  EXPECT_LT(waited, seconds(20));
  ::close(idle);
  {
    SlowClient slow(server.port(), milliseconds(50), 1000);  // would take 50 s
    ASSERT_TRUE(slow.wait_sent(1));
    const auto give_up = Clock::now() + seconds(20);
    while (!slow.finished() && Clock::now() < give_up)
      std::this_thread::sleep_for(milliseconds(10));
    EXPECT_TRUE(slow.finished());  // its sends failed: the server closed it
  }
  EXPECT_EQ(status_of(scrape(server.port())), 200);
}

TEST(HttpEndpoint, ShutdownIsImmediateWhileAClientIsStillSending) {
  auto server = std::make_unique<HttpEndpoint>(
      "127.0.0.1", 0, [] { return std::string(kBody); }, patient());
  const int port = server->port();
  SlowClient slow(port, milliseconds(300), 200);  // would take a minute
  ASSERT_TRUE(slow.wait_sent(2));
  const auto called = Clock::now();
  server.reset();
  EXPECT_LT(Clock::now() - called, seconds(10));
  const int fd = connect_to(port);
  EXPECT_LT(fd, 0) << "the port still accepts connections";
  if (fd >= 0) ::close(fd);
}

TEST(HttpEndpoint, ClientsThatDoNotReadDoNotBlockScrapes) {
  const std::string big(8 * 1024 * 1024, 'x');
  HttpEndpoint server(
      "127.0.0.1", 0, [&big] { return big; }, patient());
  // Each asks for 8 MB and reads none of it. A small receive buffer (set before connecting, so it
  // is not auto-tuned) keeps most of each answer in the server's send queue, which stays full.
  std::vector<int> stuck;
  for (int i = 0; i < 12; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    stuck.push_back(fd);
    const int small = 4096;
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(server.port()));
    ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    ASSERT_TRUE(send_all(fd, "GET /metrics HTTP/1.1\r\n\r\n"));
  }
  for (int i = 0; i < 3; ++i) {
    const std::string r = scrape(server.port());
    EXPECT_EQ(status_of(r), 200) << "scrape " << i;
    EXPECT_EQ(body_of(r).size(), big.size());
  }
  for (int fd : stuck) ::close(fd);
}

}  // namespace
}  // namespace stepguard
