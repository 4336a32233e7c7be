#include "moex/base/system_memory.h"

#include <sys/mman.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <vector>

#include "moex/base/error.h"
#include "moex/base/small_file.h"

namespace moex {
namespace {

constexpr size_t kMaxProcFileBytes = size_t{1} << 20;

std::optional<std::string> read_optional(const std::string& path) {
  try {
    return read_small_file(path, kMaxProcFileBytes);
  } catch (const Error&) {
    return std::nullopt;
  }
}

std::optional<uint64_t> parse_u64(std::string_view text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.remove_suffix(1);
  uint64_t value = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || ptr != text.data() + text.size() || text.empty()) return std::nullopt;
  return value;
}

// The value of `key` in a "key value" file (memory.stat), or 0.
uint64_t stat_value(std::string_view stat, std::string_view key) {
  size_t pos = 0;
  while (pos < stat.size()) {
    const size_t end = std::min(stat.find('\n', pos), stat.size());
    const std::string_view line = stat.substr(pos, end - pos);
    if (line.size() > key.size() && line.substr(0, key.size()) == key && line[key.size()] == ' ')
      return parse_u64(line.substr(key.size() + 1)).value_or(0);
    pos = end + 1;
  }
  return 0;
}

// The cgroup directories that may limit this process, innermost first: its own cgroup and each parent, under
// the v2 mount and the v1 memory controller's mount. A cgroup namespace shows the process at "/", which
// leaves only the mount's root.
struct CgroupDir {
  std::string dir;
  bool v2;
};
std::vector<CgroupDir> cgroup_dirs() {
  std::vector<CgroupDir> dirs;
  const std::optional<std::string> self = read_optional("/proc/self/cgroup");
  if (!self) return dirs;
  size_t pos = 0;
  while (pos < self->size()) {
    const size_t end = std::min(self->find('\n', pos), self->size());
    const std::string line = self->substr(pos, end - pos);
    pos = end + 1;
    const size_t c1 = line.find(':'), c2 = c1 == std::string::npos ? c1 : line.find(':', c1 + 1);
    if (c2 == std::string::npos) continue;
    const std::string controllers = line.substr(c1 + 1, c2 - c1 - 1);
    std::string path = line.substr(c2 + 1);
    const bool v2 = line.compare(0, c1, "0") == 0 && controllers.empty();
    const bool v1_memory = ("," + controllers + ",").find(",memory,") != std::string::npos;
    if (!v2 && !v1_memory) continue;
    const std::string mount = v2 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory";
    while (true) {
      dirs.push_back({mount + (path == "/" ? "" : path), v2});
      if (path.empty() || path == "/") break;
      const size_t slash = path.rfind('/');
      path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
    }
  }
  return dirs;
}

}  // namespace

std::optional<uint64_t> parse_meminfo_available(std::string_view meminfo) {
  const std::string_view key = "MemAvailable:";
  const size_t at = meminfo.find(key);
  if (at == std::string_view::npos) return std::nullopt;
  std::string_view rest = meminfo.substr(at + key.size());
  rest = rest.substr(0, rest.find('\n'));
  while (!rest.empty() && rest.front() == ' ') rest.remove_prefix(1);
  const size_t space = rest.find(' ');
  const std::optional<uint64_t> kb = parse_u64(rest.substr(0, space));
  if (!kb || space == std::string_view::npos || rest.substr(space + 1) != "kB") return std::nullopt;
  return *kb * 1024;
}

std::optional<uint64_t> parse_cgroup_limit(std::string_view text) {
  const std::optional<uint64_t> value = parse_u64(text);
  if (!value || *value >= (uint64_t{1} << 62)) return std::nullopt;  // "max", or v1's 0x7ffffffffffff000
  return value;
}

uint64_t cgroup_headroom(uint64_t limit, uint64_t usage, uint64_t inactive_file) {
  const uint64_t working_set = usage > inactive_file ? usage - inactive_file : 0;
  return limit > working_set ? limit - working_set : 0;
}

std::optional<AvailableMemory> available_memory() {
  const std::optional<std::string> meminfo = read_optional("/proc/meminfo");
  const std::optional<uint64_t> mem_available = meminfo ? parse_meminfo_available(*meminfo) : std::nullopt;
  if (!mem_available) return std::nullopt;
  AvailableMemory out{*mem_available, "MemAvailable in /proc/meminfo"};
  for (const CgroupDir& c : cgroup_dirs()) {
    const std::string limit_file = c.dir + (c.v2 ? "/memory.max" : "/memory.limit_in_bytes");
    const std::optional<std::string> limit_text = read_optional(limit_file);
    const std::optional<uint64_t> limit = limit_text ? parse_cgroup_limit(*limit_text) : std::nullopt;
    if (!limit) continue;
    const std::optional<std::string> usage_text =
        read_optional(c.dir + (c.v2 ? "/memory.current" : "/memory.usage_in_bytes"));
    const std::optional<uint64_t> usage = usage_text ? parse_u64(*usage_text) : std::nullopt;
    if (!usage) continue;
    const std::optional<std::string> stat = read_optional(c.dir + "/memory.stat");
    const uint64_t inactive = stat ? stat_value(*stat, c.v2 ? "inactive_file" : "total_inactive_file") : 0;
    const uint64_t headroom = cgroup_headroom(*limit, *usage, inactive);
    if (headroom < out.bytes) out = {headroom, "the cgroup limit in " + limit_file};
  }
  return out;
}

void check_fits_in_memory(double bytes, const std::string& what, const std::string& fix) {
  const std::optional<AvailableMemory> available = available_memory();
  if (!available || bytes <= static_cast<double>(available->bytes)) return;
  throw_error(ErrorKind::kInvalidInput, what + " needs " + format_bytes(bytes) + ", " +
                                            format_bytes(static_cast<double>(available->bytes)) + " available (" +
                                            available->source + "); " + fix);
}

std::string format_bytes(double bytes) {
  char text[64];
  if (bytes >= 1e8)
    std::snprintf(text, sizeof text, "%.1f GB", bytes / 1e9);
  else
    std::snprintf(text, sizeof text, "%.1f MB", bytes / 1e6);
  return text;
}

void advise_huge_pages(void* p, size_t bytes) {
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

}  // namespace moex
