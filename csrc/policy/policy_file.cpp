// The entry points of the policy-file code: a file or a text, checked as text (UTF-8, one YAML
// document, YAML syntax, a map at the top) before policy_reader.cpp reads its sections and
// policy_validation.cpp checks the whole; the issues come back in file order.
#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/parser.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "csrc/common/safe_file.h"
#include "csrc/common/utf8.h"
#include "csrc/policy/policy_file.h"
#include "csrc/policy/policy_file_internal.h"
#include "csrc/policy/presets.h"

namespace stepguard {
namespace policy {

using detail::Checker;

namespace {

// Sees the events of a document without building it; remembers where the document starts.
class DocumentStart : public YAML::EventHandler {
 public:
  void OnDocumentStart(const YAML::Mark& mark) override { start = mark; }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t,
                const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
  YAML::Mark start;
};

// True when `text` holds a second YAML document, starting at `at`. Parses no further than that
// document (LoadAll would build every one of them).
bool second_document(const std::string& text, YAML::Mark* at) {
  std::istringstream in(text);
  YAML::Parser parser(in);
  DocumentStart first, next;
  if (!parser.HandleNextDocument(first)) return false;
  if (!parser.HandleNextDocument(next)) return false;
  *at = next.start;
  return true;
}

}  // namespace

std::vector<PolicyIssue> parse_policy(const std::string& text, const std::string& name,
                                      PolicyConfig* config) {
  Checker check(name);
  // A rule name that is not UTF-8 would pass and then break every trace and report naming it.
  if (const Utf8Error bad = find_invalid_utf8(text); bad.found) {
    YAML::Mark at;
    at.pos = static_cast<int>(bad.offset);
    at.line = bad.line;
    at.column = bad.column;
    char byte[8];
    std::snprintf(byte, sizeof byte, "0x%02x", static_cast<unsigned char>(text[bad.offset]));
    check.issue(at, std::string("invalid UTF-8 (byte ") + byte + "); a policy file is UTF-8 text");
    return check.take();
  }
  YAML::Node root;
  try {
    root = YAML::Load(text);
    // One document: a second one (after `---`) would otherwise be ignored without a word.
    YAML::Mark second;
    if (second_document(text, &second)) {
      check.issue(second,
                  "a second YAML document; a policy file holds one (remove the '---' before it)");
      return check.take();
    }
  } catch (const YAML::DeepRecursion& e) {
    // yaml-cpp's own message for this is "bad file".
    check.issue(e.mark, "nested too deeply (" + std::to_string(e.depth()) +
                            " levels); a policy is a few levels deep (configs/policies/README.md)");
    return check.take();
  } catch (const YAML::Exception& e) {
    check.issue(e.mark, "YAML syntax error: " + e.msg);
    return check.take();
  }
  if (!root.IsMap()) {
    check.issue(root.IsNull() ? YAML::Mark() : root.Mark(),  // an empty file: 1:1
                "a policy must be a map with at least 'version: " +
                    std::to_string(kPolicySchemaVersion) + "'");
    return check.take();
  }
  PolicyConfig parsed;
  detail::PolicyMarks marks;
  detail::read_policy(root, &parsed, &marks, &check);
  detail::check_policy(root, parsed, marks, &check);
  std::vector<PolicyIssue> issues = check.take();
  // Issues in file order, as a compiler reports them.
  std::stable_sort(issues.begin(), issues.end(), [](const PolicyIssue& a, const PolicyIssue& b) {
    return std::tie(a.line, a.column) < std::tie(b.line, b.column);
  });
  if (issues.empty() && config != nullptr) *config = parsed;
  return issues;
}

std::vector<PolicyIssue> check_policy_file(const std::string& path, PolicyConfig* config) {
  if (meant_as_preset(path)) {
    if (const std::string* preset = find_policy_preset(path)) {
      return parse_policy(*preset, "preset '" + path + "'", config);
    }
    return {{path, 0, 0,
             "no policy file of that name and no shipped preset" + preset_suggestion(path) +
                 " (presets: " + policy_preset_names() + ")"}};
  }
  // A policy is a page of YAML: a FIFO, a device or a file past this is refused unread.
  constexpr std::int64_t kMaxPolicyBytes = std::int64_t{1} << 20;
  std::string text, why;
  if (!read_regular_file(path, kMaxPolicyBytes, &text, &why)) {
    return {{path, 0, 0, "cannot read policy file: " + why}};
  }
  return parse_policy(text, path, config);
}

PolicyConfig load_policy_file(const std::string& path) {
  PolicyConfig config;
  auto issues = check_policy_file(path, &config);
  if (!issues.empty()) throw PolicyFileError(std::move(issues));
  return config;
}

}  // namespace policy
}  // namespace stepguard
