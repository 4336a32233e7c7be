#include "tools/moex/model_check.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <numeric>
#include <span>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "moex/base/digest.h"
#include "moex/base/error.h"
#include "moex/base/log.h"
#include "moex/base/mapped_file.h"
#include "moex/base/small_file.h"
#include "moex/base/threads.h"
#include "moex/comm/job.h"
#include "moex/model/gguf.h"
#include "moex/model/panels_file.h"
#include "moex/model/safetensors.h"
#include "moex/text/tokenizer.h"

namespace moex::tools {
namespace {

// The files a load of a model maps, and each tensor's bytes in them, named as the check names them.
struct ModelFiles {
  std::unique_ptr<GgufFile> gguf;           // a .gguf: its tensors as stored (what the load converts)
  std::unique_ptr<WeightStore> store;       // else the safetensors
  std::unique_ptr<SafetensorsFile> panels;  // and a quantized checkpoint's panels.moex, when the load maps it
  std::vector<const MappedFile*> files;
  std::vector<std::string> names;  // "tensor lm_head.weight", "panels.moex tensor ..."
  std::vector<std::span<const uint8_t>> bytes;
  std::vector<int> group;  // which add() call: the checkpoint's tensors, then panels.moex's

  // Adds tensors that lie in `files` in file order (the file, then the offset), so that hashing reads each
  // file front to back, and ranks that map the same files number the pieces alike (RangeDigests).
  void add(std::vector<std::pair<std::string, std::span<const uint8_t>>> tensors) {
    const auto file_of = [&](const uint8_t* p) {
      for (size_t f = 0; f < files.size(); ++f)
        if (p >= files[f]->data() && p < files[f]->data() + files[f]->size()) return f;
      return files.size();  // an empty tensor at the very end: nothing to read
    };
    std::stable_sort(tensors.begin(), tensors.end(), [&](const auto& a, const auto& b) {
      const size_t fa = file_of(a.second.data()), fb = file_of(b.second.data());
      return fa != fb ? fa < fb : a.second.data() < b.second.data();
    });
    const int call = group.empty() ? 0 : group.back() + 1;
    for (auto& [name, span] : tensors) {
      names.push_back(std::move(name));
      bytes.push_back(span);
      group.push_back(call);
    }
  }
};

std::span<const uint8_t> bytes_of(const TensorView& view) {
  return {static_cast<const uint8_t*>(view.data), view.bytes()};
}

std::string text_digest(const std::string& bytes) {
  char digest[64];
  std::snprintf(digest, sizeof(digest), "%zu bytes, hash %016zx", bytes.size(), std::hash<std::string>{}(bytes));
  return digest;
}

// What makes two model folders the same model for a multi-rank run, but for the weights' bytes: config.json
// as the engine reads it, the tensor infos (name, dtype, shape; with a panels.moex the load maps, its
// tensors' too) and the tokenizer, whose ids every rank computes for itself. Opens `files` for the bytes.
comm::Description describe_model(const std::string& model_dir, ModelFiles& files) {
  comm::Description out;
  if (is_gguf_path(model_dir)) {  // the metadata as the engine reads it, the tensor infos, the vocabulary
    files.gguf = std::make_unique<GgufFile>(model_dir);
    const GgufFile& file = *files.gguf;
    const nlohmann::json config = nlohmann::json::parse(model_config_to_json(gguf_model_config(file.contents(), model_dir)));
    for (const auto& [key, value] : config.items()) out.emplace_back("GGUF config " + key, value.dump());
    files.files = {&file.mapping()};
    std::vector<std::pair<std::string, std::span<const uint8_t>>> tensors;
    for (const GgufTensorInfo& t : file.contents().tensors) {
      std::string dims;
      for (uint64_t n : t.ne) dims += " " + std::to_string(n);
      out.emplace_back("tensor " + t.name, ggml_type_name(t.type) + dims);
      tensors.emplace_back("tensor " + t.name, std::span<const uint8_t>(t.data, t.bytes));
    }
    files.add(std::move(tensors));
    const GgufValue* kind = file.contents().find("tokenizer.ggml.model");
    const std::string vocab = kind && kind->type == GgufType::kString && kind->s == "gpt2"
                                  ? gguf_byte_level_tokenizer_json(file.contents(), model_dir)
                                  : gguf_sentencepiece_proto(file.contents(), model_dir);
    out.emplace_back("GGUF vocabulary", text_digest(vocab));
    return out;
  }
  const ModelConfig model_config = load_model_config(model_dir + "/config.json");
  const nlohmann::json config = nlohmann::json::parse(model_config_to_json(model_config));
  for (const auto& [key, value] : config.items()) out.emplace_back("config.json " + key, value.dump());
  files.store = std::make_unique<WeightStore>(model_dir);
  files.files = files.store->mappings();
  std::vector<std::pair<std::string, std::span<const uint8_t>>> tensors;
  for (const auto& [name, tensor] : files.store->tensors()) {
    out.emplace_back("tensor " + name, std::string(dtype_name(tensor.dtype)) + " " + tensor.shape.str());
    tensors.emplace_back("tensor " + name, bytes_of(tensor));
  }
  files.add(std::move(tensors));
  // As the load finds it (PanelsFile::open), beside a quantized checkpoint's files.
  const std::filesystem::path panels_path = std::filesystem::path(model_dir) / kPanelsFileName;
  std::error_code ec;
  if (model_config.quantization.quantized() && std::filesystem::exists(panels_path, ec)) {
    files.panels = std::make_unique<SafetensorsFile>(panels_path.string());
    files.files.push_back(&files.panels->mapping());
    std::vector<std::pair<std::string, std::span<const uint8_t>>> panels;
    for (const auto& [name, tensor] : files.panels->tensors()) {
      const std::string key = std::string(kPanelsFileName) + " tensor " + name;
      out.emplace_back(key, std::string(dtype_name(tensor.dtype)) + " " + tensor.shape.str());
      panels.emplace_back(key, bytes_of(tensor));
    }
    files.add(std::move(panels));
  }
  // The file Tokenizer reads (tokenizer.json, else tokenizer.model) and tokenizer_config.json (BOS / EOS).
  for (const std::string& tokenizer_path : {Tokenizer::file_in(model_dir), model_dir + "/tokenizer_config.json"}) {
    if (!is_regular_file(tokenizer_path)) continue;  // a missing or odd tokenizer is the tokenizer loader's error to give
    out.emplace_back(tokenizer_path.substr(model_dir.size() + 1),
                     text_digest(read_small_file(tokenizer_path, kMaxTokenizerFileBytes)));
  }
  return out;
}

// Equal on two ranks exactly when they map the same files under one running kernel (its boot id, then each
// file's device, inode, size and mtime): the same bytes, whatever the paths. 0 when that cannot be told,
// which is never taken as shared.
uint64_t copy_identity(const ModelFiles& files) {
  std::string text;
  try {
    text = read_small_file("/proc/sys/kernel/random/boot_id", 4096);
  } catch (const Error&) {
    return 0;
  }
  for (const MappedFile* file : files.files) {
    if (file->identity().empty()) return 0;
    text += "\n" + file->identity();
  }
  const uint64_t id = digest_bytes(text.data(), text.size());
  return id == 0 ? 1 : id;
}

}  // namespace

void check_same_model(comm::Communicator& comm, const std::string& model_dir) {
  // The cheap part first (headers and small files), which also says more about a difference.
  ModelFiles files;
  comm::check_same_on_all_ranks(comm, [&] { return describe_model(model_dir, files); });

  // Same shapes can still be other weights (another seed, fine-tune or quantization run), and under TP or EP
  // each rank computes with its own copy's share of each tensor, which no other rank reads: only the whole
  // checkpoint's bytes tell. Ranks that map the very same files (one machine, one path: the usual job) have
  // them already; the ranks that map one copy share out its hashing (rank j of k hashes every k-th piece) and
  // gather the pieces' digests, and the tensors' digests are then compared across copies.
  const uint64_t mine = copy_identity(files);
  std::vector<uint64_t> copies(comm.size());
  comm.allgather(&mine, sizeof mine, copies.data());
  if (mine != 0 && std::all_of(copies.begin(), copies.end(), [&](uint64_t c) { return c == copies[0]; })) {
    MOEX_LOG(kInfo, "every rank maps the same weight files: nothing to hash");
    return;
  }
  std::vector<int> sharers;  // the ranks that map this rank's copy, this rank among them
  for (int r = 0; r < comm.size(); ++r)
    if (r == comm.rank() || (mine != 0 && copies[r] == mine)) sharers.push_back(r);
  const size_t share = std::find(sharers.begin(), sharers.end(), comm.rank()) - sharers.begin();
  const auto start = std::chrono::steady_clock::now();
  RangeDigests digests(files.bytes);
  digests.hash(share, sharers.size(), /*release_mapped_pages=*/true);
  // As many pieces on every rank: the tensors' sizes agree (checked above).
  const size_t pieces = digests.pieces();
  std::vector<uint64_t> all(pieces * comm.size());
  comm.allgather(digests.piece_digests().data(), pieces * sizeof(uint64_t), all.data());
  for (size_t p = 0; p < pieces; ++p) digests.piece_digests()[p] = all[sharers[p % sharers.size()] * pieces + p];
  const std::vector<uint64_t> tensor_digests = digests.range_digests();
  size_t total = 0;
  for (const auto& range : files.bytes) total += range.size();
  MOEX_LOG(kInfo, "hashed 1/%zu of the weights (%.2f GB in all) to compare them across copies: %.3f s on %d threads",
           sharers.size(), total / 1e9,
           std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), num_threads());
  // By name (the checkpoint's tensors, then panels.moex's): the same tensors in other files or in another
  // order are the same model, and the difference named is the first by name.
  std::vector<size_t> by_name(files.names.size());
  std::iota(by_name.begin(), by_name.end(), size_t{0});
  std::sort(by_name.begin(), by_name.end(), [&](size_t a, size_t b) {
    return std::tie(files.group[a], files.names[a]) < std::tie(files.group[b], files.names[b]);
  });
  comm::check_same_on_all_ranks(comm, [&] {
    comm::Description out;
    for (size_t i : by_name) out.emplace_back(files.names[i] + " content", "XXH3 " + digest_hex(tensor_digests[i]));
    return out;
  });
}

}  // namespace moex::tools
