#include "moex/comm/measure.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "moex/base/dtype.h"
#include "moex/comm/algorithms.h"

namespace moex::comm {
namespace {

float pattern(int rank, size_t i, bool random_data) {
  if (!random_data) return static_cast<float>(static_cast<int>((i * 7 + rank * 13) % 17) - 8);
  uint64_t h = (static_cast<uint64_t>(rank) << 40) ^ (i * 0x9e3779b97f4a7c15ull);
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
  h ^= h >> 31;
  return static_cast<float>(h >> 40) / static_cast<float>(1 << 23) - 1.0f;
}

// Median of this rank's per-iteration times, then the slowest rank's median.
double slowest_median(Communicator& comm, std::vector<double>& times) {
  std::sort(times.begin(), times.end());
  double median = times.empty() ? 0.0 : times[times.size() / 2];
  std::vector<double> all(comm.size());
  comm.allgather(&median, sizeof(double), all.data());
  return *std::max_element(all.begin(), all.end());
}

bool all_true(Communicator& comm, bool value) {
  int mine = value ? 1 : 0;
  std::vector<int> all(comm.size());
  comm.allgather(&mine, sizeof(int), all.data());
  return std::all_of(all.begin(), all.end(), [](int v) { return v == 1; });
}

}  // namespace

Measurement measure_allreduce(Communicator& comm, AllreduceAlgo algo, CommDType dtype, size_t count, int warmup,
                              int iters, bool random_data) {
  const int p = comm.size(), r = comm.rank();
  const size_t elem = comm_dtype_buffer_size(dtype);
  std::vector<std::byte> input(count * elem), buffer(count * elem);
  for (size_t i = 0; i < count; ++i) {
    const float x = pattern(r, i, random_data);
    if (dtype == CommDType::kBF16) {
      reinterpret_cast<uint16_t*>(input.data())[i] = f32_to_bf16(x);
    } else {
      reinterpret_cast<float*>(input.data())[i] = x;
    }
  }
  Measurement result;
  set_event_observer([&](const CollectiveEvent& event) {
    result.bytes_sent = event.bytes_sent;
    result.algorithm = event.algorithm;
  });
  std::memcpy(buffer.data(), input.data(), buffer.size());
  comm.allreduce(buffer.data(), count, dtype, algo);
  set_event_observer({});
  // Check against the exact sum (computed in double from every rank's pattern).
  const double unit = dtype == CommDType::kF32 ? 0.0 : dtype == CommDType::kBF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -4);
  const double bound = unit * (2.0 + std::ceil(std::log2(std::max(p, 2))));
  for (size_t i = 0; i < count; ++i) {
    double exact = 0, scale = 0;
    for (int j = 0; j < p; ++j) {
      float x = pattern(j, i, random_data);
      if (dtype == CommDType::kBF16) x = bf16_to_f32(f32_to_bf16(x));
      exact += x, scale += std::fabs(x);
    }
    const double got = dtype == CommDType::kBF16 ? bf16_to_f32(reinterpret_cast<uint16_t*>(buffer.data())[i])
                                                 : reinterpret_cast<float*>(buffer.data())[i];
    result.max_error = std::max(result.max_error, std::fabs(got - exact) / std::max(scale, 1e-30));
  }
  result.correct = all_true(comm, result.max_error <= bound);
  std::vector<double> times;
  for (int iter = 0; iter < warmup + iters; ++iter) {
    std::memcpy(buffer.data(), input.data(), buffer.size());
    comm.barrier();
    const int64_t start = steady_now_ns();
    comm.allreduce(buffer.data(), count, dtype, algo);
    if (iter >= warmup) times.push_back((steady_now_ns() - start) * 1e-9);
  }
  result.seconds = slowest_median(comm, times);
  return result;
}

Measurement measure_alltoall(Communicator& comm, AlltoallAlgo algo, size_t bytes_per_peer, int warmup, int iters) {
  const int p = comm.size(), r = comm.rank();
  std::vector<size_t> counts(p, bytes_per_peer), offsets(p);
  for (int j = 0; j < p; ++j) offsets[j] = j * bytes_per_peer;
  std::vector<uint8_t> send(p * bytes_per_peer), recv(p * bytes_per_peer);
  for (int j = 0; j < p; ++j)
    for (size_t k = 0; k < bytes_per_peer; ++k) send[j * bytes_per_peer + k] = static_cast<uint8_t>(r * 31 + j * 7 + k);
  Measurement result;
  set_event_observer([&](const CollectiveEvent& event) {
    result.bytes_sent = event.bytes_sent;
    result.algorithm = event.algorithm;
  });
  comm.alltoallv(send.data(), counts, offsets, recv.data(), counts, offsets, 1, algo);
  set_event_observer({});
  bool ok = true;
  for (int j = 0; j < p; ++j)
    for (size_t k = 0; k < bytes_per_peer; ++k) ok &= recv[j * bytes_per_peer + k] == static_cast<uint8_t>(j * 31 + r * 7 + k);
  result.correct = all_true(comm, ok);
  std::vector<double> times;
  for (int iter = 0; iter < warmup + iters; ++iter) {
    comm.barrier();
    const int64_t start = steady_now_ns();
    comm.alltoallv(send.data(), counts, offsets, recv.data(), counts, offsets, 1, algo);
    if (iter >= warmup) times.push_back((steady_now_ns() - start) * 1e-9);
  }
  result.seconds = slowest_median(comm, times);
  return result;
}

uint64_t parse_byte_size(const std::string& text, const char* flag) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  const std::string suffix = end ? end : "";
  uint64_t scale = 1;
  if (suffix == "K" || suffix == "k") scale = 1ull << 10;
  else if (suffix == "M" || suffix == "m") scale = 1ull << 20;
  else if (suffix == "G" || suffix == "g") scale = 1ull << 30;
  else MOEX_CHECK_INPUT(suffix.empty() && end != text.c_str(), flag, ": '", text, "' is not a size (e.g. 8, 64K, 16M, 1G)");
  MOEX_CHECK_INPUT(value >= 0, flag, ": '", text, "' must not be negative");
  return static_cast<uint64_t>(value * scale);
}

double measure_peak_copy_bandwidth(Communicator& comm, size_t bytes) {
  auto* mpi = dynamic_cast<MpiCommunicator*>(&comm);
  if (!mpi) return 0.0;
  return detail::measure_shm_copy_bandwidth(*mpi, bytes, 5);
}

}  // namespace moex::comm
