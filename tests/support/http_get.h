// A tiny blocking HTTP/1.1 GET over loopback, for tests that scrape /metrics or query Prometheus.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

namespace stepguard {
namespace testing_support {

/// Returns the response body of GET http://host:port/path, or an empty string with `status` 0
/// when the connection fails. `status` receives the HTTP status code.
inline std::string http_request(const std::string& host, int port, const std::string& method,
                                const std::string& path, int* status,
                                const std::string& body = "") {
  *status = 0;
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return {};
  timeval timeout{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  ::inet_pton(AF_INET, host.c_str(), &addr.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return {};
  }
  const std::string request = method + " " + path + " HTTP/1.1\r\nHost: " + host +
                              "\r\nConnection: close\r\nContent-Type: application/json"
                              "\r\nContent-Length: " +
                              std::to_string(body.size()) + "\r\n\r\n" + body;
  ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string response;
  char buf[4096];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof buf, 0)) > 0)
    response.append(buf, static_cast<std::size_t>(n));
  ::close(fd);
  if (response.rfind("HTTP/1.", 0) != 0) return {};
  *status = std::stoi(response.substr(9, 3));
  const auto split = response.find("\r\n\r\n");
  std::string payload = split == std::string::npos ? std::string() : response.substr(split + 4);
  // Chunked responses (Prometheus' API): join the chunks.
  if (response.find("Transfer-Encoding: chunked") != std::string::npos) {
    std::string joined;
    std::size_t pos = 0;
    while (pos < payload.size()) {
      const auto eol = payload.find("\r\n", pos);
      if (eol == std::string::npos) break;
      const std::size_t size = std::stoul(payload.substr(pos, eol - pos), nullptr, 16);
      if (size == 0) break;
      joined += payload.substr(eol + 2, size);
      pos = eol + 2 + size + 2;
    }
    payload = joined;
  }
  return payload;
}

inline std::string http_get(const std::string& host, int port, const std::string& path,
                            int* status) {
  return http_request(host, port, "GET", path, status);
}

}  // namespace testing_support
}  // namespace stepguard
