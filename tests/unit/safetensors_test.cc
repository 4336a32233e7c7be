// The safetensors reader on well-formed files and on thousands of corrupted ones: every corruption is
// either accepted (it did not break the format) or rejected with moex::Error, never a crash (CI runs
// this under AddressSanitizer and UBSan).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/model/safetensors.h"

namespace moex {
namespace {

// A small valid image: two BF16 tensors and one F32 tensor, header padded to 8 bytes like HF's.
std::vector<uint8_t> make_image() {
  nlohmann::json header = {
      {"__metadata__", {{"format", "pt"}}},
      {"a", {{"dtype", "BF16"}, {"shape", {2, 3}}, {"data_offsets", {0, 12}}}},
      {"b", {{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {12, 28}}}},
      {"c", {{"dtype", "BF16"}, {"shape", {1}}, {"data_offsets", {28, 30}}}}};
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::vector<uint8_t> image(8 + text.size() + 30);
  uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) image[i] = static_cast<uint8_t>(len >> (8 * i));
  std::copy(text.begin(), text.end(), image.begin() + 8);
  for (size_t i = 0; i < 30; ++i) image[8 + text.size() + i] = static_cast<uint8_t>(i);
  return image;
}

TEST(Safetensors, ParsesAValidImage) {
  const std::vector<uint8_t> image = make_image();
  const auto tensors = SafetensorsFile::parse(image.data(), image.size(), "test");
  ASSERT_EQ(tensors.size(), 3u);
  EXPECT_EQ(tensors.at("a").shape, (Shape{2, 3}));
  EXPECT_EQ(tensors.at("a").dtype, DType::kBF16);
  EXPECT_EQ(tensors.at("b").dtype, DType::kF32);
  EXPECT_EQ(static_cast<const uint8_t*>(tensors.at("b").data)[0], 12);  // offsets are relative to the data
}

bool parse_is_clean(const std::vector<uint8_t>& image) {
  try {
    SafetensorsFile::parse(image.data(), image.size(), "mutant");
    return true;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    EXPECT_NE(std::string(e.what()).find("mutant"), std::string::npos) << "message must name the file";
    return false;
  }
}

TEST(Safetensors, EveryTruncationIsRejected) {
  const std::vector<uint8_t> image = make_image();
  for (size_t len = 0; len < image.size(); ++len) {
    std::vector<uint8_t> cut(image.begin(), image.begin() + len);
    EXPECT_FALSE(parse_is_clean(cut)) << "truncated to " << len << " bytes";
  }
}

TEST(Safetensors, RandomByteMutationsNeverCrash) {
  const std::vector<uint8_t> image = make_image();
  std::mt19937 rng(1234);
  int rejected = 0;
  for (int trial = 0; trial < 5000; ++trial) {
    std::vector<uint8_t> mutant = image;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) {
      const size_t at = rng() % (trial % 3 == 0 ? 8 : mutant.size());  // a third of them hit the length field
      mutant[at] = static_cast<uint8_t>(rng());
    }
    rejected += parse_is_clean(mutant) ? 0 : 1;
  }
  EXPECT_GT(rejected, 1000);  // most mutations break the header; the rest must still parse consistently
}

TEST(Safetensors, SemanticCorruptionsAreRejectedWithTheirCause) {
  const auto with_header = [](const std::string& header_text, size_t data_bytes) {
    std::vector<uint8_t> image(8 + header_text.size() + data_bytes);
    for (int i = 0; i < 8; ++i) image[i] = static_cast<uint8_t>(static_cast<uint64_t>(header_text.size()) >> (8 * i));
    std::copy(header_text.begin(), header_text.end(), image.begin() + 8);
    return image;
  };
  const struct {
    const char* header;
    const char* cause;
  } cases[] = {
      {R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,8]}})", "need"},
      {R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[4,0]}})", "outside"},
      {R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,64]}})", "outside"},
      {R"({"a":{"dtype":"Z9","shape":[2],"data_offsets":[0,4]}})", "dtype"},
      {R"({"a":{"dtype":"BF16","shape":[-2],"data_offsets":[0,4]}})", "shape"},
      {R"({"a":{"dtype":"BF16","shape":[1,1,1,1,1],"data_offsets":[0,2]}})", "shape"},
      {R"({"a":{"dtype":"BF16","shape":[2]}})", "lacks"},
      {R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},"b":{"dtype":"BF16","shape":[2],"data_offsets":[2,6]}})",
       "overlap"},
      {R"([1,2,3])", "not a JSON object"},
      {R"({"a":)", "JSON"},
      {R"({"a":{"dtype":"BF16","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", "large"},
  };
  for (const auto& c : cases) {
    const std::vector<uint8_t> image = with_header(c.header, 16);
    try {
      SafetensorsFile::parse(image.data(), image.size(), "case");
      ADD_FAILURE() << "accepted: " << c.header;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(c.cause), std::string::npos) << e.what();
    }
  }
}

TEST(Safetensors, MissingFileNamesThePath) {
  try {
    SafetensorsFile file("/nonexistent/model.safetensors");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/model.safetensors"), std::string::npos);
  }
}

}  // namespace
}  // namespace moex
