// Rendezvous and Gloo process-group creation, wiring torch's c10d.
#include "stepguard/distributed.h"

#include <torch/version.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "csrc/consensus/process_group_consensus.h"

#include <cerrno>
#include <cstdlib>
#include <stdexcept>

namespace stepguard {

namespace {

bool env_int(const char* name, long lo, long hi, bool required, int* out) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') {
    if (required) {
      throw std::invalid_argument(std::string("stepguard: environment variable ") + name +
                                  " is not set (torchrun-style rendezvous needs RANK and "
                                  "WORLD_SIZE)");
    }
    return false;
  }
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(value, &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) {
    throw std::invalid_argument(std::string("stepguard: environment variable ") + name + "='" +
                                value + "' is not a whole number in [" + std::to_string(lo) + ", " +
                                std::to_string(hi) + "]");
  }
  *out = static_cast<int>(v);
  return true;
}

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

}  // namespace

Rendezvous rendezvous_from_env() {
  Rendezvous r;
  env_int("WORLD_SIZE", 1, 1 << 20, true, &r.world_size);
  env_int("RANK", 0, r.world_size - 1, true, &r.rank);
  if (!env_int("LOCAL_RANK", 0, r.world_size - 1, false, &r.local_rank)) r.local_rank = r.rank;
  if (const char* addr = std::getenv("MASTER_ADDR"); addr != nullptr && *addr != '\0') {
    r.master_addr = addr;
  }
  env_int("MASTER_PORT", 1, 65535, false, &r.master_port);
  return r;
}

ProcessGroupHandle init_gloo_process_group(const Rendezvous& r) {
  if (r.world_size < 1 || r.rank < 0 || r.rank >= r.world_size) {
    throw std::invalid_argument("stepguard: rank " + std::to_string(r.rank) +
                                " is outside world size " + std::to_string(r.world_size));
  }
  if (r.master_port < 1 || r.master_port > 65535) {
    throw std::invalid_argument("stepguard: master_port " + std::to_string(r.master_port) +
                                " is not a TCP port");
  }
  ProcessGroupHandle handle;
  try {
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<std::uint16_t>(r.master_port);
    store_options.isServer = r.rank == 0;
    store_options.numWorkers = r.world_size;
    store_options.waitWorkers = false;
    store_options.timeout = r.timeout;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(r.master_addr, store_options);
    handle.store = c10::make_intrusive<c10d::PrefixStore>("stepguard", tcp);

    const auto gloo_store = c10::make_intrusive<c10d::PrefixStore>("gloo", tcp);
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
      handle.group = make_gloo_process_group(gloo_store, r.rank, r.world_size, r.timeout, ifname,
                                             /*is_interface=*/true);
    } else {
      // Loopback rendezvous: bind Gloo to loopback; else to this host's address ("").
      handle.group = make_gloo_process_group(gloo_store, r.rank, r.world_size, r.timeout,
                                             is_loopback(r.master_addr) ? "127.0.0.1" : "");
    }
  } catch (const std::invalid_argument&) {
    throw;
  } catch (const std::exception& e) {
    std::string cause = e.what();
    if (const auto nl = cause.find('\n'); nl != std::string::npos) cause.resize(nl);
    throw std::runtime_error("stepguard: rank " + std::to_string(r.rank) + " of " +
                             std::to_string(r.world_size) + ": rendezvous at " + r.master_addr +
                             ":" + std::to_string(r.master_port) + " failed: " + cause);
  }
  return handle;
}

c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_process_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
    std::chrono::milliseconds timeout, const std::string& hostname_or_interface,
    bool is_interface) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  if (is_interface) {
    options->devices.push_back(
        c10d::ProcessGroupGloo::createDeviceForInterface(hostname_or_interface));
  } else if (!hostname_or_interface.empty()) {
    options->devices.push_back(
        c10d::ProcessGroupGloo::createDeviceForHostname(hostname_or_interface));
  } else {
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  options->threads = 2;
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world_size, options);
#if TORCH_VERSION_MAJOR >= 2
  // Since 2.0 the Gloo class is a Backend: the group dispatches to it for CPU tensors. 2.5
  // dropped ProcessGroup::Options; the default backend is then set explicitly.
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 5
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world_size);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
#else
  auto group = c10::make_intrusive<c10d::ProcessGroup>(
      store, rank, world_size, c10::make_intrusive<c10d::ProcessGroup::Options>("gloo", timeout));
#endif
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
  return group;
#else
  return gloo;
#endif
}

void all_reduce_sum(const ProcessGroupHandle& handle, std::vector<at::Tensor>& tensors,
                    std::int64_t step, std::chrono::milliseconds timeout, const std::string& what) {
  if (!handle.group) throw std::invalid_argument("stepguard: all_reduce_sum needs a process group");
  consensus::ProcessGroupConsensus collective(handle.group, timeout, handle.store);
  collective.all_reduce_tensors(tensors, step, what);
}

}  // namespace stepguard
