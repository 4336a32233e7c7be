#include "moex/base/digest.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "moex/base/error.h"
#include "moex/base/mapped_file.h"
#include "moex/base/threads.h"

namespace moex {

RangeDigests::RangeDigests(std::vector<std::span<const uint8_t>> ranges) : ranges_(std::move(ranges)) {
  for (const std::span<const uint8_t>& range : ranges_) {
    first_piece_.push_back(pieces_.size());
    for (size_t at = 0; at < range.size(); at += kDigestPieceBytes)
      pieces_.push_back({range.data() + at, std::min(kDigestPieceBytes, range.size() - at)});
  }
  piece_digests_.assign(pieces_.size(), 0);
}

void RangeDigests::hash(size_t part, size_t parts, bool release_mapped_pages) {
  MOEX_CHECK(part < parts, "RangeDigests::hash: part ", part, " of ", parts);
  const int64_t count = part < pieces_.size() ? static_cast<int64_t>((pieces_.size() - part + parts - 1) / parts) : 0;
  // Dynamic: pieces run from a few bytes (norms) to kDigestPieceBytes.
#pragma omp parallel for schedule(dynamic) num_threads(num_threads())
  for (int64_t i = 0; i < count; ++i) {
    const size_t p = part + static_cast<size_t>(i) * parts;
    piece_digests_[p] = XXH3_64bits(pieces_[p].data, pieces_[p].bytes);
    if (release_mapped_pages) MappedFile::release(pieces_[p].data, pieces_[p].bytes);
  }
}

std::vector<uint64_t> RangeDigests::range_digests() const {
  std::vector<uint64_t> out(ranges_.size());
  for (size_t r = 0; r < ranges_.size(); ++r) {
    const size_t count = (ranges_[r].size() + kDigestPieceBytes - 1) / kDigestPieceBytes;
    out[r] = XXH3_64bits(piece_digests_.data() + first_piece_[r], count * sizeof(uint64_t));
  }
  return out;
}

uint64_t digest_bytes(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

std::string digest_hex(uint64_t digest) {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(digest));
  return hex;
}

}  // namespace moex
