// A double as the 64-bit word of its bits, and back: how decision state travels exactly in
// snapshots, checkpoints and the cross-rank digest; and the bound of every count decoded from it.
#pragma once

#include <cstdint>
#include <cstring>

namespace stepguard {

/// Every count and step decoded from saved state lies in [0, kMaxDecodedCount]: far beyond any
/// run, far inside int64 (a count can grow by one a step for 2^62 steps without overflowing) and
/// exact in a double (the arithmetic on it in fp64 is exact).
constexpr std::int64_t kMaxDecodedCount = std::int64_t{1} << 52;

inline std::int64_t bits_of(double v) {
  std::int64_t b = 0;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

inline double double_of(std::int64_t b) {
  double v = 0;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

}  // namespace stepguard
