/*
 * The HTTP endpoint that serves /metrics (and the guard's /policy): GET or HEAD of a page's path
 * answers the text its callback renders; anything else gets a short error. One thread runs one
 * poll() loop over the listening socket, every client socket (non-blocking) and a wake-up eventfd,
 * so no client can hold up another or the loop:
 *  - each connection has a deadline counted from accept (5 s by default) to send its request head
 *    and take the answer; past it, it is closed. At most 64 connections are open; a new one
 *    closes the oldest, so idle or slow clients can never lock out a scrape;
 *  - the request head is capped (8 KiB: 431 beyond); bodies get 413, methods other than GET and
 *    HEAD 405, a malformed request line 400, other paths 404, a throwing render 500;
 *  - answers are written as the socket takes them (MSG_NOSIGNAL), so a client that does not read
 *    only waits out its own deadline;
 *  - the destructor wakes the loop at once, joins it and closes every socket, whatever clients do.
 * Every answer says `Connection: close`; there is no keep-alive, pipelining or TLS.
 *
 * Why not a library: prometheus-cpp's exposer runs on civetweb, and Debian's civetweb fixes a
 * 100 KB thread stack, smaller than LibTorch's static TLS, so it cannot start its threads in a
 * process that has loaded LibTorch ("Cannot create threads"). Scrapes are rare and small, so
 * stepguard serves them itself, and tests/test_http_endpoint.cpp proves this server under attack.
 *
 * Thread-safety: construct and destroy on one thread; `render` runs on the endpoint's own thread
 * (one call at a time) and must be safe to call concurrently with whatever the owner does.
 * Torch-free.
 */
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <thread>

namespace stepguard {
namespace telemetry {

struct HttpEndpointLimits {
  /// Open client connections; accepting one more closes the oldest.
  std::size_t max_connections = 64;
  /// From accept to the last byte of the answer (and the client's close after it).
  std::chrono::milliseconds deadline{5000};
  /// Bytes of request line and headers, the blank line included; beyond: 431.
  std::size_t max_head_bytes = 8192;
};

/// One page: its Content-Type and the callback that renders its body.
struct HttpPage {
  std::string content_type;
  std::function<std::string()> render;
};
/// Pages by path ("/metrics").
using HttpPages = std::map<std::string, HttpPage>;

class HttpEndpoint {
 public:
  /// Listens on `address` (IPv4 text) and `port` (0 picks a free one) and serves `pages`. Throws
  /// std::runtime_error with the reason (an errno text, or "'X' is not an IPv4 address").
  HttpEndpoint(const std::string& address, int port, HttpPages pages,
               HttpEndpointLimits limits = {});
  /// Serves /metrics alone, in Prometheus' text format, as `render` writes it.
  HttpEndpoint(const std::string& address, int port, std::function<std::string()> render,
               HttpEndpointLimits limits = {});
  /// Stops at once: open connections are closed unanswered.
  ~HttpEndpoint();
  HttpEndpoint(const HttpEndpoint&) = delete;
  HttpEndpoint& operator=(const HttpEndpoint&) = delete;

  /// The port it listens on (the one picked when constructed with 0).
  int port() const noexcept { return port_; }

 private:
  void serve();

  HttpPages pages_;
  HttpEndpointLimits limits_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;
  int port_ = 0;
  std::thread thread_;
};

}  // namespace telemetry
}  // namespace stepguard
