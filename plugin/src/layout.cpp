// The parallel layout on the engine's side: resolving a port's placements, and the check at
// construction that every rank's list fits the others'.
#include "plugin/src/layout.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <unordered_map>

#include "csrc/consensus/step_buffer.h"

namespace stepguard {

std::string to_string(const Placement& p) {
  switch (p.kind) {
    case Placement::Kind::kReplica:
      return "replica";
    case Placement::Kind::kReplicated:
      return "replicated(" + std::to_string(p.copies) + ")";
    case Placement::Kind::kShard:
      return "shard(" + std::to_string(p.copies) + ")";
    case Placement::Kind::kAbsent:
      return "absent";
  }
  return "?";
}

ResolvedLayout resolve_layout(const std::vector<Placement>& layout,
                              const std::vector<at::Tensor>& params,
                              const std::vector<std::string>& names, bool sharded_gradients,
                              int world_size) {
  TORCH_CHECK(layout.empty() || !sharded_gradients,
              "stepguard: sharded_gradients is set and the optimizer port gives a layout too; "
              "set it in one place (the layout's Placement.shard() says it per parameter)");
  TORCH_CHECK(layout.empty() || layout.size() == params.size(), "stepguard: the port's layout has ",
              layout.size(), " placements for ", params.size(), " parameters");
  // A tensor listed twice (torch.optim only warns of a duplicate inside one group) would be
  // counted twice in the norm and unscaled twice in place.
  std::unordered_map<const void*, std::size_t> first_at;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!params[i].defined()) continue;
    const auto [it, fresh] = first_at.emplace(params[i].unsafeGetTensorImpl(), i);
    const auto name = [&names](std::size_t k) {
      return k < names.size() ? "'" + names[k] + "'" : std::string("?");
    };
    TORCH_CHECK(fresh, "stepguard: parameter ", i, " (", name(i), ") is parameter ", it->second,
                " (", name(it->second), ") again: the optimizer lists the same tensor twice ",
                "(torch.optim warns of duplicate parameters in a group); list each once");
  }
  ResolvedLayout r;
  r.copies.resize(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    const Placement p = !layout.empty()     ? layout[i]
                        : sharded_gradients ? Placement::shard()
                                            : Placement::replica();
    const int copies = p.copies_in(world_size);
    const bool counted =
        p.kind == Placement::Kind::kReplicated || p.kind == Placement::Kind::kShard;
    TORCH_CHECK(!counted || (copies >= 1 && copies <= world_size), "stepguard: parameter ", i,
                " ('", i < names.size() ? names[i] : std::string("?"), "') is placed ",
                to_string(p), ": copies must be in [1, ", world_size,
                "], the ranks of the guard's group");
    r.copies[i] = copies;
    const std::int64_t numel = params[i].defined() ? params[i].numel() : 0;
    if (p.kind == Placement::Kind::kReplica) {
      ++r.replica_tensors;
      r.replica_elements += numel;
    } else {
      r.all_replicas = false;
      if (copies > 0) r.distinct_elements += static_cast<double>(numel) / copies;
      if (copies > 0 && numel > 0) r.distinct_tensors += 1.0 / copies;
    }
  }
  return r;
}

std::uint64_t text_digest(const std::string& text) noexcept {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

namespace {

constexpr int kRowReplicaTensors = 0;
constexpr int kRowReplicaElements = 1;
constexpr int kRowDistinct = 2;
constexpr int kRowAllReplicas = 3;
constexpr int kRowPolicy = 4;  ///< the policy digest in four 16-bit chunks (exact in fp64)
constexpr int kRowCheckpointDir = 8;
constexpr int kRowDiskEvery = 9;
constexpr int kRowLossScaling = 10;
constexpr int kRowSharded = 11;
constexpr int kRowDistinctTensors = 12;
constexpr int kRowEnabled = 13;
constexpr int kRowSize = 14;

// The settings that differ across ranks, each with every rank's value: empty when all agree.
std::string settings_differ(const std::vector<double>& rows, int world) {
  auto at = [&](int r, int col) { return rows[static_cast<std::size_t>(r) * kRowSize + col]; };
  std::ostringstream m;
  const auto compare = [&](const char* what, int first, int width, bool show_values) {
    bool same = true;
    for (int r = 1; r < world; ++r) {
      for (int c = first; c < first + width; ++c) same = same && at(r, c) == at(0, c);
    }
    if (same) return;
    m << (m.tellp() > 0 ? "; " : "") << what << " (";
    for (int r = 0; r < world; ++r) {
      m << (r ? ", " : "") << "rank " << r << ": ";
      if (show_values) {
        m << static_cast<std::int64_t>(at(r, first));
      } else {
        bool as_rank0 = true;
        for (int c = first; c < first + width; ++c) as_rank0 = as_rank0 && at(r, c) == at(0, c);
        m << (as_rank0 ? "as rank 0's" : "another");
      }
    }
    m << ")";
  };
  compare("the policy", kRowPolicy, 4, false);
  compare("checkpoint_dir given (1) or not (0)", kRowCheckpointDir, 1, true);
  compare("the disk checkpoint cadence", kRowDiskEvery, 1, true);
  compare("loss scaling", kRowLossScaling, 1, true);
  compare("sharded_gradients", kRowSharded, 1, true);
  compare("enabled", kRowEnabled, 1, true);
  return m.str();
}

}  // namespace

bool reconcile_ranks(consensus::Consensus& consensus, const ResolvedLayout& mine,
                     const RankSettings& settings, const at::Device& device) {
  const int world = consensus.world_size();
  if (world == 1) return mine.all_replicas;
  at::Tensor row = at::zeros({kRowSize}, at::TensorOptions().dtype(at::kDouble));
  row[kRowReplicaTensors] = static_cast<double>(mine.replica_tensors);
  row[kRowReplicaElements] = static_cast<double>(mine.replica_elements);
  row[kRowDistinct] = mine.distinct_elements;
  row[kRowAllReplicas] = mine.all_replicas ? 1.0 : 0.0;
  for (int c = 0; c < 4; ++c) {
    row[kRowPolicy + c] = static_cast<double>((settings.policy_digest >> (16 * c)) & 0xFFFF);
  }
  row[kRowCheckpointDir] = settings.checkpoint_dir ? 1.0 : 0.0;
  row[kRowDiskEvery] = static_cast<double>(settings.disk_every);
  row[kRowLossScaling] = settings.loss_scaling ? 1.0 : 0.0;
  row[kRowSharded] = settings.sharded_gradients ? 1.0 : 0.0;
  row[kRowDistinctTensors] = mine.distinct_tensors;
  row[kRowEnabled] = settings.enabled ? 1.0 : 0.0;
  const std::vector<double> rows =
      consensus::gather_rank_rows(consensus, row.to(device), /*step=*/0);
  auto at = [&](int r, int col) { return rows[static_cast<std::size_t>(r) * kRowSize + col]; };
  const std::string differ = settings_differ(rows, world);
  TORCH_CHECK(differ.empty(),
              "stepguard: the ranks were given settings that must agree and do "
              "not: ",
              differ,
              ". Every rank decides each step alike and meets the others in the "
              "same collectives only with the same settings: give every rank the same (a "
              "checkpoint_dir on every rank, not on rank 0 alone: each rank writes its own file)");
  bool alike = true;
  bool all_replicas = true;
  double distinct = 0.0;
  double distinct_tensors = 0.0;
  for (int r = 0; r < world; ++r) {
    distinct_tensors += at(r, kRowDistinctTensors);
    alike = alike && at(r, kRowReplicaTensors) == at(0, kRowReplicaTensors) &&
            at(r, kRowReplicaElements) == at(0, kRowReplicaElements);
    all_replicas = all_replicas && at(r, kRowAllReplicas) > 0;
    distinct += at(r, kRowDistinct);
  }
  if (!alike) {
    std::ostringstream m;
    m << "stepguard: the ranks' parameter lists do not fit together: a gradient every rank holds "
         "(Placement.replica, the default) must be on every rank, and";
    for (int r = 0; r < world; ++r) {
      m << (r ? "," : "") << " rank " << r << " holds "
        << static_cast<std::int64_t>(at(r, kRowReplicaTensors)) << " ("
        << static_cast<std::int64_t>(at(r, kRowReplicaElements)) << " elements)";
    }
    m << ". Give each rank's own gradients their placement (the port's layout: shard for a "
         "sharded optimizer or another stage's parameters' absence, replicated(n) for tensor-"
         "parallel copies), or sharded_gradients=True when every rank holds parts";
    TORCH_CHECK(false, m.str());
  }
  // Every distinct element is held by `copies` ranks, each adding 1/copies of it: whole elements.
  const double whole = std::round(distinct);
  TORCH_CHECK(std::abs(distinct - whole) <= 1e-6 * std::max(1.0, distinct),
              "stepguard: the ranks' layouts do not fit together: their gradients' elements, each "
              "over the number of ranks said to hold it, add up to ",
              distinct,
              ", not a whole number; a replicated(n) or shard(n) placement names a number of ranks "
              "that do not all hold that gradient");
  // The same count over tensors: a part said to be held by n ranks that fewer hold.
  TORCH_CHECK(std::abs(distinct_tensors - std::round(distinct_tensors)) <= 1e-6,
              "stepguard: the ranks' layouts do not fit together: their gradients that hold "
              "elements, each over the number of ranks said to hold it, add up to ",
              distinct_tensors,
              " tensors, not a whole number; a replicated(n) or shard(n) placement names n ranks "
              "where fewer hold that gradient (e.g. shard(2) on one rank, absent() on the other)");
  return all_replicas;
}

}  // namespace stepguard
