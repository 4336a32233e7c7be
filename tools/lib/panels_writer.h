// Writes panels.moex (model/panels_file.h) beside a quantized checkpoint: every matrix a load of it packs,
// packed by the same functions (stored_panels), one matrix at a time (memory: one packed matrix), so that a
// load maps the file instead of packing. Used by `moex quantize` (into its staged output) and `moex pack`
// (beside a quantized checkpoint from elsewhere).
#pragma once
#include <cstdint>
#include <string>

namespace moex {

struct PanelsWritten {
  uint64_t bytes = 0;  // the file's size
  size_t matrices = 0;
};

// `dir` holds a quantized checkpoint (config.json with a quantization_config, its safetensors). The file is
// staged beside panels.moex and renamed over it (tools/lib/output_dir.h: an existing one is replaced by a new
// inode), evicted from the page cache so that the first load reads it in 2 MB folios. Throws Error(kInvalidInput)
// naming the problem (not quantized, nothing stored quantized, a file that cannot be written).
PanelsWritten write_panels(const std::string& dir);

}  // namespace moex
