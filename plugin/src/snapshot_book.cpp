#include "plugin/src/snapshot_book.h"

#include <algorithm>

namespace stepguard {

bool SnapshotBook::due(std::int64_t step, Outcome outcome) const noexcept {
  return every_ > 0 && outcome == Outcome::kApplied && step % every_ == 0;
}

void SnapshotBook::add(std::int64_t step, std::vector<std::int64_t> words) {
  entries_.push_back({step, false, std::move(words)});
  while (static_cast<std::int64_t>(entries_.size()) > std::max<std::int64_t>(1, keep_)) {
    entries_.pop_front();
  }
}

void SnapshotBook::on_step(std::int64_t step, bool clean) {
  if (entries_.empty() || entries_.back().confirmed || entries_.back().step != step - 1) return;
  if (clean) {
    entries_.back().confirmed = true;
  } else {
    entries_.pop_back();
  }
}

std::vector<std::int64_t> SnapshotBook::candidates(bool replicas_diverged) const {
  std::vector<std::int64_t> out;
  for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) {
    // After a failed replica check, only snapshots from before the last one that passed hold
    // equal replicas.
    if (it->confirmed && (!replicas_diverged || it->step < replicas_agreed_before_)) {
      out.push_back(it->step);
    }
  }
  return out;
}

std::optional<RollbackTarget> SnapshotBook::roll_back(std::int64_t /*step*/,
                                                      bool replicas_diverged) {
  const std::vector<std::int64_t> c = candidates(replicas_diverged);
  if (c.empty()) return std::nullopt;
  RollbackTarget target{c.front(), at(c.front())->words};
  drop_newer_than(target.step);
  return target;
}

const SnapshotBook::Entry* SnapshotBook::at(std::int64_t step) const {
  for (const auto& e : entries_) {
    if (e.step == step) return &e;
  }
  return nullptr;
}

std::vector<std::int64_t> SnapshotBook::steps() const {
  std::vector<std::int64_t> out;
  for (const auto& e : entries_) out.push_back(e.step);
  return out;
}

void SnapshotBook::drop(std::int64_t step) {
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [step](const Entry& e) { return e.step == step; }),
                 entries_.end());
}

void SnapshotBook::drop_newer_than(std::int64_t step) {
  while (!entries_.empty() && entries_.back().step > step) entries_.pop_back();
}

}  // namespace stepguard
