// NumPy .npy (format 1.0) writer for float32 arrays: how `moex logits` hands results to other engines.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moex {

void write_npy_f32(const std::string& path, const float* data, const std::vector<int64_t>& shape);

}  // namespace moex
