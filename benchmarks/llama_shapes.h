// The tensor shapes of a Llama-7B-style model (32 layers: q k v o, gate up down, two norms;
// embedding, final norm, head), with the dimensions given: the benchmarks' D1 and D3 data sets.
#pragma once

#include <cstdint>
#include <vector>

namespace stepguard {
namespace bench {

inline std::vector<std::vector<std::int64_t>> llama_shapes(std::int64_t hidden, std::int64_t ffn,
                                                           std::int64_t vocab,
                                                           std::int64_t layers = 32) {
  std::vector<std::vector<std::int64_t>> shapes = {{vocab, hidden}};
  for (std::int64_t l = 0; l < layers; ++l) {
    for (int i = 0; i < 4; ++i) shapes.push_back({hidden, hidden});
    shapes.push_back({ffn, hidden});
    shapes.push_back({ffn, hidden});
    shapes.push_back({hidden, ffn});
    shapes.push_back({hidden});
    shapes.push_back({hidden});
  }
  shapes.push_back({hidden});
  shapes.push_back({vocab, hidden});
  return shapes;
}

}  // namespace bench
}  // namespace stepguard
