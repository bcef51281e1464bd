// Torch-free entry points of the CUB bandwidth ceiling (ceiling_kernel.cu).
#pragma once

#include <cstddef>
#include <cstdint>

namespace stepguard {
namespace bench {

/// Scratch bytes CUB needs to sum `words` 32-bit words.
std::size_t cub_sum_temp_bytes(std::int64_t words);
/// Sums `count` 32-bit words at `words` into the unsigned long long at `out` (device pointers).
void cub_sum_words(const void* words, std::int64_t count, void* temp, std::size_t temp_bytes,
                   void* out, void* stream);

}  // namespace bench
}  // namespace stepguard
