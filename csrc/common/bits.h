// A double as the 64-bit word of its bits, and back: how decision state travels exactly in
// snapshots, checkpoints and the cross-rank digest.
#pragma once

#include <cstdint>
#include <cstring>

namespace stepguard {

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
