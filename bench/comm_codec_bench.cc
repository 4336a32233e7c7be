// The wire codecs' loops on one core (bytes/s of fp32 input): how fast fp8/bf16 must be before compressing
// pays. A collective through shared memory moves fp32 at ~10-20 GB/s here, so a codec slower than that
// makes a compressed all-reduce slower than an uncompressed one on one node.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "moex/comm/codec.h"

namespace {

using moex::comm::WireFormat;

std::vector<float> values(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>((i * 2654435761u) % 2001) * 0.01f - 10.0f;
  return v;
}

void BM_Encode(benchmark::State& state, WireFormat format) {
  const size_t n = state.range(0);
  const auto src = values(n);
  std::vector<std::byte> wire(moex::comm::wire_bytes(format, n));
  for (auto _ : state) {
    moex::comm::wire_encode(format, src.data(), n, wire.data());
    benchmark::DoNotOptimize(wire.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * n * 4);
}

void BM_DecodeAdd(benchmark::State& state, WireFormat format) {
  const size_t n = state.range(0);
  const auto src = values(n);
  std::vector<std::byte> wire(moex::comm::wire_bytes(format, n));
  moex::comm::wire_encode(format, src.data(), n, wire.data());
  std::vector<float> dst(n, 0.0f);
  for (auto _ : state) {
    moex::comm::wire_decode_add(format, wire.data(), n, dst.data());
    benchmark::DoNotOptimize(dst.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * n * 4);
}

BENCHMARK_CAPTURE(BM_Encode, f32, WireFormat::kF32)->Arg(1 << 16);
BENCHMARK_CAPTURE(BM_Encode, bf16, WireFormat::kBF16)->Arg(1 << 16);
BENCHMARK_CAPTURE(BM_Encode, fp8, WireFormat::kF8)->Arg(1 << 16);
BENCHMARK_CAPTURE(BM_DecodeAdd, f32, WireFormat::kF32)->Arg(1 << 16);
BENCHMARK_CAPTURE(BM_DecodeAdd, bf16, WireFormat::kBF16)->Arg(1 << 16);
BENCHMARK_CAPTURE(BM_DecodeAdd, fp8, WireFormat::kF8)->Arg(1 << 16);

}  // namespace
