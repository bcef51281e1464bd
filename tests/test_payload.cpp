// One rank's checkpoint payload: named tensors, opaque state bytes, RNG state and the guard's
// record round-trip exactly; bytes that do not fit (bad magic, another format, a truncated
// header, a tensor extent beyond the file, an absurd shape) are refused naming the source, and
// decoding changes nothing.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "csrc/checkpoint/payload.h"

namespace stepguard {
namespace checkpoint {
namespace {

std::string bytes_of_pieces(const Pieces& pieces) {
  std::string out;
  for (const auto& [data, size] : pieces.parts) out.append(static_cast<const char*>(data), size);
  return out;
}

std::string encoded_example() {
  GuardRecord r;
  r.step = 120;
  r.data_position = 133;
  r.guard = {1, -2, 3};
  r.totals = {120, 118, 1, 1, 0, 2, 3, 4};
  r.skipped_ranges = {50, 10};
  const std::vector<NamedTensor> tensors = {{"param.0", at::arange(6, at::kFloat).view({2, 3})},
                                            {"optimizer.0.unused", at::Tensor()},
                                            {"buffer.0", at::tensor({7, 8}, at::kLong)}};
  RngState rng;
  rng.cpu = at::arange(16, at::kByte);
  return bytes_of_pieces(
      encode_payload(r, tensors, std::string("opaque\0bytes", 12), rng).pieces());
}

TEST(Payload, RoundTripsEverythingExactly) {
  const DecodedPayload p = decode_payload(encoded_example(), "example");
  EXPECT_EQ(p.record.step, 120);
  EXPECT_EQ(p.record.data_position, 133);
  EXPECT_EQ(p.record.guard, std::vector<std::int64_t>({1, -2, 3}));
  EXPECT_EQ(p.record.totals, std::vector<std::int64_t>({120, 118, 1, 1, 0, 2, 3, 4}));
  EXPECT_EQ(p.record.skipped_ranges, std::vector<std::int64_t>({50, 10}));
  ASSERT_EQ(p.tensors.size(), 3u);
  EXPECT_EQ(p.tensors[0].name, "param.0");
  EXPECT_TRUE(at::equal(p.tensors[0].tensor, at::arange(6, at::kFloat).view({2, 3})));
  EXPECT_FALSE(p.tensors[1].tensor.defined());
  EXPECT_TRUE(at::equal(p.tensors[2].tensor, at::tensor({7, 8}, at::kLong)));
  EXPECT_EQ(p.opaque, std::string("opaque\0bytes", 12));  // binary bytes, NUL included
  EXPECT_TRUE(at::equal(p.rng.cpu, at::arange(16, at::kByte)));
}

std::string decode_error(const std::string& bytes) {
  try {
    decode_payload(bytes, "rank-7");
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "no error";
}

TEST(Payload, BytesThatDoNotFitAreRefusedNamingTheSource) {
  const std::string good = encoded_example();
  EXPECT_EQ(decode_error("short"), "rank-7: not a stepguard checkpoint (bad magic)");
  std::string bad_magic = good;
  bad_magic[0] = 'X';
  EXPECT_EQ(decode_error(bad_magic), "rank-7: not a stepguard checkpoint (bad magic)");
  EXPECT_EQ(decode_error(good.substr(0, 40)), "rank-7: header is truncated");
  // A tensor whose extent runs past the file, and one whose shape multiplies past any file.
  EXPECT_EQ(decode_error(good.substr(0, good.size() - 10)),
            "rank-7: the optimizer's state bytes do not fit the file");
  EXPECT_EQ(decode_error(good.substr(0, good.size() - 20)),
            "rank-7: rng: its bytes do not fit the file");
  std::string huge = good;
  const auto at = huge.find("[2,3]");
  ASSERT_NE(at, std::string::npos);
  huge.replace(at, 5, "[9,9]");  // same length: the header still parses
  EXPECT_EQ(decode_error(huge), "rank-7: param.0: its bytes do not fit the file");
  std::string format = good;
  const auto f = format.find("\"format\":2");
  ASSERT_NE(f, std::string::npos);
  format[f + 9] = '1';
  EXPECT_EQ(decode_error(format), "rank-7: payload format 1, this stepguard reads 2");
}

}  // namespace
}  // namespace checkpoint
}  // namespace stepguard
