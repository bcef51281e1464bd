// The guard's save()/load() archives as bytes, and an archive whose decision state was edited:
// what tests use to restore a guard, or to tamper with one.
#pragma once

#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "stepguard/guarded_optimizer.h"

namespace stepguard {
namespace testing_support {

inline std::string saved_bytes(const GuardedOptimizer& guard) {
  torch::serialize::OutputArchive archive;
  guard.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

inline void load_bytes(GuardedOptimizer& guard, const std::string& bytes) {
  std::istringstream in(bytes);
  torch::serialize::InputArchive archive;
  archive.load_from(in);
  guard.load(archive);
}

/// The guard's archive now, with `edit(key, words)` applied to each field of its record ("step",
/// "data_position", "guard": the decision state, "totals", "skipped_ranges").
inline std::string edited_record_bytes(
    GuardedOptimizer& guard,
    const std::function<void(const std::string&, std::vector<std::int64_t>&)>& edit) {
  std::istringstream in(saved_bytes(guard));
  torch::serialize::InputArchive saved;
  saved.load_from(in);
  torch::serialize::InputArchive saved_record;
  saved.read("stepguard", saved_record);
  torch::serialize::OutputArchive record;
  for (const char* key : {"step", "data_position", "guard", "totals", "skipped_ranges"}) {
    torch::Tensor t;
    saved_record.read(key, t);
    t = t.contiguous();
    std::vector<std::int64_t> words(t.data_ptr<std::int64_t>(),
                                    t.data_ptr<std::int64_t>() + t.numel());
    edit(key, words);
    record.write(key, torch::tensor(words, torch::kInt64));
  }
  torch::serialize::OutputArchive optimizer;
  guard.optimizer().save(optimizer);
  torch::serialize::OutputArchive archive;
  archive.write("stepguard", record);
  archive.write("optimizer", optimizer);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

/// The guard's archive now, with `edit` applied to the words of its decision state.
inline std::string edited_bytes(GuardedOptimizer& guard,
                                const std::function<void(std::vector<std::int64_t>&)>& edit) {
  return edited_record_bytes(guard, [&](const std::string& key, std::vector<std::int64_t>& w) {
    if (key == "guard") edit(w);
  });
}

}  // namespace testing_support
}  // namespace stepguard
