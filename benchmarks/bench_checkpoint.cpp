// RAM snapshots and disk checkpoints against plain copies of the same bytes, in one run.
//
//   build/bin/bench_checkpoint [--gb G] [--dir DIR] [--repeat N] [--batch B] [--every E]
//
// State: AdamW over 64 fp32 parameters, ~G GB in all (parameters + two moments; default 1).
// Cases (median of N runs, default 3):
//   snapshot take      a synchronous snapshot (ring full: buffers refilled)  vs memcpy of the bytes
//   snapshot restore   the engine's restore through the optimizer port      vs memcpy of the bytes
//   disk write         encode + per-rank file + manifest, fsynced           vs write()+fsync of as
//                                                                             many bytes to one
//                                                                             file
//   disk load          read + checksum verify + decode into the model       vs read() of that file
// Off the training thread, in a training loop (each step: a forward and backward through the
// parameters with a batch of B rows, then the guard's snapshot/checkpoint calls):
//   snapshot stall     what the training thread spends on one snapshot (capture, hand-off, and
//                      the wait at the next step for a copy not finished yet) vs memcpy
//   disk stall         what it spends on one disk checkpoint (written every E steps from a host
//                      copy of its own: the copy's wait, the hand-off, the commit) vs the
//                      synchronous write of the same checkpoint (encode + file + commit)
// Ratios: vs_baseline = stepguard time / baseline time (RAM: lower is better, target <= 2);
// write_throughput_ratio = baseline time / stepguard time (target >= 0.5); snapshot_stall_vs_copy
// and disk_stall_vs_sync_write (target <= 0.1 each). Disk reads come from the page cache for both
// (the files were just written); they measure the CPU side.
#include <fcntl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "csrc/checkpoint/background.h"
#include "csrc/checkpoint/disk_checkpoint.h"
#include "csrc/checkpoint/payload.h"
#include "csrc/consensus/consensus.h"
#include "plugin/src/libtorch_port.h"
#include "plugin/src/recovery.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace stepguard::checkpoint;

double median_seconds(int repeat, const std::function<void()>& f) {
  std::vector<double> t;
  for (int i = 0; i < repeat; ++i) {
    const auto t0 = Clock::now();
    f();
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void plain_write(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) break;
    done += static_cast<std::size_t>(n);
  }
  ::fsync(fd);
  ::close(fd);
}

std::string plain_read(const std::string& path) {
  std::string out(static_cast<std::size_t>(std::filesystem::file_size(path)), '\0');
  const int fd = ::open(path.c_str(), O_RDONLY);
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::read(fd, out.data() + done, out.size() - done);
    if (n <= 0) break;
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
  return out;
}

// A stand-in for one step's forward and backward: reads every parameter (as a [rows, 1024]
// weight) with a batch of `batch` rows, writes activations and gradients of its own, never the
// parameters or the optimizer state.
struct Compute {
  Compute(const std::vector<torch::Tensor>& params, std::int64_t batch) {
    for (const auto& p : params) weights.push_back(p.detach().view({-1, 1024}));
    x = torch::randn({batch, 1024});
    for (const auto& w : weights) {
      y.push_back(torch::empty({batch, w.size(0)}));
      g.push_back(torch::empty_like(w));
    }
  }
  void step() {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < weights.size(); ++i) {
      at::mm_out(y[i], x, weights[i].t());  // forward
      at::mm_out(g[i], y[i].t(), x);        // weight gradient
    }
  }
  std::vector<torch::Tensor> weights, y, g;
  torch::Tensor x;
};

// The command line: see the top of this file.
struct Options {
  double gb = 1.0;
  int repeat = 3;
  std::int64_t batch = 64;
  int every = 25;
  std::string dir = std::filesystem::temp_directory_path().string() + "/stepguard_bench_ckpt";
};

Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--gb") o.gb = std::stod(argv[i + 1]);
    if (flag == "--dir") o.dir = argv[i + 1];
    if (flag == "--repeat") o.repeat = std::max(1, std::stoi(argv[i + 1]));
    if (flag == "--batch") o.batch = std::max<std::int64_t>(1, std::stoll(argv[i + 1]));
    if (flag == "--every") o.every = std::max(2, std::stoi(argv[i + 1]));
  }
  return o;
}

// What the run measured: median seconds of each case and its baseline, and what they moved.
struct Results {
  std::int64_t bytes = 0;         // the optimizer state: parameters and two moments
  std::size_t payload_bytes = 0;  // one checkpoint's payload
  double t_memcpy = 0.0;
  double t_take = 0.0;
  double t_restore = 0.0;
  double t_compute = 0.0;
  double t_snapshot_stall = 0.0;
  double t_compute_beside = 0.0;
  double t_write = 0.0;
  double t_plain_write = 0.0;
  double t_load = 0.0;
  double t_plain_read = 0.0;
  double t_disk_stall = 0.0;
  std::int64_t skipped = 0;
  std::int64_t failures = 0;
  std::size_t disk_stalls_measured = 0;
};

// Baseline: memcpy of the same bytes (parameters and both moments) into preallocated buffers.
double time_memcpy(const std::vector<torch::Tensor>& params, torch::optim::AdamW& opt,
                   std::int64_t per_tensor, int repeat) {
  std::vector<std::vector<char>> dst(192,
                                     std::vector<char>(static_cast<std::size_t>(per_tensor) * 4));
  std::vector<const void*> src;
  for (auto& p : params) src.push_back(p.data_ptr());
  for (auto& [key, st] : opt.state()) {
    auto& a = static_cast<torch::optim::AdamWParamState&>(*st);
    src.push_back(a.exp_avg().data_ptr());
    src.push_back(a.exp_avg_sq().data_ptr());
  }
  for (std::size_t i = 0; i < src.size(); ++i) std::memset(dst[i].data(), 1, dst[i].size());
  return median_seconds(repeat, [&] {
    for (std::size_t i = 0; i < src.size(); ++i) std::memcpy(dst[i].data(), src[i], dst[i].size());
  });
}

// Synchronous snapshots (the copy started and waited for at once) and their restore. Returns the
// last step snapshotted.
std::int64_t time_take_and_restore(stepguard::Recovery& recovery, int repeat, Results* r) {
  auto take_now = [&](std::int64_t at) { recovery.take_snapshot(at, {}); };
  take_now(1);  // first take allocates; measured takes refill
  std::int64_t step = 1;
  r->t_take = median_seconds(repeat, [&] { take_now(++step); });
  r->t_restore = median_seconds(repeat, [&] { recovery.restore_snapshot(step); });
  return step;
}

// Snapshots off the training thread: one per step, each copied while the next step computes.
void time_snapshot_stalls(stepguard::Recovery& recovery, Compute& compute, int repeat,
                          std::int64_t step, Results* r) {
  compute.step();  // warm-up
  r->t_compute = median_seconds(repeat, [&] { compute.step(); });
  std::vector<double> snapshot_stalls;
  for (int i = 0; i <= repeat; ++i) {
    const auto t0 = Clock::now();
    recovery.finish_snapshot();  // the start of the next step waits for a copy not done yet
    recovery.begin_snapshot(++step, {});
    const double stall = std::chrono::duration<double>(Clock::now() - t0).count();
    if (i > 0) snapshot_stalls.push_back(stall);  // the first one waited for nothing
    compute.step();
  }
  const auto t_wait = Clock::now();
  recovery.finish_snapshot();
  snapshot_stalls.back() += std::chrono::duration<double>(Clock::now() - t_wait).count();
  std::sort(snapshot_stalls.begin(), snapshot_stalls.end());
  r->t_snapshot_stall = snapshot_stalls[snapshot_stalls.size() / 2];
  // What the copy running beside it costs the computation (2 cores share the memory bus).
  r->t_compute_beside = median_seconds(repeat, [&] {
    recovery.finish_snapshot();
    recovery.begin_snapshot(++step, {});
    compute.step();
  });
  recovery.finish_snapshot();
}

// Synchronous disk checkpoints (write and load) against plain files of the same size.
void time_disk(stepguard::Recovery& recovery, stepguard::LibTorchPort& port, const std::string& dir,
               int repeat, Results* r) {
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  GuardRecord record;
  // Both disk cases write new files (the disk may be slow on blocks it has never held) and keep
  // the newest two, and both get one unmeasured warm-up write.
  std::int64_t disk_step = 0;
  std::size_t payload_bytes = 0;
  auto write_checkpoint = [&] {
    ++disk_step;
    const EncodedPayload payload =
        encode_payload(record, recovery.training_tensors(), port.state_bytes(), capture_rng());
    payload_bytes = payload.pieces().size();
    write_rank_file(dir, "bench", disk_step, 0, payload.pieces());
    commit_checkpoint(dir, "bench", disk_step, 1, 2);
  };
  write_checkpoint();
  r->t_write = median_seconds(repeat, write_checkpoint);
  r->payload_bytes = payload_bytes;
  const std::string same_size(payload_bytes, '\x5a');
  int plain_index = 0;
  std::string plain;
  auto write_plain = [&] {
    plain = dir + "/plain-" + std::to_string(++plain_index) + ".bin";
    plain_write(plain, same_size);
    std::filesystem::remove(dir + "/plain-" + std::to_string(plain_index - 2) + ".bin");
  };
  write_plain();
  r->t_plain_write = median_seconds(repeat, write_plain);
  const CheckpointEntry newest = list_checkpoints(dir).back();
  r->t_load = median_seconds(repeat, [&] {
    const DecodedPayload p = decode_payload(read_rank_file(newest, 0), newest.dir);
    const auto live = recovery.training_tensors();
    check_fits(p.tensors, live, newest.dir);
    copy_into(p.tensors, live);
  });
  r->t_plain_read = median_seconds(repeat, [&] { (void)plain_read(plain); });
}

// Disk checkpoints off the training thread: a guard without RAM snapshots (the checkpoint
// makes its own host copy) writing every `every` steps; the stall of each checkpoint is the
// training thread's time in the checkpoint calls from its start until it is committed.
void time_disk_stalls(stepguard::consensus::LocalConsensus& one_rank, stepguard::LibTorchPort& port,
                      Compute& compute, const std::string& dir, int every, int repeat, Results* r) {
  const std::string async_dir = dir + "/background";
  stepguard::RecoveryConfig disk_config;
  disk_config.checkpoint_dir = async_dir;
  disk_config.disk_every = every;
  disk_config.disk_keep = 2;
  disk_config.run_id = "bench";
  stepguard::Recovery writer(one_rank, port, disk_config);
  writer.claim_checkpoint_dir(1);
  std::vector<double> disk_stalls;
  std::int64_t skipped = 0;
  double stall = 0.0;
  std::int64_t async_step = 0;
  for (int checkpoint = 0; checkpoint <= repeat + 1; ++checkpoint) {
    for (int s = 0; s < every; ++s) {
      compute.step();
      ++async_step;
      const auto t0 = Clock::now();
      writer.finish_snapshot();
      const bool written = writer.checkpoint_written();
      const bool committed = writer.settle_pending(async_step, true, written) != 0;
      if (writer.disk_due(async_step, true) && !writer.write_checkpoint(GuardRecord{async_step})) {
        ++skipped;
      }
      stall += std::chrono::duration<double>(Clock::now() - t0).count();
      if (committed) {
        if (checkpoint > 1) disk_stalls.push_back(stall);  // the first one started cold
        stall = 0.0;
      }
    }
  }
  writer.wait_for_checkpoint();
  std::sort(disk_stalls.begin(), disk_stalls.end());
  r->t_disk_stall = disk_stalls.empty() ? 0.0 : disk_stalls[disk_stalls.size() / 2];
  r->failures = writer.checkpoint_counts().failed;
  r->skipped = skipped;
  r->disk_stalls_measured = disk_stalls.size();
}

void print_results(const Results& r, const Options& o) {
  const double mb = r.bytes / 1e6;
  const double payload_mb = static_cast<double>(r.payload_bytes) / 1e6;
  std::printf("%-18s %10s %10s %12s %12s %10s\n", "case", "stepguard", "baseline", "sg MB/s",
              "base MB/s", "ratio");
  auto row = [](const char* name, double t, double base, double size_mb, double ratio) {
    std::printf("%-18s %9.3fs %9.3fs %12.0f %12.0f %10.2f\n", name, t, base, size_mb / t,
                size_mb / base, ratio);
  };
  row("snapshot take", r.t_take, r.t_memcpy, mb, r.t_take / r.t_memcpy);
  row("snapshot stall", r.t_snapshot_stall, r.t_memcpy, mb, r.t_snapshot_stall / r.t_memcpy);
  row("snapshot restore", r.t_restore, r.t_memcpy, mb, r.t_restore / r.t_memcpy);
  row("disk write", r.t_write, r.t_plain_write, payload_mb, r.t_plain_write / r.t_write);
  row("disk stall", r.t_disk_stall, r.t_write, payload_mb, r.t_disk_stall / r.t_write);
  row("disk load", r.t_load, r.t_plain_read, payload_mb, r.t_load / r.t_plain_read);
  std::printf(
      "ratios: take and restore = stepguard / memcpy (target restore <= 2); disk write = "
      "plain / stepguard throughput (target >= 0.5); disk load = stepguard / plain read;\n"
      "snapshot stall = training-thread time per background snapshot / memcpy, disk stall = "
      "training-thread time per background checkpoint / synchronous write (targets <= 0.1)\n");
  std::printf(
      "step: forward+backward %.3fs (batch %lld), %.3fs with a snapshot copying beside it; disk "
      "checkpoint every %d steps, %lld skipped, %lld failed, %zu measured\n",
      r.t_compute, static_cast<long long>(o.batch), r.t_compute_beside, o.every,
      static_cast<long long>(r.skipped), static_cast<long long>(r.failures),
      r.disk_stalls_measured);
  std::printf(
      "{\"bytes\": %lld, \"take_vs_memcpy\": %.3f, \"restore_vs_memcpy\": %.3f, "
      "\"write_throughput_ratio\": %.3f, \"load_vs_read\": %.3f, \"snapshot_stall_vs_copy\": "
      "%.3f, \"disk_stall_vs_sync_write\": %.3f, \"step_seconds\": %.3f, "
      "\"step_seconds_beside_copy\": %.3f}\n",
      static_cast<long long>(r.bytes), r.t_take / r.t_memcpy, r.t_restore / r.t_memcpy,
      r.t_plain_write / r.t_write, r.t_load / r.t_plain_read, r.t_snapshot_stall / r.t_memcpy,
      r.t_disk_stall / r.t_write, r.t_compute, r.t_compute_beside);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse_options(argc, argv);
  torch::manual_seed(0);
  const std::int64_t total_floats = static_cast<std::int64_t>(o.gb * 1e9 / 4.0 / 3.0);
  const std::int64_t per_tensor = std::max<std::int64_t>(1, total_floats / 64 / 1024) * 1024;
  std::vector<torch::Tensor> params;
  for (int i = 0; i < 64; ++i) params.push_back(torch::randn({per_tensor}, torch::requires_grad()));
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-3));
  for (auto& p : params) p.mutable_grad() = torch::randn_like(p);
  opt.step();  // creates the two moments
  Results r;
  r.bytes = 3 * 64 * per_tensor * 4;
  std::printf("state: AdamW, 64 fp32 parameters of %lld elements, %.3f GB (params + 2 moments)\n",
              static_cast<long long>(per_tensor), r.bytes / 1e9);
  r.t_memcpy = time_memcpy(params, opt, per_tensor, o.repeat);

  stepguard::LibTorchPort port(opt, torch::OrderedDict<std::string, torch::Tensor>());
  stepguard::consensus::LocalConsensus one_rank;
  stepguard::RecoveryConfig rc;
  rc.snapshot_every = 1;
  rc.snapshot_keep = 1;
  stepguard::Recovery recovery(one_rank, port, rc);
  const std::int64_t step = time_take_and_restore(recovery, o.repeat, &r);
  Compute compute(params, o.batch);
  time_snapshot_stalls(recovery, compute, o.repeat, step, &r);
  time_disk(recovery, port, o.dir, o.repeat, &r);
  time_disk_stalls(one_rank, port, compute, o.dir, o.every, o.repeat, &r);
  print_results(r, o);
  std::filesystem::remove_all(o.dir);
  return 0;
}
