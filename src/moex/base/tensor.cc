#include "moex/base/tensor.h"

#include "moex/base/error.h"

namespace moex {

std::string Shape::str() const {
  std::string out = "[";
  for (int i = 0; i < rank; ++i) {
    if (i) out += ", ";
    out += std::to_string(dims[i]);
  }
  return out + "]";
}

TensorView TensorView::row(int64_t i) const {
  MOEX_CHECK(shape.rank >= 2 && i >= 0 && i < shape[0] && row_stride == 0);
  TensorView out;
  out.dtype = dtype;
  out.shape.rank = shape.rank - 1;
  for (int d = 1; d < shape.rank; ++d) out.shape.dims[d - 1] = shape.dims[d];
  out.data = static_cast<char*>(data) + static_cast<size_t>(i) * out.bytes();
  return out;
}

TensorView TensorView::rows(int64_t begin, int64_t end) const {
  MOEX_CHECK(shape.rank == 2 && 0 <= begin && begin <= end && end <= shape[0]);
  TensorView out = *this;
  out.shape.dims[0] = end - begin;
  out.data = static_cast<char*>(data) + static_cast<size_t>(begin * stride0()) * dtype_size(dtype);
  return out;
}

TensorView TensorView::columns(int64_t begin, int64_t end) const {
  MOEX_CHECK(shape.rank == 2 && 0 <= begin && begin <= end && end <= shape[1]);
  TensorView out = *this;
  out.row_stride = stride0();
  out.shape.dims[1] = end - begin;
  out.data = static_cast<char*>(data) + static_cast<size_t>(begin) * dtype_size(dtype);
  return out;
}

}  // namespace moex
