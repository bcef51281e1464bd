// Where a text stops being UTF-8: for inputs that must be UTF-8 (policy files) and are echoed
// into JSON later.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace stepguard {

struct Utf8Error {
  bool found = false;
  std::size_t offset = 0;  ///< byte offset of the first bad byte
  int line = 0;            ///< 0-based
  int column = 0;          ///< 0-based, in characters
};

/// The first byte of `text` that does not start a valid UTF-8 sequence (overlong forms,
/// surrogates and code points beyond U+10FFFF included), or found = false.
inline Utf8Error find_invalid_utf8(const std::string& text) {
  Utf8Error e;
  for (std::size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    const std::size_t len = c < 0x80           ? 1
                            : (c >> 5) == 0x6  ? 2
                            : (c >> 4) == 0xE  ? 3
                            : (c >> 3) == 0x1E ? 4
                                               : 0;
    bool ok = len > 0 && i + len <= text.size();
    std::uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1Fu) : len == 3 ? (c & 0x0Fu) : (c & 0x07u);
    for (std::size_t k = 1; ok && k < len; ++k) {
      const auto b = static_cast<unsigned char>(text[i + k]);
      ok = (b & 0xC0) == 0x80;
      cp = (cp << 6) | (b & 0x3Fu);
    }
    ok = ok && !(len == 2 && cp < 0x80) &&
         !(len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) &&
         !(len == 4 && (cp < 0x10000 || cp > 0x10FFFF));
    if (!ok) {
      e.found = true;
      e.offset = i;
      return e;
    }
    if (c == '\n') {
      ++e.line;
      e.column = 0;
    } else {
      ++e.column;
    }
    i += len;
  }
  return Utf8Error{};
}

}  // namespace stepguard
