// Writes panels.moex (model/panels_file.h) for a checkpoint: every matrix a load of it packs, packed by the same
// functions (stored_panels for a quantized checkpoint; bf16_panels, what --weights auto packs, for a bf16/f16/f32
// one), one matrix at a time (memory: one packed matrix), so that a load maps the file instead of packing. Used
// by `moex quantize` (into its staged output) and `moex pack`.
#pragma once
#include <cstdint>
#include <string>

namespace moex {

struct PanelsWritten {
  uint64_t bytes = 0;  // the file's size
  size_t matrices = 0;
};

// `dir` holds the checkpoint (config.json, its safetensors); the file is `out`, or `dir`/panels.moex when empty.
// It is staged beside that path and renamed over it (tools/lib/output_dir.h: an existing one is replaced by a
// new inode), evicted from the page cache so that the first load reads it in 2 MB folios. Throws
// Error(kInvalidInput) naming the problem (nothing stored quantized, a file that cannot be written).
PanelsWritten write_panels(const std::string& dir, const std::string& out = "");

}  // namespace moex
