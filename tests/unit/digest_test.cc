#include "moex/base/digest.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <random>
#include <span>
#include <vector>

#include "moex/base/mapped_file.h"
#include "moex/base/threads.h"

namespace moex {
namespace {

using Ranges = std::vector<std::span<const uint8_t>>;

std::vector<uint64_t> digests(const Ranges& ranges, bool release_mapped_pages = false) {
  RangeDigests d(ranges);
  d.hash(0, 1, release_mapped_pages);
  return d.range_digests();
}

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(n);
  for (uint8_t& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

// Ranges of several pieces, of one piece, of a few bytes and of none, back to back in `bytes`; the first
// ends one byte past a piece boundary, so its last piece is a single byte.
Ranges ranges_in(const std::vector<uint8_t>& bytes) {
  const uint8_t* p = bytes.data();
  const size_t many = 2 * kDigestPieceBytes + 1, one = kDigestPieceBytes - 5, few = 7;
  return {{p, many}, {p + many, one}, {p + many + one, few}, {p + many + one + few, size_t{0}},
          {p + many + one + few, bytes.size() - many - one - few}};
}

class ThreadCount {  // sets the thread count for one test, and the default back after it
 public:
  explicit ThreadCount(int n) { set_num_threads(n); }
  ~ThreadCount() { set_num_threads(0); }
};

// Ranks of one job may run different --threads: a digest must not depend on how the pieces were shared out.
TEST(Digest, IsTheSameWhateverTheThreadCount) {
  const std::vector<uint8_t> bytes = random_bytes(3 * kDigestPieceBytes + 4096, 1);
  std::vector<uint64_t> one, three;
  {
    ThreadCount threads(1);
    one = digests(ranges_in(bytes));
  }
  {
    ThreadCount threads(3);
    three = digests(ranges_in(bytes));
  }
  EXPECT_EQ(one, three);
}

// Ranks that map the same files share the hashing out: each hashes only its own pieces, and the pieces put
// together give the digests one process would have computed alone.
TEST(Digest, SharesHashedApartAndPutTogetherGiveTheWholeDigests) {
  const std::vector<uint8_t> bytes = random_bytes(3 * kDigestPieceBytes + 4096, 5);
  constexpr size_t kParts = 3;
  RangeDigests whole(ranges_in(bytes)), merged(ranges_in(bytes));
  whole.hash();
  ASSERT_GT(whole.pieces(), kParts);
  for (size_t part = 0; part < kParts; ++part) {
    RangeDigests share(ranges_in(bytes));
    share.hash(part, kParts);
    for (size_t p = 0; p < share.pieces(); ++p) {
      if (p % kParts == part) merged.piece_digests()[p] = share.piece_digests()[p];
      else EXPECT_EQ(share.piece_digests()[p], 0u) << "part " << part << " hashed piece " << p;
    }
  }
  EXPECT_EQ(merged.range_digests(), whole.range_digests());
}

// One byte changed anywhere (first piece, a middle piece, the short last piece, a tiny range) changes that
// range's digest and no other's.
TEST(Digest, EveryByteCountsInItsOwnRangeOnly) {
  std::vector<uint8_t> bytes = random_bytes(3 * kDigestPieceBytes + 4096, 2);
  const std::vector<uint64_t> before = digests(ranges_in(bytes));
  const size_t many = 2 * kDigestPieceBytes + 1, one = kDigestPieceBytes - 5;
  const std::vector<std::pair<size_t, size_t>> flips = {
      {0, 0}, {kDigestPieceBytes + 17, 0}, {many - 1, 0}, {many, 1}, {many + one + 3, 2}, {bytes.size() - 1, 4}};
  for (const auto& [at, range] : flips) {
    bytes[at] ^= 0x40;
    const std::vector<uint64_t> after = digests(ranges_in(bytes));
    bytes[at] ^= 0x40;
    for (size_t r = 0; r < before.size(); ++r) {
      if (r == range) EXPECT_NE(after[r], before[r]) << "byte " << at << " of range " << r;
      else EXPECT_EQ(after[r], before[r]) << "byte " << at << ", range " << r;
    }
  }
}

// A digest is of the bytes, not of where they are; and the same bytes cut into ranges elsewhere (a byte moved
// from one tensor to the next) are other ranges.
TEST(Digest, DependsOnTheBytesAndTheBoundariesNotTheAddress) {
  const std::vector<uint8_t> bytes = random_bytes(kDigestPieceBytes + 100, 3);
  const std::vector<uint8_t> copy = bytes;
  const size_t cut = kDigestPieceBytes;
  const auto halves = [](const std::vector<uint8_t>& b, size_t at) {
    return digests({{b.data(), at}, {b.data() + at, b.size() - at}});
  };
  EXPECT_EQ(halves(bytes, cut), halves(copy, cut));
  const std::vector<uint64_t> moved = halves(bytes, cut + 1);
  EXPECT_NE(moved[0], halves(bytes, cut)[0]);
  EXPECT_NE(moved[1], halves(bytes, cut)[1]);
  // A zero byte appended is another range (the pieces' digests take their length).
  std::vector<uint8_t> longer = bytes;
  longer.push_back(0);
  EXPECT_NE(digests({{longer.data(), longer.size()}}), digests({{bytes.data(), bytes.size()}}));
}

// Hashing a file's mapping with release_mapped_pages drops the pages it read, yet the mapping still reads the
// file's bytes afterwards (they come back from the page cache) and the digest is that of the bytes.
TEST(Digest, ReleasingMappedPagesKeepsTheMappingValid) {
  const std::vector<uint8_t> bytes = random_bytes(2 * kDigestPieceBytes + 12345, 4);
  const std::string path =
      (std::filesystem::temp_directory_path() / ("moex_digest_test_" + std::to_string(::getpid()))).string();
  {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), f), bytes.size());
    std::fclose(f);
  }
  {
    const MappedFile file(path);
    const Ranges mapped = {{file.data(), 1000}, {file.data() + 1000, file.size() - 1000}};
    const Ranges heap = {{bytes.data(), 1000}, {bytes.data() + 1000, bytes.size() - 1000}};
    EXPECT_EQ(digests(mapped, true), digests(heap));
    EXPECT_EQ(std::vector<uint8_t>(file.data(), file.data() + file.size()), bytes);
  }
  std::filesystem::remove(path);
}

TEST(Digest, HexIsSixteenLowercaseDigits) {
  EXPECT_EQ(digest_hex(0xABCDEF0123456789ull), "abcdef0123456789");
  EXPECT_EQ(digest_hex(1), "0000000000000001");
}

}  // namespace
}  // namespace moex
