// A read-only memory mapping of a whole file: weights are used from the mapping, never copied.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace moex {

class MappedFile {
 public:
  MappedFile() = default;
  explicit MappedFile(const std::string& path);  // throws Error(kInvalidInput) naming the file
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  // Maps [data, data + bytes) into the page tables now, so the first forward pass measures compute,
  // not page faults. Only the ranges a process uses are touched: a rank holding 1/N of the experts
  // keeps 1/N of the file resident.
  static void prefault(const void* data, size_t bytes);
  // Drops the whole pages inside [data, data + bytes) from this process (the page cache keeps them).
  static void release(const void* data, size_t bytes);
  // Asks for this mapping's pages to be read into 2 MB page-cache folios, mapped with one TLB entry each
  // (madvise MADV_HUGEPAGE; a hint). Only pages not yet cached are affected: a file just written sits in the
  // cache in the writes' smaller folios, which drop_cache() evicts. Call before prefault().
  void advise_huge_pages() const;
  // Evicts `path`'s clean pages from the page cache (posix_fadvise DONTNEED; a hint, errors ignored).
  static void drop_cache(const std::string& path);
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // The file as the kernel knew it when it was mapped: "device:inode:size:mtime". Two mappings made under
  // one running kernel with the same identity map one file, so they hold the same bytes. Empty when fstat
  // failed.
  const std::string& identity() const { return identity_; }

 private:
  std::string path_;
  std::string identity_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace moex
