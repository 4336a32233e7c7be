#include "tools/lib/safetensors_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <future>
#include <set>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/base/progress.h"

namespace moex {
namespace {

// The header as safetensors (Rust) serializes it: "__metadata__" first, then tensors in data order, each
// {"dtype","shape","data_offsets"} in that field order, no spaces; then spaces until the data starts at a
// multiple of `options.data_alignment` (8: the header's length a multiple of 8).
std::string shard_header(const std::vector<TensorToWrite>& tensors, const SafetensorsShardPlan& shard,
                         const std::string& checkpoint_id, const SafetensorsOptions& options) {
  std::string header = R"({"__metadata__":{"format":"pt")";
  if (!checkpoint_id.empty())
    header += "," + nlohmann::json(kCheckpointIdKey).dump() + ":" + nlohmann::json(checkpoint_id).dump();
  for (const auto& [key, value] : options.metadata) {  // appended piece by piece: g++ 12 warns (a false
    header += ',';                                       // -Wstringop-overflow) on "," + ... here
    header += nlohmann::json(key).dump();
    header += ':';
    header += nlohmann::json(value).dump();
  }
  header += '}';
  for (size_t i = 0; i < shard.tensors.size(); ++i) {
    const TensorToWrite& t = tensors[shard.tensors[i]];
    header += ',';
    header += nlohmann::json(t.name).dump();
    header += R"(:{"dtype":")";
    header += dtype_name(t.dtype);
    header += R"(","shape":[)";
    for (size_t d = 0; d < t.shape.size(); ++d) {
      if (d) header += ',';
      header += std::to_string(t.shape[d]);
    }
    header += R"(],"data_offsets":[)";
    header += std::to_string(shard.data_begin[i]) + "," + std::to_string(shard.data_begin[i] + t.num_bytes()) + "]}";
  }
  header += '}';
  const uint64_t align = options.data_alignment;
  header.append((align - (8 + header.size()) % align) % align, ' ');
  return header;
}

std::string shard_file_name(size_t index, size_t count) {
  if (count == 1) return "model.safetensors";
  char name[64];
  std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return name;
}

void write_all(int fd, const uint8_t* data, uint64_t size, const std::string& path) {
  while (size > 0) {
    const ssize_t written = ::write(fd, data, std::min<uint64_t>(size, 1ull << 30));
    if (written < 0 && errno == EINTR) continue;
    MOEX_CHECK_INPUT(written > 0, "cannot write ", path, ": ", std::strerror(errno));
    data += written;
    size -= static_cast<uint64_t>(written);
  }
}

// Creates `dir/name` as a new file: written under a temporary name, synced, then renamed over `name`.
class NewFile {
 public:
  NewFile(const std::string& dir, const std::string& name)
      : path_(dir + "/" + name), partial_(dir + "/." + name + ".partial") {
    fd_ = ::open(partial_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    MOEX_CHECK_INPUT(fd_ >= 0, "cannot create ", partial_, ": ", std::strerror(errno));
  }
  ~NewFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(partial_.c_str());
  }
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  void commit() {
    MOEX_CHECK_INPUT(::fsync(fd_) == 0, "cannot write ", path_, ": ", std::strerror(errno));
    const int closed = ::close(fd_);
    fd_ = -1;
    MOEX_CHECK_INPUT(closed == 0, "cannot write ", path_, ": ", std::strerror(errno));
    MOEX_CHECK_INPUT(::rename(partial_.c_str(), path_.c_str()) == 0, "cannot rename ", partial_, " to ", path_, ": ",
                     std::strerror(errno));
    committed_ = true;
  }

 private:
  std::string path_, partial_;
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace

int64_t TensorToWrite::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

uint64_t parse_byte_size(const std::string& text, const char* flag) {
  static const std::pair<const char*, uint64_t> kUnits[] = {
      {"TIB", 1ull << 40}, {"GIB", 1ull << 30}, {"MIB", 1ull << 20}, {"KIB", 1ull << 10},
      {"TB", 1000'000'000'000ull}, {"GB", 1000'000'000ull}, {"MB", 1000'000ull}, {"KB", 1000ull}, {"B", 1ull}};
  std::string upper;
  for (char c : text) upper += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  uint64_t unit = 1;
  std::string number = upper;
  for (const auto& [suffix, scale] : kUnits) {
    const size_t n = std::strlen(suffix);
    if (upper.size() > n && upper.compare(upper.size() - n, n, suffix) == 0) {
      number = upper.substr(0, upper.size() - n);
      unit = scale;
      break;
    }
  }
  double value = 0;
  size_t used = 0;
  try {
    value = std::stod(number, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  MOEX_CHECK_INPUT(!number.empty() && used == number.size() && value > 0 && std::isfinite(value) &&
                       value * static_cast<double>(unit) < 1.8e19,
                   flag, ": '", text, "' is not a size (expected bytes or e.g. 500MB, 2GB, 4GiB)");
  return static_cast<uint64_t>(value * static_cast<double>(unit));
}

SafetensorsPlan plan_safetensors(const std::vector<TensorToWrite>& tensors, uint64_t max_shard_size,
                                 const std::string& checkpoint_id, const SafetensorsOptions& options) {
  MOEX_CHECK(options.data_alignment >= 8 && options.data_alignment % 8 == 0, "data_alignment ", options.data_alignment);
  std::set<std::string> names;
  for (const auto& t : tensors) {
    MOEX_CHECK(names.insert(t.name).second, "duplicate tensor name ", t.name);
  }
  // Which tensors go in which shard: state-dict order, as transformers splits.
  std::vector<std::vector<size_t>> groups;
  std::vector<size_t> current;
  uint64_t current_size = 0;
  SafetensorsPlan plan;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t bytes = tensors[i].num_bytes();
    plan.total_size += bytes;
    if (bytes > max_shard_size) {
      groups.push_back({i});
      continue;
    }
    if (current_size + bytes > max_shard_size) {
      groups.push_back(std::move(current));
      current.clear();
      current_size = 0;
    }
    current.push_back(i);
    current_size += bytes;
  }
  if (!current.empty() || groups.empty()) groups.push_back(std::move(current));

  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t s = 0; s < groups.size(); ++s) {
    SafetensorsShardPlan shard;
    shard.file_name = shard_file_name(s, groups.size());
    shard.tensors = groups[s];
    std::sort(shard.tensors.begin(), shard.tensors.end(),
              [&](size_t a, size_t b) { return tensors[a].name < tensors[b].name; });
    uint64_t offset = 0;
    for (size_t index : shard.tensors) {
      shard.data_begin.push_back(offset);
      offset += tensors[index].num_bytes();
      weight_map[tensors[index].name] = shard.file_name;
    }
    shard.header = shard_header(tensors, shard, checkpoint_id, options);
    shard.file_size = 8 + shard.header.size() + offset;
    plan.shards.push_back(std::move(shard));
  }
  if (plan.shards.size() > 1) {
    // transformers: json.dumps(index, indent=2, sort_keys=True) + "\n"
    nlohmann::json index = {{"metadata", {{"total_size", plan.total_size}}}, {"weight_map", weight_map}};
    if (!checkpoint_id.empty()) index["metadata"][kCheckpointIdKey] = checkpoint_id;
    plan.index_json = index.dump(2) + "\n";
  }
  return plan;
}

void write_safetensors(const std::string& dir, const std::vector<TensorToWrite>& tensors,
                       const SafetensorsPlan& plan, const TensorFill& fill, uint64_t chunk_bytes,
                       const std::string& progress_what) {
  double total = 0;
  for (const SafetensorsShardPlan& shard : plan.shards)
    for (size_t index : shard.tensors) total += static_cast<double>(tensors[index].num_bytes());
  Progress progress(progress_what, total);
  // Two chunk buffers: the kernel copies one into the page cache (a background thread in write())
  // while `fill` generates the next; on a small VM the copy costs about as much as the generation.
  std::vector<uint8_t> chunks[2];
  std::future<void> pending;  // the write of the previous chunk
  for (const SafetensorsShardPlan& shard : plan.shards) {
    NewFile file(dir, shard.file_name);
    const int fd = file.fd();
    const std::string& path = file.path();
    try {
      uint8_t length[8];
      const uint64_t header_size = shard.header.size();
      for (int b = 0; b < 8; ++b) length[b] = static_cast<uint8_t>(header_size >> (8 * b));
      write_all(fd, length, 8, path);
      write_all(fd, reinterpret_cast<const uint8_t*>(shard.header.data()), header_size, path);
      int current = 0;
      for (size_t index : shard.tensors) {
        const TensorToWrite& t = tensors[index];
        const uint64_t element = dtype_size(t.dtype), bytes = t.num_bytes();
        const uint64_t step = std::max<uint64_t>(element, chunk_bytes / element * element);
        for (uint64_t begin = 0; begin < bytes; begin += step) {
          const uint64_t size = std::min(step, bytes - begin);
          std::vector<uint8_t>& chunk = chunks[current];
          if (chunk.size() < size) chunk.resize(size);
          fill(index, begin, chunk.data(), size);
          progress.add(static_cast<double>(size));
          if (pending.valid()) pending.get();  // rethrows a failed write
          pending = std::async(std::launch::async, [fd, &chunk, size, &path] { write_all(fd, chunk.data(), size, path); });
          current ^= 1;
        }
      }
      if (pending.valid()) pending.get();
    } catch (...) {
      if (pending.valid()) pending.wait();
      throw;
    }
    file.commit();
  }
  if (!plan.index_json.empty()) {
    NewFile file(dir, "model.safetensors.index.json");
    write_all(file.fd(), reinterpret_cast<const uint8_t*>(plan.index_json.data()), plan.index_json.size(), file.path());
    file.commit();
  }
}

}  // namespace moex
