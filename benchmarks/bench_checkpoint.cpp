// RAM snapshots and disk checkpoints against plain copies of the same bytes, in one run.
//
//   build/bin/bench_checkpoint [--gb G] [--dir DIR] [--repeat N]
//
// State: AdamW over 64 fp32 parameters, ~G GB in all (parameters + two moments; default 1).
// Cases (median of N runs, default 3):
//   snapshot take      the engine's snapshot (ring full: buffers refilled) vs memcpy of the bytes
//   snapshot restore   the engine's restore through the optimizer port   vs memcpy of the bytes
//   disk write         encode + per-rank file + manifest, fsynced        vs write()+fsync of as
//                                                                          many bytes to one file
//   disk load          read + checksum verify + decode into the model    vs read() of that file
// Ratios: vs_baseline = stepguard time / baseline time (RAM: lower is better, target <= 2);
// write_throughput_ratio = baseline time / stepguard time (target >= 0.5). Disk reads come from
// the page cache for both (the files were just written); they measure the CPU side.
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

}  // namespace

int main(int argc, char** argv) {
  double gb = 1.0;
  int repeat = 3;
  std::string dir = std::filesystem::temp_directory_path().string() + "/stepguard_bench_ckpt";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--gb") gb = std::stod(argv[i + 1]);
    if (flag == "--dir") dir = argv[i + 1];
    if (flag == "--repeat") repeat = std::max(1, std::stoi(argv[i + 1]));
  }
  torch::manual_seed(0);
  const std::int64_t total_floats = static_cast<std::int64_t>(gb * 1e9 / 4.0 / 3.0);
  const std::int64_t per_tensor = total_floats / 64;
  std::vector<torch::Tensor> params;
  for (int i = 0; i < 64; ++i) params.push_back(torch::randn({per_tensor}, torch::requires_grad()));
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-3));
  for (auto& p : params) p.mutable_grad() = torch::randn_like(p);
  opt.step();  // creates the two moments
  const std::int64_t bytes = 3 * 64 * per_tensor * 4;
  std::printf("state: AdamW, 64 fp32 parameters of %lld elements, %.3f GB (params + 2 moments)\n",
              static_cast<long long>(per_tensor), bytes / 1e9);

  // Baseline: memcpy of the same bytes into preallocated buffers.
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
  const double t_memcpy = median_seconds(repeat, [&] {
    for (std::size_t i = 0; i < src.size(); ++i) std::memcpy(dst[i].data(), src[i], dst[i].size());
  });

  stepguard::LibTorchPort port(opt, torch::OrderedDict<std::string, torch::Tensor>());
  stepguard::consensus::LocalConsensus one_rank;
  stepguard::RecoveryConfig rc;
  rc.snapshot_keep = 1;
  stepguard::Recovery recovery(one_rank, port, rc);
  recovery.take_snapshot(1, {});  // first take allocates; measured takes refill
  std::int64_t step = 1;
  const double t_take = median_seconds(repeat, [&] { recovery.take_snapshot(++step, {}); });
  const double t_restore = median_seconds(repeat, [&] { recovery.restore_snapshot(step); });

  // Disk.
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
  const double t_write = median_seconds(repeat, write_checkpoint);
  const std::string same_size(payload_bytes, '\x5a');
  int plain_index = 0;
  std::string plain;
  auto write_plain = [&] {
    plain = dir + "/plain-" + std::to_string(++plain_index) + ".bin";
    plain_write(plain, same_size);
    std::filesystem::remove(dir + "/plain-" + std::to_string(plain_index - 2) + ".bin");
  };
  write_plain();
  const double t_plain_write = median_seconds(repeat, write_plain);
  const CheckpointEntry newest = list_checkpoints(dir).back();
  const double t_load = median_seconds(repeat, [&] {
    const DecodedPayload p = decode_payload(read_rank_file(newest, 0), newest.dir);
    const auto live = recovery.training_tensors();
    check_fits(p.tensors, live, newest.dir);
    copy_into(p.tensors, live);
  });
  const double t_plain_read = median_seconds(repeat, [&] { (void)plain_read(plain); });

  const double mb = bytes / 1e6;
  const double payload_mb = static_cast<double>(payload_bytes) / 1e6;
  std::printf("%-18s %10s %10s %12s %12s %10s\n", "case", "stepguard", "baseline", "sg MB/s",
              "base MB/s", "ratio");
  auto row = [](const char* name, double t, double base, double size_mb, double ratio) {
    std::printf("%-18s %9.3fs %9.3fs %12.0f %12.0f %10.2f\n", name, t, base, size_mb / t,
                size_mb / base, ratio);
  };
  row("snapshot take", t_take, t_memcpy, mb, t_take / t_memcpy);
  row("snapshot restore", t_restore, t_memcpy, mb, t_restore / t_memcpy);
  row("disk write", t_write, t_plain_write, payload_mb, t_plain_write / t_write);
  row("disk load", t_load, t_plain_read, payload_mb, t_load / t_plain_read);
  std::printf(
      "ratios: take and restore = stepguard / memcpy (target restore <= 2); disk write = "
      "plain / stepguard throughput (target >= 0.5); disk load = stepguard / plain read\n");
  std::printf(
      "{\"bytes\": %lld, \"take_vs_memcpy\": %.3f, \"restore_vs_memcpy\": %.3f, "
      "\"write_throughput_ratio\": %.3f, \"load_vs_read\": %.3f}\n",
      static_cast<long long>(bytes), t_take / t_memcpy, t_restore / t_memcpy,
      t_plain_write / t_write, t_load / t_plain_read);
  std::filesystem::remove_all(dir);
  return 0;
}
