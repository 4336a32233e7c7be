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
  MOEX_CHECK(shape.rank >= 2 && i >= 0 && i < shape[0]);
  TensorView out;
  out.dtype = dtype;
  out.shape.rank = shape.rank - 1;
  for (int d = 1; d < shape.rank; ++d) out.shape.dims[d - 1] = shape.dims[d];
  out.data = static_cast<char*>(data) + static_cast<size_t>(i) * out.bytes();
  return out;
}

}  // namespace moex
