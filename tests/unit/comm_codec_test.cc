// Single-process tests of comm: the fp8 block codec, wire sizes, algorithm-name parsing, the tuning table
// and the cost model. Multi-rank behaviour is in tests/mpi.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "moex/base/dtype.h"
#include "moex/base/error.h"
#include "moex/comm/codec.h"
#include "moex/comm/communicator.h"
#include "moex/comm/measure.h"
#include "moex/comm/selector.h"

namespace moex::comm {
namespace {

TEST(CommCodec, Fp8MatchesScalarConversionAndIsIdempotent) {
  std::vector<float> values(1000);
  for (size_t i = 0; i < values.size(); ++i) values[i] = std::sin(0.37f * i) * (1 + i % 13) * 0.01f;
  values[5] = 0.0f;
  values[6] = -1e-12f;  // underflows to zero within its block
  std::vector<float> scales(8), decoded(values.size()), again(values.size());
  std::vector<uint8_t> codes(values.size()), codes2(values.size());
  f8_block_encode(values.data(), values.size(), scales.data(), codes.data());
  for (size_t i = 0; i < values.size(); ++i) {
    const float scale = scales[i / kF8BlockElems];
    EXPECT_EQ(std::log2(scale), std::round(std::log2(scale))) << "scales are powers of two";
    EXPECT_EQ(codes[i], f32_to_f8e4m3(values[i] / scale)) << i;  // same rounding as base's scalar codec
  }
  f8_block_decode(scales.data(), codes.data(), values.size(), decoded.data());
  for (size_t i = 0; i < values.size(); ++i) {
    const float scale = scales[i / kF8BlockElems];
    EXPECT_LE(std::fabs(decoded[i] - values[i]), std::fabs(values[i]) * 0.0625f + scale * std::ldexp(1.0f, -10));
  }
  f8_block_encode(decoded.data(), decoded.size(), scales.data(), codes2.data());
  EXPECT_EQ(codes, codes2) << "re-encoding decoded values must give the same bytes";
}

TEST(CommCodec, WireBytes) {
  EXPECT_EQ(wire_bytes(WireFormat::kF32, 10), 40u);
  EXPECT_EQ(wire_bytes(WireFormat::kBF16, 10), 20u);
  EXPECT_EQ(wire_bytes(WireFormat::kF8, 256), 256u + 8u);
  EXPECT_EQ(wire_bytes(WireFormat::kF8, 129), 129u + 8u);
  EXPECT_LE(static_cast<double>(wire_bytes(WireFormat::kF8, 1 << 20)) / wire_bytes(WireFormat::kBF16, 1 << 20), 0.53);
}

TEST(CommCodec, DecodeAddAccumulatesInF32) {
  std::vector<float> acc(300, 1.0f), values(300, 0.5f);
  std::vector<std::byte> wire(wire_bytes(WireFormat::kF8, 300));
  wire_encode(WireFormat::kF8, values.data(), values.size(), wire.data());
  wire_decode_add(WireFormat::kF8, wire.data(), values.size(), acc.data());
  for (float x : acc) EXPECT_EQ(x, 1.5f);
}

TEST(CommSelector, ParsesNamesAndSpecs) {
  EXPECT_EQ(parse_allreduce_algo("nhr"), AllreduceAlgo::kNhr);
  EXPECT_EQ(parse_alltoall_algo("bruck"), AlltoallAlgo::kBruck);
  CommOptions options;
  parse_algo_spec("allreduce=rabenseifner; alltoall=pairwise", &options);
  EXPECT_EQ(options.allreduce_algo, AllreduceAlgo::kRabenseifner);
  EXPECT_EQ(options.alltoall_algo, AlltoallAlgo::kPairwise);
  try {
    parse_allreduce_algo("fast");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), 2);
    EXPECT_NE(std::string(e.what()).find("ring, rd, rabenseifner, nhr, mesh, shm, mpi"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_algo_spec("allgather=ring", &options), Error);
  EXPECT_THROW(parse_algo_spec("allreduce", &options), Error);
}

TEST(CommSelector, TuningTableRoundTripAndLookup) {
  TuningTable table;
  table.add({Collective::kAllreduce, 2, CommDType::kF32, 1024, "shm", 3.0});
  table.add({Collective::kAllreduce, 2, CommDType::kF32, 1 << 20, "ring", 90.0});
  table.add({Collective::kAlltoall, 2, CommDType::kF32, 64, "pairwise", 5.0});
  table.add({Collective::kAllreduce, 2, CommDType::kF32, 1 << 20, "shm", 40.0, /*registered=*/true});
  const std::string path = ::testing::TempDir() + "comm_tuning_test.json";
  table.save(path);
  const TuningTable loaded = TuningTable::load(path);
  EXPECT_EQ(loaded.entries().size(), 4u);
  // Registered memory has its own winners; without one for the size class, the other kind's nearest entry.
  EXPECT_EQ(loaded.lookup(Collective::kAllreduce, 2, CommDType::kF32, 1 << 20, /*registered=*/true), "shm");
  EXPECT_EQ(loaded.lookup(Collective::kAllreduce, 2, CommDType::kF32, 1 << 20, /*registered=*/false), "ring");
  EXPECT_EQ(loaded.lookup(Collective::kAllreduce, 2, CommDType::kBF16, 1 << 20, /*registered=*/true), "shm");
  EXPECT_EQ(loaded.lookup(Collective::kAllreduce, 2, CommDType::kF32, 2000), "shm");
  EXPECT_EQ(loaded.lookup(Collective::kAllreduce, 2, CommDType::kBF16, 800000), "ring");  // falls back to f32
  EXPECT_EQ(loaded.lookup(Collective::kAllreduce, 4, CommDType::kF32, 2000), std::nullopt);
  std::remove(path.c_str());
}

TEST(CommSelector, CostModelFollowsDesign) {
  // Large messages: bandwidth-optimal algorithms beat recursive doubling; tiny ones: fewer steps win.
  EXPECT_LT(allreduce_cost_seconds(AllreduceAlgo::kRing, 8, 64 << 20),
            allreduce_cost_seconds(AllreduceAlgo::kRecursiveDoubling, 8, 64 << 20));
  EXPECT_LT(allreduce_cost_seconds(AllreduceAlgo::kNhr, 8, 64),
            allreduce_cost_seconds(AllreduceAlgo::kRing, 8, 64));
  // NHR takes ceil(log2 p) steps for any p; Rabenseifner pays the fold when p is not a power of two.
  EXPECT_LT(allreduce_cost_seconds(AllreduceAlgo::kNhr, 5, 1 << 20),
            allreduce_cost_seconds(AllreduceAlgo::kRabenseifner, 5, 1 << 20));
}

TEST(CommWorld, SingleRankWithoutMpirunIsQuick) {
  if (launched_by_mpi_launcher()) GTEST_SKIP();
  Communicator& comm = world();
  EXPECT_EQ(comm.size(), 1);
  float x = 3.0f;
  comm.allreduce(&x, 1, CommDType::kF32);
  EXPECT_EQ(x, 3.0f);
  CommHandle handle = comm.start_allreduce(&x, 1, CommDType::kF32);
  handle.wait();
  EXPECT_EQ(comm.split(0, 0)->size(), 1);
}

TEST(CommMeasure, PairedRatioIsTheMedianOfPerRoundRatios) {
  // Round 2 is a machine-wide stall: it slows both, so the paired ratio stays at 1.5, while the ratio of
  // medians would move with which rounds the stall hits.
  Measurement a, b;
  a.rounds = {3.0, 3.3, 30.0, 2.7, 3.0};
  b.rounds = {2.0, 2.2, 20.0, 1.8, 2.0};
  a.seconds = 3.0, b.seconds = 2.0;
  EXPECT_DOUBLE_EQ(paired_ratio(a, b), 1.5);
  b.rounds = {2.0, 2.0, 2.0, 2.0, 6.0};  // a is faster in one round only: the median ignores it
  EXPECT_DOUBLE_EQ(paired_ratio(a, b), 1.5);
  a.rounds.clear();  // no rounds: ratio of the times
  EXPECT_DOUBLE_EQ(paired_ratio(a, b), 1.5);
}

TEST(CommMeasure, LargeMessagesGetFewerSamplesButAtLeastFive) {
  EXPECT_EQ(samples_for_size(1 << 20, 15), 15);
  EXPECT_EQ(samples_for_size(64 << 20, 15), 15);          // 2 GB budget / 64 MB = 32
  EXPECT_EQ(samples_for_size(256ull << 20, 15), 8);
  EXPECT_EQ(samples_for_size(1ull << 30, 15), 5);
}

}  // namespace
}  // namespace moex::comm
