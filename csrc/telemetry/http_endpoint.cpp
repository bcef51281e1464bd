#include "csrc/telemetry/http_endpoint.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>

namespace stepguard {
namespace telemetry {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kNone = std::string::npos;

// One client, in the order its life goes: it sends its request head, takes the answer, and after
// our half-close closes its end, which we wait for (kDraining) so that request bytes we never read
// cannot turn our close into a reset that destroys the answer in flight.
struct Connection {
  enum class Phase { kReading, kWriting, kDraining };
  int fd = -1;  // -1 once closed
  Clock::time_point deadline;
  Phase phase = Phase::kReading;
  std::string in;
  std::string out;
  std::size_t sent = 0;
};

void close_connection(Connection& c) {
  ::close(c.fd);
  c.fd = -1;
}

// Position just past the blank line that ends the head, or kNone. `from` skips what was searched.
std::size_t head_end(const std::string& in, std::size_t from) {
  const std::size_t crlf = in.find("\r\n\r\n", from);
  const std::size_t lf = in.find("\n\n", from);
  std::size_t end = crlf == kNone ? kNone : crlf + 4;
  if (lf != kNone) end = std::min(end, lf + 2);
  return end;
}

std::string response(int status, const char* reason, const char* content_type,
                     const std::string& body, bool with_body, const char* extra_headers = "") {
  std::string out = "HTTP/1.1 " + std::to_string(status) + " " + reason +
                    "\r\nContent-Type: " + content_type +
                    "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n" + extra_headers +
                    "Connection: close\r\n\r\n";
  if (with_body) out += body;
  return out;
}

std::string error(int status, const char* reason, const std::string& text, bool with_body = true,
                  const char* extra_headers = "") {
  return response(status, reason, "text/plain; charset=utf-8", text + "\n", with_body,
                  extra_headers);
}

bool is_token(const std::string& s) {
  if (s.empty()) return false;
  for (char ch : s) {
    const auto u = static_cast<unsigned char>(ch);
    if (u <= 0x20 || u >= 0x7f || std::strchr("\"(),/:;<=>?@[\\]{}", ch) != nullptr) return false;
  }
  return true;
}

std::string trimmed(const std::string& s) {
  const std::size_t first = s.find_first_not_of(" \t");
  if (first == kNone) return {};
  return s.substr(first, s.find_last_not_of(" \t") - first + 1);
}

std::string lowered(std::string s) {
  for (char& ch : s) {
    if (ch >= 'A' && ch <= 'Z') ch = static_cast<char>(ch - 'A' + 'a');
  }
  return s;
}

// The whole answer to one complete request head (which ends with its blank line).
std::string answer(const std::string& head, const HttpPages& pages) {
  std::vector<std::string> lines;
  for (std::size_t pos = 0; pos < head.size();) {
    const std::size_t eol = head.find('\n', pos);
    std::string line = head.substr(pos, eol - pos);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) break;
    lines.push_back(std::move(line));
    pos = eol + 1;
  }
  // Request line: METHOD SP target SP HTTP/1.x, the target in origin form.
  const std::string& request = lines.empty() ? std::string() : lines.front();
  const std::size_t sp1 = request.find(' ');
  const std::size_t sp2 = sp1 == kNone ? kNone : request.find(' ', sp1 + 1);
  const std::string method = request.substr(0, sp1);
  const std::string target = sp2 == kNone ? std::string() : request.substr(sp1 + 1, sp2 - sp1 - 1);
  const std::string version = sp2 == kNone ? std::string() : request.substr(sp2 + 1);
  const bool target_ok = !target.empty() && target[0] == '/' &&
                         std::none_of(target.begin(), target.end(), [](char ch) {
                           const auto u = static_cast<unsigned char>(ch);
                           return u <= 0x20 || u == 0x7f;
                         });
  if (!is_token(method) || !target_ok || (version != "HTTP/1.1" && version != "HTTP/1.0")) {
    return error(400, "Bad Request", "bad request line");
  }
  const bool head_only = method == "HEAD";
  if (method != "GET" && !head_only) {
    return error(405, "Method Not Allowed", "method not allowed; use GET or HEAD", true,
                 "Allow: GET, HEAD\r\n");
  }
  for (std::size_t i = 1; i < lines.size(); ++i) {
    const std::size_t colon = lines[i].find(':');
    if (colon == kNone || !is_token(lines[i].substr(0, colon))) {
      return error(400, "Bad Request", "bad header line", !head_only);
    }
    const std::string name = lowered(lines[i].substr(0, colon));
    const std::string value = trimmed(lines[i].substr(colon + 1));
    if (name == "content-length" &&
        (value.empty() || value.find_first_not_of("0123456789") != kNone)) {
      return error(400, "Bad Request", "bad Content-Length", !head_only);
    }
    if (name == "transfer-encoding" ||
        (name == "content-length" && value.find_first_not_of('0') != kNone)) {
      return error(413, "Payload Too Large", "request bodies are not accepted", !head_only);
    }
  }
  const auto page = pages.find(target.substr(0, target.find('?')));
  if (page == pages.end()) {
    std::string paths;
    for (const auto& [path, _] : pages) paths += (paths.empty() ? "" : " or ") + path;
    return error(404, "Not Found", "not found; try " + paths, !head_only);
  }
  std::string body;
  try {
    body = page->second.render();
  } catch (const std::exception& e) {
    return error(500, "Internal Server Error", std::string("cannot render: ") + e.what(),
                 !head_only);
  } catch (...) {
    return error(500, "Internal Server Error", "cannot render", !head_only);
  }
  return response(200, "OK", page->second.content_type.c_str(), body, !head_only);
}

// Moves one connection on as far as its socket allows without blocking; closes it when it is
// done or broken. Every loop here is bounded: by the head cap, the socket buffer, or a count.
void advance(Connection& c, const HttpEndpointLimits& limits, const HttpPages& pages) {
  char buf[4096];
  while (c.phase == Connection::Phase::kReading) {
    const ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) return close_connection(c);  // gone before a whole head, or broken
    const std::size_t searched = c.in.size() < 3 ? 0 : c.in.size() - 3;
    c.in.append(buf, static_cast<std::size_t>(n));
    const std::size_t end = head_end(c.in, searched);
    if (end != kNone && end <= limits.max_head_bytes) {
      c.out = answer(c.in.substr(0, end), pages);
    } else if (end != kNone || c.in.size() >= limits.max_head_bytes) {
      c.out = error(431, "Request Header Fields Too Large", "request head too large");
    } else {
      continue;
    }
    std::string().swap(c.in);
    c.phase = Connection::Phase::kWriting;
  }
  while (c.phase == Connection::Phase::kWriting) {
    if (c.sent == c.out.size()) {
      ::shutdown(c.fd, SHUT_WR);
      std::string().swap(c.out);
      c.phase = Connection::Phase::kDraining;
      break;
    }
    const ssize_t n = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
    if (n > 0) {
      c.sent += static_cast<std::size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return;
    } else {
      return close_connection(c);
    }
  }
  for (int reads = 0; reads < 16; ++reads) {  // draining: discard until the client closes
    const ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
    if (n > 0 || (n < 0 && errno == EINTR)) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    return close_connection(c);
  }
}

}  // namespace

HttpEndpoint::HttpEndpoint(const std::string& address, int port,
                           std::function<std::string()> render, HttpEndpointLimits limits)
    : HttpEndpoint(address, port,
                   {{"/metrics", {"text/plain; version=0.0.4; charset=utf-8", std::move(render)}}},
                   limits) {}

HttpEndpoint::HttpEndpoint(const std::string& address, int port, HttpPages pages,
                           HttpEndpointLimits limits)
    : pages_(std::move(pages)), limits_(limits) {
  limits_.max_connections = std::max<std::size_t>(limits_.max_connections, 1);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (::inet_pton(AF_INET, address.c_str(), &addr.sin_addr) != 1) {
    throw std::runtime_error("'" + address + "' is not an IPv4 address");
  }
  if (port < 0 || port > 65535) {
    throw std::runtime_error("port " + std::to_string(port) + " is not a TCP port");
  }
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) throw std::runtime_error(std::string("socket(): ") + std::strerror(errno));
  const int one = 1;
  ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  socklen_t len = sizeof addr;
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(listen_fd_, SOMAXCONN) != 0 ||
      ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const std::string why = std::strerror(errno);
    ::close(listen_fd_);
    throw std::runtime_error(why);
  }
  port_ = ntohs(addr.sin_port);
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) {
    const std::string why = std::strerror(errno);
    ::close(listen_fd_);
    throw std::runtime_error("eventfd(): " + why);
  }
  try {
    thread_ = std::thread([this] { serve(); });
  } catch (...) {
    ::close(wake_fd_);
    ::close(listen_fd_);
    throw;
  }
}

HttpEndpoint::~HttpEndpoint() {
  // The eventfd stays readable from now on, so the loop sees it whether or not it is in poll().
  const std::uint64_t one = 1;
  while (::write(wake_fd_, &one, sizeof one) < 0 && errno == EINTR) {
  }
  thread_.join();
  ::close(wake_fd_);
  ::close(listen_fd_);
}

void HttpEndpoint::serve() {
  std::vector<Connection> connections;  // in the order they were accepted: oldest first
  std::vector<pollfd> fds;
  Clock::time_point accept_paused_until;  // after accept4() failed for want of descriptors
  for (;;) {
    const Clock::time_point now = Clock::now();
    const bool accepting = now >= accept_paused_until;
    Clock::time_point wake_at = accepting ? Clock::time_point::max() : accept_paused_until;
    fds.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({accepting ? listen_fd_ : -1, POLLIN, 0});  // poll() skips a negative fd
    for (const Connection& c : connections) {
      const short events = c.phase == Connection::Phase::kWriting ? POLLOUT : POLLIN;
      fds.push_back({c.fd, events, 0});
      wake_at = std::min(wake_at, c.deadline);
    }
    int timeout_ms = -1;
    if (wake_at != Clock::time_point::max()) {
      const auto wait = std::chrono::ceil<std::chrono::milliseconds>(wake_at - now).count();
      timeout_ms = static_cast<int>(std::clamp<decltype(wait)>(wait, 0, 60'000));
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0) continue;  // EINTR, or retry ENOMEM
    if (fds[0].revents != 0) break;                                // the destructor asks to stop

    // Existing connections first (fds[2 + i] is connections[i]), then their deadlines.
    const Clock::time_point polled = Clock::now();
    for (std::size_t i = 0; i < connections.size(); ++i) {
      Connection& c = connections[i];
      if (fds[2 + i].revents != 0) advance(c, limits_, pages_);
      if (c.fd >= 0 && polled >= c.deadline) close_connection(c);
    }
    connections.erase(std::remove_if(connections.begin(), connections.end(),
                                     [](const Connection& c) { return c.fd < 0; }),
                      connections.end());

    // New connections; when full, the oldest makes room, so idle clients cannot lock scrapes out.
    if ((fds[1].revents & POLLIN) == 0) continue;
    for (std::size_t i = 0; i < limits_.max_connections; ++i) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          accept_paused_until = Clock::now() + std::chrono::milliseconds(100);
          break;
        }
        continue;  // an error of that one connection (ECONNABORTED, EPROTO, ...)
      }
      if (connections.size() >= limits_.max_connections) {
        ::close(connections.front().fd);
        connections.erase(connections.begin());
      }
      Connection c;
      c.fd = fd;
      c.deadline = Clock::now() + limits_.deadline;
      connections.push_back(std::move(c));
    }
  }
  for (Connection& c : connections) close_connection(c);
}

}  // namespace telemetry
}  // namespace stepguard
