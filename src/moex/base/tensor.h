// TensorView: a non-owning, contiguous, row-major view (data, dtype, shape). Owning buffers are
// std::vector or the weight mapping; kernels only ever see views.
#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "moex/base/dtype.h"

namespace moex {

constexpr int kMaxRank = 4;

struct Shape {
  int rank = 0;
  std::array<int64_t, kMaxRank> dims{};

  Shape() = default;
  Shape(std::initializer_list<int64_t> list) {
    for (int64_t d : list) dims[rank++] = d;
  }
  int64_t operator[](int i) const { return dims[i]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < rank; ++i) n *= dims[i];
    return n;
  }
  bool operator==(const Shape& other) const {
    if (rank != other.rank) return false;
    for (int i = 0; i < rank; ++i)
      if (dims[i] != other.dims[i]) return false;
    return true;
  }
  std::string str() const;  // "[4096, 14336]"
};

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;
  // Elements between consecutive rows of a rank-2 view; 0 means contiguous (shape[1]). A column slice of
  // a weight (a TP rank's part of w2 or o_proj) is a strided view into the mapping, never a copy.
  int64_t row_stride = 0;
  int64_t stride0() const { return row_stride ? row_stride : shape[1]; }

  int64_t numel() const { return shape.numel(); }
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  template <typename T>
  T* as() const { return static_cast<T*>(data); }
  // Row i of a rank>=2 view, as a view of the remaining dims.
  TensorView row(int64_t i) const;
  // Rows [begin, end) of a rank-2 view / columns [begin, end) of a rank-2 view (strided).
  TensorView rows(int64_t begin, int64_t end) const;
  TensorView columns(int64_t begin, int64_t end) const;
};

}  // namespace moex
