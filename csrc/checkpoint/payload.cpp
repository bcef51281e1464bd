#include "csrc/checkpoint/payload.h"

#include <ATen/core/Generator.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/serialize/archive.h>

#include <cstring>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "csrc/checkpoint/optimizer_state.h"

namespace stepguard {
namespace checkpoint {

namespace {

constexpr char kMagic[8] = {'S', 'G', 'C', 'K', 'P', 'T', '\0', '\1'};
constexpr std::size_t kPrefix = 16;  // magic + header length

using Json = nlohmann::json;

int cuda_devices() {
  return at::detail::getCUDAHooks().hasCUDA() ? at::detail::getCUDAHooks().getNumGPUs() : 0;
}

std::string state_key(const at::Tensor& p) { return c10::guts::to_string(p.unsafeGetTensorImpl()); }

class Writer {
 public:
  // Describes `t` and queues its bytes; an undefined tensor is `null`.
  Json add(const at::Tensor& t, std::vector<at::Tensor>* keep) {
    if (!t.defined()) return nullptr;
    at::Tensor host = t.detach();
    host = host.device().is_cpu() ? host.contiguous() : host.to(at::kCPU).contiguous();
    const auto bytes = static_cast<std::int64_t>(host.numel() * host.element_size());
    Json j = {{"dtype", static_cast<int>(host.scalar_type())},
              {"shape", host.sizes().vec()},
              {"offset", offset_},
              {"bytes", bytes}};
    offset_ += bytes;
    keep->push_back(host);
    return j;
  }
  std::int64_t offset() const noexcept { return offset_; }
  void skip(std::int64_t bytes) { offset_ += bytes; }

 private:
  std::int64_t offset_ = 0;
};

// Reads the tensor an entry describes, as a view into `data` (valid while the bytes live).
class Reader {
 public:
  Reader(const char* data, std::size_t size, std::string source)
      : data_(data), size_(size), source_(std::move(source)) {}

  at::Tensor view(const Json& j, const std::string& what) const {
    if (j.is_null()) return at::Tensor();
    const int dtype = j.at("dtype").get<int>();
    if (dtype < 0 || dtype >= static_cast<int>(at::ScalarType::NumOptions)) {
      throw CheckpointError(source_ + ": " + what + ": unknown dtype " + std::to_string(dtype));
    }
    const auto type = static_cast<at::ScalarType>(dtype);
    const auto shape = j.at("shape").get<std::vector<std::int64_t>>();
    const auto offset = j.at("offset").get<std::int64_t>();
    const auto bytes = j.at("bytes").get<std::int64_t>();
    std::int64_t numel = 1;
    for (std::int64_t d : shape) {
      if (d < 0) throw CheckpointError(source_ + ": " + what + ": negative dimension");
      numel *= d;
    }
    if (offset < 0 || bytes < 0 || static_cast<std::uint64_t>(offset + bytes) > size_ ||
        numel * static_cast<std::int64_t>(c10::elementSize(type)) != bytes) {
      throw CheckpointError(source_ + ": " + what + ": its bytes do not fit the file");
    }
    return at::from_blob(const_cast<char*>(data_) + offset, shape, at::TensorOptions().dtype(type));
  }
  const char* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

 private:
  const char* data_;
  std::size_t size_;
  std::string source_;
};

}  // namespace

EncodedPayload encode_payload(const GuardRecord& record, const std::vector<at::Tensor>& params,
                              const torch::optim::Optimizer& optimizer) {
  EncodedPayload out;
  Writer w;
  Json header = {{"format", kDiskFormat},
                 {"step", record.step},
                 {"data_position", record.data_position},
                 {"guard", record.guard},
                 {"totals", record.totals},
                 {"skipped_ranges", record.skipped_ranges}};
  Json ps = Json::array();
  for (const auto& p : params) ps.push_back(w.add(p, &out.tensors_));
  header["params"] = ps;

  // Optimizer state field by field when every state is of a known type, else its archive.
  bool typed = true;
  for (const auto& [key, state] : optimizer.state()) {
    std::string type;
    std::int64_t step = 0;
    StateFields fields;
    typed = typed && read_fields(*state, &type, &step, &fields);
  }
  if (typed) {
    Json states = Json::array();
    for (std::size_t i = 0; i < params.size(); ++i) {
      auto it = optimizer.state().find(state_key(params[i]));
      if (it == optimizer.state().end()) continue;
      std::string type;
      std::int64_t step = 0;
      StateFields fields;
      read_fields(*it->second, &type, &step, &fields);
      Json f = Json::object();
      for (const auto& [name, t] : fields) f[name] = w.add(t, &out.tensors_);
      states.push_back({{"param", i}, {"type", type}, {"step", step}, {"fields", f}});
    }
    header["optimizer"] = {{"kind", "typed"}, {"states", states}};
  } else {
    torch::serialize::OutputArchive archive;
    optimizer.save(archive);
    std::ostringstream bytes;
    archive.save_to(bytes);
    out.archive_ = bytes.str();
    header["optimizer"] = {{"kind", "archive"},
                           {"offset", w.offset()},
                           {"bytes", static_cast<std::int64_t>(out.archive_.size())}};
    w.skip(static_cast<std::int64_t>(out.archive_.size()));
  }
  Json rng = Json::object();
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng["cpu"] = w.add(gen.get_state(), &out.tensors_);
  }
  Json cuda = Json::array();
  for (int d = 0; d < cuda_devices(); ++d) {
    auto gen = at::globalContext().defaultGenerator(at::Device(at::kCUDA, d));
    std::lock_guard<std::mutex> lock(gen.mutex());
    cuda.push_back(w.add(gen.get_state(), &out.tensors_));
  }
  rng["cuda"] = cuda;
  header["rng"] = rng;

  const std::string text = header.dump();
  out.prefix_.assign(kMagic, sizeof kMagic);
  const std::uint64_t length = text.size();
  for (int b = 0; b < 8; ++b) out.prefix_.push_back(static_cast<char>((length >> (8 * b)) & 0xff));
  out.prefix_ += text;
  // File order follows the offsets: the parameters, the optimizer state (tensors or archive),
  // the RNG states.
  out.pieces_.add(out.prefix_.data(), out.prefix_.size());
  for (std::size_t i = 0; i < out.tensors_.size(); ++i) {
    if (i == params.size() && !out.archive_.empty()) {
      out.pieces_.add(out.archive_.data(), out.archive_.size());
    }
    const at::Tensor& t = out.tensors_[i];
    out.pieces_.add(t.data_ptr(), static_cast<std::size_t>(t.numel() * t.element_size()));
  }
  return out;
}

GuardRecord decode_payload(const std::string& bytes, const std::string& source,
                           const std::vector<at::Tensor>& params,
                           torch::optim::Optimizer& optimizer) {
  if (bytes.size() < kPrefix || std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0) {
    throw CheckpointError(source + ": not a stepguard checkpoint (bad magic)");
  }
  std::uint64_t length = 0;
  for (int b = 0; b < 8; ++b) {
    length |= static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[8 + b])) << (8 * b);
  }
  if (length > bytes.size() - kPrefix) throw CheckpointError(source + ": header is truncated");
  const Reader data(bytes.data() + kPrefix + length, bytes.size() - kPrefix - length, source);

  GuardRecord record;
  std::vector<at::Tensor> saved;
  struct State {
    std::size_t param;
    std::string type;
    std::int64_t step;
    std::map<std::string, at::Tensor> fields;
  };
  std::vector<State> states;
  std::string archive_bytes;
  at::Tensor cpu_rng;
  std::vector<at::Tensor> cuda_rng;
  try {
    const Json h = Json::parse(bytes.begin() + kPrefix,
                               bytes.begin() + static_cast<std::ptrdiff_t>(kPrefix + length));
    if (h.at("format").get<int>() != kDiskFormat) {
      throw CheckpointError(source + ": format " + h.at("format").dump() +
                            ", this stepguard reads " + std::to_string(kDiskFormat));
    }
    record.step = h.at("step").get<std::int64_t>();
    record.data_position = h.at("data_position").get<std::int64_t>();
    record.guard = h.at("guard").get<std::vector<std::int64_t>>();
    record.totals = h.at("totals").get<std::vector<std::int64_t>>();
    record.skipped_ranges = h.at("skipped_ranges").get<std::vector<std::int64_t>>();
    const Json& ps = h.at("params");
    if (ps.size() != params.size()) {
      throw CheckpointError(source + ": holds " + std::to_string(ps.size()) +
                            " parameters, the guard has " + std::to_string(params.size()));
    }
    for (std::size_t i = 0; i < params.size(); ++i) {
      at::Tensor t = data.view(ps[i], "parameter " + std::to_string(i));
      if (!t.defined() || t.sizes() != params[i].sizes() ||
          t.scalar_type() != params[i].scalar_type()) {
        std::ostringstream msg;
        msg << source << ": parameter " << i << " is "
            << (t.defined() ? c10::toString(t.scalar_type()) : "missing")
            << (t.defined() ? t.sizes() : at::IntArrayRef{}) << " in the checkpoint, "
            << params[i].scalar_type() << params[i].sizes() << " in the model";
        throw CheckpointError(msg.str());
      }
      saved.push_back(t);
    }
    const Json& opt = h.at("optimizer");
    if (opt.at("kind") == "typed") {
      for (const Json& s : opt.at("states")) {
        State st{s.at("param").get<std::size_t>(),
                 s.at("type").get<std::string>(),
                 s.at("step").get<std::int64_t>(),
                 {}};
        if (st.param >= params.size()) throw CheckpointError(source + ": state of no parameter");
        if (!optimizer_is(optimizer, st.type)) {
          throw CheckpointError(source + ": holds " + st.type +
                                " optimizer state, which this optimizer does not keep");
        }
        for (const auto& [name, entry] : s.at("fields").items()) {
          st.fields[name] = data.view(entry, "optimizer state " + name);
        }
        states.push_back(std::move(st));
      }
    } else {
      const auto offset = opt.at("offset").get<std::int64_t>();
      const auto size = opt.at("bytes").get<std::int64_t>();
      if (offset < 0 || size < 0 || static_cast<std::uint64_t>(offset + size) > data.size()) {
        throw CheckpointError(source + ": optimizer archive does not fit the file");
      }
      archive_bytes.assign(data.data() + offset, static_cast<std::size_t>(size));
    }
    cpu_rng = data.view(h.at("rng").at("cpu"), "rng").clone();
    const Json& cuda = h.at("rng").at("cuda");
    for (std::size_t d = 0; d < cuda.size() && static_cast<int>(d) < cuda_devices(); ++d) {
      cuda_rng.push_back(data.view(cuda[d], "rng").clone());
    }
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    throw CheckpointError(source + ": unreadable checkpoint header (" + e.what() + ")");
  }

  // Everything read and checked: now state changes.
  if (!archive_bytes.empty()) {
    try {
      torch::serialize::InputArchive archive;
      std::istringstream in(archive_bytes);
      archive.load_from(in);
      optimizer.load(archive);
    } catch (const std::exception& e) {
      std::string what = e.what();
      if (const auto nl = what.find('\n'); nl != std::string::npos) what.resize(nl);
      throw CheckpointError(source + ": the optimizer state does not fit this optimizer (" + what +
                            ")");
    }
  } else {
    auto& live = optimizer.state();
    live.clear();
    for (State& st : states) {
      const at::Tensor& p = params[st.param];
      for (auto& [name, t] : st.fields) {
        if (t.defined()) t = t.to(p.device(), /*non_blocking=*/false, /*copy=*/true);
      }
      live[state_key(p)] = make_state(st.type, st.step, st.fields);
    }
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
