// Digests of large byte ranges (a checkpoint's tensors), to tell whether two copies hold the same bytes.
// XXH3-64 from Debian's libxxhash: not cryptographic, which is not the point (the copies are the operator's
// own files, not an adversary's), and it hashes faster than memory delivers the bytes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace moex {

// A range is hashed in pieces of this many bytes (its last one shorter), and its digest is XXH3-64 of its
// pieces' XXH3-64 digests in order: the pieces spread over threads (and processes), and the digest does not
// depend on who computed which piece (ranks of one job may run different --threads).
inline constexpr size_t kDigestPieceBytes = size_t{8} << 20;

class RangeDigests {
 public:
  // The ranges are read by hash(), not here; they must stay valid until then. Pieces are numbered in the
  // order of the ranges, then within each: ranges given in file order (file, then offset) make every share
  // of them move through each file front to back, so a file not yet in the page cache is read ahead
  // sequentially; and processes that give ranges of the same sizes in the same order number alike.
  explicit RangeDigests(std::vector<std::span<const uint8_t>> ranges);

  size_t pieces() const { return pieces_.size(); }

  // Hashes the pieces p with p % parts == part (all of them by default) over num_threads() threads, into
  // piece_digests(). With `release_mapped_pages` the ranges lie in file mappings (MappedFile) that this
  // process does not need resident: each piece's whole pages are dropped again once hashed, so hashing a
  // checkpoint larger than the memory does not hold it resident (the page cache keeps what fits).
  void hash(size_t part = 0, size_t parts = 1, bool release_mapped_pages = false);

  // Piece p's digest (0 until hashed); another process's share can be written in.
  std::vector<uint64_t>& piece_digests() { return piece_digests_; }

  // One digest per range, in the order given: XXH3-64 of its pieces' digests.
  std::vector<uint64_t> range_digests() const;

 private:
  struct Piece {
    const uint8_t* data;
    size_t bytes;
  };
  std::vector<std::span<const uint8_t>> ranges_;
  std::vector<Piece> pieces_;
  std::vector<size_t> first_piece_;  // per range: its first piece (its pieces are consecutive)
  std::vector<uint64_t> piece_digests_;
};

// XXH3-64 of a few bytes, in one call.
uint64_t digest_bytes(const void* data, size_t bytes);

// 16 lowercase hex digits.
std::string digest_hex(uint64_t digest);

}  // namespace moex
