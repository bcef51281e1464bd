#include "csrc/checkpoint/payload.h"

#include <cstring>
#include <nlohmann/json.hpp>

namespace stepguard {
namespace checkpoint {

namespace {

constexpr char kMagic[8] = {'S', 'G', 'C', 'K', 'P', 'T', '\0', '\1'};
constexpr std::size_t kPrefix = 16;  // magic + header length

using Json = nlohmann::json;

class Writer {
 public:
  // Describes `t` and queues its bytes; an undefined tensor is `null`.
  Json add(const at::Tensor& t, std::vector<at::Tensor>* keep) {
    if (!t.defined()) return nullptr;
    at::Tensor host = t.detach();
    host = host.device().is_cpu() ? host.contiguous() : host.to(at::kCPU).contiguous();
    const auto bytes = static_cast<std::int64_t>(host.nbytes());
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
    // Every number is bounded by the file's size before it is multiplied: nothing overflows.
    std::uint64_t numel = 1;
    for (std::int64_t d : shape) {
      if (d < 0) throw CheckpointError(source_ + ": " + what + ": negative dimension");
      if (d > 0 && numel > size_ / static_cast<std::uint64_t>(d))
        numel = size_ + 1;
      else
        numel *= static_cast<std::uint64_t>(d);
    }
    if (offset < 0 || bytes < 0 || static_cast<std::uint64_t>(offset) > size_ ||
        static_cast<std::uint64_t>(bytes) > size_ - static_cast<std::uint64_t>(offset) ||
        numel > size_ || numel * c10::elementSize(type) != static_cast<std::uint64_t>(bytes)) {
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

// Describes every tensor and queues its bytes in file order.
Json describe_tensors(const std::vector<NamedTensor>& tensors, Writer* w,
                      std::vector<at::Tensor>* keep) {
  Json out = Json::array();
  for (const auto& t : tensors) {
    Json entry = w->add(t.tensor, keep);
    if (entry.is_null()) entry = Json::object();
    entry["name"] = t.name;
    out.push_back(std::move(entry));
  }
  return out;
}

std::uint64_t read_length(const std::string& bytes) {
  std::uint64_t length = 0;
  for (int b = 0; b < 8; ++b) {
    length |= static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[8 + b])) << (8 * b);
  }
  return length;
}

// The tensors a header lists, as views into the data section.
std::vector<NamedTensor> read_tensors(const Json& list, const Reader& data) {
  std::vector<NamedTensor> out;
  for (const Json& entry : list) {
    const std::string name = entry.at("name").get<std::string>();
    const at::Tensor t = entry.contains("dtype") ? data.view(entry, name) : at::Tensor();
    out.push_back({name, t});
  }
  return out;
}

}  // namespace

EncodedPayload encode_payload(const GuardRecord& record, const std::vector<NamedTensor>& tensors,
                              const std::string& opaque, const RngState& rng) {
  EncodedPayload out;
  Writer w;
  Json header = {{"format", kPayloadFormat},
                 {"step", record.step},
                 {"data_position", record.data_position},
                 {"guard", record.guard},
                 {"totals", record.totals},
                 {"skipped_ranges", record.skipped_ranges}};
  header["tensors"] = describe_tensors(tensors, &w, &out.tensors_);
  Json cuda = Json::array();
  for (const auto& state : rng.cuda) cuda.push_back(w.add(state, &out.tensors_));
  header["rng"] = {{"cpu", w.add(rng.cpu, &out.tensors_)}, {"cuda", cuda}};
  out.opaque_ = opaque;
  header["opaque"] = {{"offset", w.offset()},
                      {"bytes", static_cast<std::int64_t>(out.opaque_.size())}};
  w.skip(static_cast<std::int64_t>(out.opaque_.size()));

  const std::string text = header.dump();
  out.prefix_.assign(kMagic, sizeof kMagic);
  const std::uint64_t length = text.size();
  for (int b = 0; b < 8; ++b) out.prefix_.push_back(static_cast<char>((length >> (8 * b)) & 0xff));
  out.prefix_ += text;
  // File order follows the offsets: the tensors, the RNG states, the opaque bytes.
  out.pieces_.add(out.prefix_.data(), out.prefix_.size());
  for (const at::Tensor& t : out.tensors_) out.pieces_.add(t.data_ptr(), t.nbytes());
  out.pieces_.add(out.opaque_.data(), out.opaque_.size());
  return out;
}

DecodedPayload decode_payload(std::string bytes, const std::string& source) {
  if (bytes.size() < kPrefix || std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0) {
    throw CheckpointError(source + ": not a stepguard checkpoint (bad magic)");
  }
  const std::uint64_t length = read_length(bytes);
  if (length > bytes.size() - kPrefix) throw CheckpointError(source + ": header is truncated");
  DecodedPayload out;
  out.bytes = std::make_shared<const std::string>(std::move(bytes));
  const std::string& b = *out.bytes;
  const Reader data(b.data() + kPrefix + length, b.size() - kPrefix - length, source);
  try {
    const Json h =
        Json::parse(b.begin() + kPrefix, b.begin() + static_cast<std::ptrdiff_t>(kPrefix + length));
    if (h.at("format").get<int>() != kPayloadFormat) {
      throw CheckpointError(source + ": payload format " + h.at("format").dump() +
                            ", this stepguard reads " + std::to_string(kPayloadFormat));
    }
    GuardRecord& r = out.record;
    r.step = h.at("step").get<std::int64_t>();
    r.data_position = h.at("data_position").get<std::int64_t>();
    r.guard = h.at("guard").get<std::vector<std::int64_t>>();
    r.totals = h.at("totals").get<std::vector<std::int64_t>>();
    r.skipped_ranges = h.at("skipped_ranges").get<std::vector<std::int64_t>>();
    out.tensors = read_tensors(h.at("tensors"), data);
    out.rng.cpu = data.view(h.at("rng").at("cpu"), "rng");
    if (!out.rng.cpu.defined()) throw CheckpointError(source + ": holds no CPU RNG state");
    for (const Json& d : h.at("rng").at("cuda")) out.rng.cuda.push_back(data.view(d, "rng"));
    const auto offset = h.at("opaque").at("offset").get<std::int64_t>();
    const auto size = h.at("opaque").at("bytes").get<std::int64_t>();
    if (offset < 0 || size < 0 || static_cast<std::uint64_t>(offset) > data.size() ||
        static_cast<std::uint64_t>(size) > data.size() - static_cast<std::uint64_t>(offset)) {
      throw CheckpointError(source + ": the optimizer's state bytes do not fit the file");
    }
    out.opaque.assign(data.data() + offset, static_cast<std::size_t>(size));
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    throw CheckpointError(source + ": unreadable checkpoint header (" + e.what() + ")");
  }
  return out;
}

}  // namespace checkpoint
}  // namespace stepguard
