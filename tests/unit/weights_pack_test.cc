// model/weights.h's pack_bf16_direct (what a load with --weights bf16 or auto runs) gives the bytes of
// kernels::pack(quantize_bf16(w)) and pack_gate_up, the kernels' own packer, on ragged shapes: bf16 and f32
// sources, strided rows, partial panels and an odd K (padding lanes and padded k zero).
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "moex/base/dtype.h"
#include "moex/kernels/packed.h"
#include "moex/model/weights.h"
#include "test_util.h"

namespace moex {
namespace {

void expect_same_panels(const kernels::PackedWeights& a, const kernels::PackedWeights& b) {
  ASSERT_EQ(a.format, b.format);
  ASSERT_EQ(a.rows, b.rows);
  ASSERT_EQ(a.cols, b.cols);
  ASSERT_EQ(a.gate_up, b.gate_up);
  ASSERT_EQ(a.panels, b.panels);
  ASSERT_EQ(a.k_padded, b.k_padded);
  ASSERT_EQ(a.data.size, b.data.size);
  EXPECT_EQ(std::memcmp(a.data.ptr.get(), b.data.ptr.get(), a.data.size), 0);
}

TEST(WeightsPackDirect, Bf16PanelsEqualTheKernelsPackerOnRaggedShapes) {
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{64, 32}, {70, 33}, {1, 1}, {129, 100}, {31, 64}, {200, 7}}) {
    for (const DType dtype : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(testing::Message() << rows << "x" << cols << " " << dtype_name(dtype));
      // Rows of stride cols + 3: the strided row slices a load packs under tensor parallelism.
      const int64_t stride = cols + 3;
      const std::vector<float> f1 = test::random_floats(rows * stride, 1), f3 = test::random_floats(rows * stride, 2);
      std::vector<uint16_t> b1(f1.size()), b3(f3.size());
      for (size_t i = 0; i < f1.size(); ++i) b1[i] = f32_to_bf16(f1[i]), b3[i] = f32_to_bf16(f3[i]);
      const auto view = [&](const std::vector<float>& f, std::vector<uint16_t>& b) {
        TensorView v{dtype == DType::kF32 ? const_cast<float*>(f.data()) : static_cast<void*>(b.data()), dtype,
                     Shape{rows, cols}};
        v.row_stride = stride;
        return v;
      };
      const TensorView w1 = view(f1, b1), w3 = view(f3, b3);
      expect_same_panels(pack_bf16_direct(w1), kernels::pack(kernels::quantize_bf16(w1)));
      expect_same_panels(pack_bf16_direct(w1, &w3),
                         kernels::pack_gate_up(kernels::quantize_bf16(w1), kernels::quantize_bf16(w3)));
    }
  }
}

}  // namespace
}  // namespace moex
