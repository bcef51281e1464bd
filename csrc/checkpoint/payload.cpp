#include "csrc/checkpoint/payload.h"

#include <ATen/core/Generator.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/serialize/archive.h>

#include <mutex>
#include <sstream>

#include "csrc/checkpoint/disk_checkpoint.h"

namespace stepguard {
namespace checkpoint {

namespace {

at::Tensor words_tensor(const std::vector<std::int64_t>& words) {
  return at::tensor(at::ArrayRef<std::int64_t>(words), at::kLong);
}

std::vector<std::int64_t> words_of(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous();
  return std::vector<std::int64_t>(c.data_ptr<std::int64_t>(),
                                   c.data_ptr<std::int64_t>() + c.numel());
}

int cuda_devices() {
  return at::detail::getCUDAHooks().hasCUDA() ? at::detail::getCUDAHooks().getNumGPUs() : 0;
}

}  // namespace

std::string encode_payload(const GuardRecord& record, const std::vector<at::Tensor>& params,
                           const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  archive.write("format", c10::IValue(static_cast<std::int64_t>(kDiskFormat)));
  archive.write("step", c10::IValue(record.step));
  archive.write("data_position", c10::IValue(record.data_position));
  archive.write("guard", words_tensor(record.guard));
  archive.write("totals", words_tensor(record.totals));
  archive.write("skipped_ranges", words_tensor(record.skipped_ranges));
  archive.write("param_count", c10::IValue(static_cast<std::int64_t>(params.size())));
  for (std::size_t i = 0; i < params.size(); ++i) {
    archive.write("param." + std::to_string(i), params[i].detach().to(at::kCPU));
  }
  torch::serialize::OutputArchive opt(archive.compilation_unit());
  optimizer.save(opt);
  archive.write("optimizer", opt);
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    archive.write("rng.cpu", gen.get_state());
  }
  const int devices = cuda_devices();
  archive.write("rng.cuda_count", c10::IValue(static_cast<std::int64_t>(devices)));
  for (int d = 0; d < devices; ++d) {
    auto gen = at::globalContext().defaultGenerator(at::Device(at::kCUDA, d));
    std::lock_guard<std::mutex> lock(gen.mutex());
    archive.write("rng.cuda." + std::to_string(d), gen.get_state());
  }
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

GuardRecord decode_payload(const std::string& bytes, const std::string& source,
                           const std::vector<at::Tensor>& params,
                           torch::optim::Optimizer& optimizer) {
  torch::serialize::InputArchive archive;
  GuardRecord record;
  std::vector<at::Tensor> saved(params.size());
  at::Tensor cpu_rng;
  std::vector<at::Tensor> cuda_rng;
  torch::serialize::InputArchive opt;
  try {
    std::istringstream in(bytes);
    archive.load_from(in);
    c10::IValue v;
    archive.read("format", v);
    if (v.toInt() != kDiskFormat) {
      throw CheckpointError(source + ": format " + std::to_string(v.toInt()) +
                            ", this stepguard reads " + std::to_string(kDiskFormat));
    }
    archive.read("step", v);
    record.step = v.toInt();
    archive.read("data_position", v);
    record.data_position = v.toInt();
    at::Tensor t;
    archive.read("guard", t);
    record.guard = words_of(t);
    archive.read("totals", t);
    record.totals = words_of(t);
    archive.read("skipped_ranges", t);
    record.skipped_ranges = words_of(t);
    archive.read("param_count", v);
    if (v.toInt() != static_cast<std::int64_t>(params.size())) {
      throw CheckpointError(source + ": holds " + std::to_string(v.toInt()) +
                            " parameters, the guard has " + std::to_string(params.size()));
    }
    for (std::size_t i = 0; i < params.size(); ++i) {
      archive.read("param." + std::to_string(i), saved[i]);
      if (saved[i].sizes() != params[i].sizes() ||
          saved[i].scalar_type() != params[i].scalar_type()) {
        std::ostringstream msg;
        msg << source << ": parameter " << i << " is " << saved[i].scalar_type() << saved[i].sizes()
            << " in the checkpoint, " << params[i].scalar_type() << params[i].sizes()
            << " in the model";
        throw CheckpointError(msg.str());
      }
    }
    archive.read("optimizer", opt);
    archive.read("rng.cpu", cpu_rng);
    archive.read("rng.cuda_count", v);
    for (std::int64_t d = 0; d < v.toInt() && d < cuda_devices(); ++d) {
      at::Tensor s;
      archive.read("rng.cuda." + std::to_string(d), s);
      cuda_rng.push_back(s);
    }
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    std::string what = e.what();
    if (const auto nl = what.find('\n'); nl != std::string::npos) what.resize(nl);
    throw CheckpointError(source + ": not a stepguard checkpoint payload (" + what + ")");
  }
  // Everything read and checked: now state changes.
  try {
    optimizer.load(opt);
  } catch (const std::exception& e) {
    std::string what = e.what();
    if (const auto nl = what.find('\n'); nl != std::string::npos) what.resize(nl);
    throw CheckpointError(source + ": the optimizer state does not fit this optimizer (" + what +
                          ")");
  }
  {
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < params.size(); ++i) params[i].detach().copy_(saved[i]);
  }
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(cpu_rng);
  }
  for (std::size_t d = 0; d < cuda_rng.size(); ++d) {
    auto gen = at::globalContext().defaultGenerator(at::Device(at::kCUDA, static_cast<int>(d)));
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(cuda_rng[d]);
  }
  return record;
}

}  // namespace checkpoint
}  // namespace stepguard
