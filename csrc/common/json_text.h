// JSON text in and out, with the limits untrusted input needs: parsing refuses nesting deeper
// than a bound (a 200,000-deep document would otherwise overflow the stack when it is walked or
// destroyed), and dumping replaces invalid UTF-8 instead of throwing (a rule name or a path from
// a user must not stop a trace or a report from being written).
#pragma once

#include <nlohmann/json.hpp>

#include <stdexcept>
#include <string>

namespace stepguard {

/// Deepest nesting accepted from files (traces, incident reports, checkpoint headers).
constexpr int kMaxJsonDepth = 64;

/// Parses `text`; throws nlohmann::json::exception when it is not JSON and std::length_error
/// when it nests deeper than `max_depth`.
inline nlohmann::json parse_json_bounded(const std::string& text, int max_depth = kMaxJsonDepth) {
  return nlohmann::json::parse(
      text, [max_depth](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
        if (depth > max_depth) {
          throw std::length_error("nested deeper than " + std::to_string(max_depth) + " levels");
        }
        return true;
      });
}

/// Compact (indent < 0) or indented JSON text; invalid UTF-8 becomes U+FFFD.
inline std::string dump_json(const nlohmann::json& j, int indent = -1) {
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace stepguard
