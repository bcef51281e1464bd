/*
 * Multi-rank setup: torchrun-style rendezvous from the environment and a Gloo process group over
 * TCP, for jobs that do not already have a process group to hand the guard. Jobs that do pass
 * their own through GuardOptions().process_group(pg).
 */
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace stepguard {

/// Where and who this rank is. A plain value.
struct Rendezvous {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  /// Deadline for the rendezvous itself and for every collective of the group.
  std::chrono::milliseconds timeout{300000};
};

/// Reads RANK and WORLD_SIZE (required), LOCAL_RANK (default RANK), MASTER_ADDR (default
/// 127.0.0.1) and MASTER_PORT (default 29500), as torchrun sets them. Throws std::invalid_argument
/// naming the variable and its value when one is missing or malformed.
Rendezvous rendezvous_from_env();

/// A process group and the store it met through.
struct ProcessGroupHandle {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
};

/// Meets the other ranks through a TCPStore hosted by rank 0 at master_addr:master_port and
/// creates a Gloo process group. Gloo binds to the loopback interface when master_addr is a
/// loopback address, to GLOO_SOCKET_IFNAME when set, else to this host's address. Throws
/// std::runtime_error naming the address when the rendezvous misses its deadline.
ProcessGroupHandle init_gloo_process_group(const Rendezvous& rendezvous);

/// A c10d::ProcessGroup that runs on Gloo over `device` (a createDevice* of ProcessGroupGloo),
/// meeting through `store`. LibTorch 1.x: the ProcessGroupGloo itself; 2.x: a ProcessGroup
/// with ProcessGroupGloo as its CPU backend (since 2.0 the Gloo class is a c10d::Backend).
c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_process_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
    std::chrono::milliseconds timeout, const std::string& hostname_or_interface,
    bool is_interface = false);

/// Sums `tensors` in place over `handle.group`, as a data-parallel loop averages its gradients,
/// with the guard's failure handling: it gives up after `timeout`, or as soon as another rank
/// reports that this step failed, and throws std::runtime_error naming this rank, the step,
/// `what` and the ranks that are gone (the store tells which live ranks checked in). Without it
/// a dead peer surfaces as the backend's raw timeout, naming addresses instead of ranks.
void all_reduce_sum(const ProcessGroupHandle& handle, std::vector<at::Tensor>& tensors,
                    std::int64_t step, std::chrono::milliseconds timeout,
                    const std::string& what = "all-reduce");

}  // namespace stepguard
