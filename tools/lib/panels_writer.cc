#include "tools/lib/panels_writer.h"

#include <cstring>
#include <filesystem>
#include <vector>

#include "moex/base/error.h"
#include "moex/base/mapped_file.h"
#include "moex/model/config.h"
#include "moex/model/panels_file.h"
#include "moex/model/safetensors.h"
#include "moex/model/weights.h"
#include "tools/lib/output_dir.h"
#include "tools/lib/safetensors_writer.h"

namespace moex {

PanelsWritten write_panels(const std::string& dir, const std::string& out) {
  namespace fs = std::filesystem;
  const ModelConfig config = load_model_config((fs::path(dir) / "config.json").string());
  const bool quantized = config.quantization.quantized();
  const WeightStore store(dir);
  const std::vector<PanelsToWrite> panels = quantized ? stored_panels(store, config) : bf16_panels(store, config);
  MOEX_CHECK_INPUT(!panels.empty(), dir, ": no module is stored quantized, nothing to pack");
  const PanelsKey key = quantized ? panels_key(store, config.quantization) : panels_key(store, kernels::WeightFormat::kBF16);
  std::vector<TensorToWrite> tensors;
  std::vector<std::pair<size_t, int>> parts;  // per tensor: (matrix, buffer)
  for (size_t i = 0; i < panels.size(); ++i) {
    for (int b = 0; b < kernels::PackedWeights::kBuffers; ++b) {
      if (!kernels::PackedWeights::has_buffer(panels[i].layout.format, b)) continue;
      const DType dtype = PanelsFile::buffer_dtype(b);
      tensors.push_back({panels[i].name + PanelsFile::buffer_suffix(b), dtype,
                         {static_cast<int64_t>(panels[i].layout.buffer(b).size / dtype_size(dtype))}});
      parts.emplace_back(i, b);
    }
  }
  SafetensorsOptions options;
  options.metadata[kPanelsLayoutKey] = std::to_string(kernels::kPackedLayoutVersion);
  options.metadata[kPanelsWeightsKey] = key.weights;
  options.metadata[kPanelsSourceKey] = key.source;
  options.data_alignment = kPageDataAlignment;
  SafetensorsPlan plan = plan_safetensors(tensors, UINT64_MAX, store.checkpoint_id(), options);
  MOEX_CHECK(plan.shards.size() == 1);
  size_t cached = SIZE_MAX;  // a matrix's buffers are adjacent in the file (names sorted): packed once
  kernels::PackedWeights packed;
  const fs::path target = out.empty() ? fs::path(default_panels_path(dir)) : fs::path(out);
  StagingFile staged(target, "panels");
  plan.shards[0].file_name = fs::path(staged.path()).filename().string();
  write_safetensors(fs::path(staged.path()).parent_path().string(), tensors, plan, [&](size_t index, uint64_t begin, uint8_t* dst, uint64_t size) {
    const auto [matrix, b] = parts[index];
    if (matrix != cached) {
      packed = panels[matrix].pack();
      cached = matrix;
    }
    const kernels::AlignedBytes& bytes = packed.buffer(b);
    MOEX_CHECK(begin + size <= bytes.size, tensors[index].name, " packs to ", bytes.size, " bytes");
    std::memcpy(dst, bytes.as<const uint8_t>() + begin, size);
  }, 64ull << 20, "packing panels.moex");
  // Out of the page cache: the first load reads it back in 2 MB folios (MappedFile::advise_huge_pages); the
  // writes left it in smaller ones.
  MappedFile::drop_cache(staged.path());
  staged.publish();
  return {plan.shards[0].file_size, panels.size()};
}

}  // namespace moex
