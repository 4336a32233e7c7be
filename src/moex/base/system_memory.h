// How much memory this process can still allocate: MemAvailable from /proc/meminfo, lowered to the
// headroom of the cgroup the process runs in (v2 memory.max, v1 memory.limit_in_bytes) when one is set.
// Commands compare what a run will allocate against it before allocating (a KV cache of 100M positions
// must be refused with the figures, not end in std::bad_alloc or the OOM killer).
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace moex {

struct AvailableMemory {
  uint64_t bytes = 0;
  std::string source;  // "MemAvailable in /proc/meminfo", or the cgroup limit that is lower
};

// nullopt when /proc/meminfo cannot be read (then nothing is checked).
std::optional<AvailableMemory> available_memory();

// The pieces, on file contents (tested on text; available_memory() reads the files):
// MemAvailable of /proc/meminfo, in bytes.
std::optional<uint64_t> parse_meminfo_available(std::string_view meminfo);
// A cgroup limit file (memory.max, memory.limit_in_bytes): nullopt for "max" or a value so large it means
// no limit (cgroup v1 writes 2^63 rounded down to a page).
std::optional<uint64_t> parse_cgroup_limit(std::string_view text);
// What a cgroup with this limit, usage and reclaimable page cache (memory.stat's inactive_file) can still
// take: limit - (usage - inactive_file), at least 0.
uint64_t cgroup_headroom(uint64_t limit, uint64_t usage, uint64_t inactive_file);

// Throws Error(kInvalidInput) "<what> needs 6.1 GB, 3.2 GB available (<source>); <fix>" when `bytes` is more
// than available_memory() (nothing is checked when that is unknown).
void check_fits_in_memory(double bytes, const std::string& what, const std::string& fix);

// Advises the whole 2 MB pages inside [p, p + bytes) for transparent huge pages; call it before the first
// touch. A hint: with THP off (or not built) madvise fails and the pages stay 4 KB.
void advise_huge_pages(void* p, size_t bytes);

// "6.1 GB": bytes in decimal gigabytes (MB below 0.1 GB), for messages.
std::string format_bytes(double bytes);

}  // namespace moex
