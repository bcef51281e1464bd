// The parallel layout on the engine's side: resolving a port's placements, and the check at
// construction that every rank's list fits the others'.
#include "plugin/src/layout.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>

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
    }
  }
  return r;
}

namespace {

constexpr int kRowReplicaTensors = 0;
constexpr int kRowReplicaElements = 1;
constexpr int kRowDistinct = 2;
constexpr int kRowAllReplicas = 3;
constexpr int kRowSize = 4;

}  // namespace

bool reconcile_layouts(consensus::Consensus& consensus, const ResolvedLayout& mine,
                       const at::Device& device) {
  const int world = consensus.world_size();
  if (world == 1) return mine.all_replicas;
  at::Tensor row = at::zeros({kRowSize}, at::TensorOptions().dtype(at::kDouble));
  row[kRowReplicaTensors] = static_cast<double>(mine.replica_tensors);
  row[kRowReplicaElements] = static_cast<double>(mine.replica_elements);
  row[kRowDistinct] = mine.distinct_elements;
  row[kRowAllReplicas] = mine.all_replicas ? 1.0 : 0.0;
  const std::vector<double> rows =
      consensus::gather_rank_rows(consensus, row.to(device), /*step=*/0);
  auto at = [&](int r, int col) { return rows[static_cast<std::size_t>(r) * kRowSize + col]; };
  bool alike = true;
  bool all_replicas = true;
  double distinct = 0.0;
  for (int r = 0; r < world; ++r) {
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
  return all_replicas;
}

}  // namespace stepguard
