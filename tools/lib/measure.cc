#include "tools/lib/measure.h"

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <utility>

#include "moex/base/dtype.h"
#include "moex/base/error.h"
#include "moex/comm/shm_copy.h"

namespace moex::comm {
namespace {

int64_t steady_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Median (mean of the middle two for an even count); 0 for none.
double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const size_t m = values.size() / 2;
  return values.size() % 2 ? values[m] : 0.5 * (values[m - 1] + values[m]);
}

float pattern(int rank, size_t i, bool random_data) {
  if (!random_data) return static_cast<float>(static_cast<int>((i * 7 + rank * 13) % 17) - 8);
  uint64_t h = (static_cast<uint64_t>(rank) << 40) ^ (i * 0x9e3779b97f4a7c15ull);
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
  h ^= h >> 31;
  return static_cast<float>(h >> 40) / static_cast<float>(1 << 23) - 1.0f;
}

// Elementwise maximum over ranks.
std::vector<double> max_over_ranks(Communicator& comm, const std::vector<double>& mine) {
  const size_t n = mine.size();
  std::vector<double> all(n * comm.size());
  comm.allgather(mine.data(), n * sizeof(double), all.data());
  std::vector<double> result(n, 0.0);
  for (int j = 0; j < comm.size(); ++j)
    for (size_t i = 0; i < n; ++i) result[i] = std::max(result[i], all[j * n + i]);
  return result;
}

// The timing loop of measure.h for `n` algorithms: run(i) makes one call of algorithm i, restore() puts
// the input back. Returns, per algorithm, seconds per call of each round (the slowest rank's sample);
// `batch` = calls per sample (the same for every algorithm).
std::vector<std::vector<double>> time_interleaved(Communicator& comm, size_t n, const std::function<void(size_t)>& run,
                                     const std::function<void()>& restore, const MeasureOptions& options,
                                     int& batch) {
  std::vector<double> estimate(n, 0.0);
  for (size_t i = 0; i < n; ++i) {
    for (int w = 0; w < std::max(1, options.warmup); ++w) {
      restore();
      comm.barrier();
      const int64_t start = steady_now_ns();
      run(i);
      estimate[i] = (steady_now_ns() - start) * 1e-9;  // the last warm-up call: caches and windows are warm
    }
  }
  estimate = max_over_ranks(comm, estimate);  // every rank must use the same batch and sample count
  // One batch for every algorithm, sized by the fastest: a batch amortises the first, colder call of a
  // sample, so different batches would bias the comparison.
  const double fastest = std::max(*std::min_element(estimate.begin(), estimate.end()), 1e-9);
  const double calls = std::ceil(options.target_sample_us * 1e-6 / fastest);
  batch = static_cast<int>(std::clamp(calls, 1.0, static_cast<double>(std::max(1, options.max_batch))));
  // Cheap sizes get more rounds: at least options.min_total_ms of samples for the *fastest* algorithm (it is
  // the one every comparison is made against, and a short sample is the noisiest), but a round of all
  // algorithms may not push the size past options.max_total_ms.
  int rounds = options.samples;
  if (options.min_total_ms > 0 && fastest > 0) {
    const double wanted = std::ceil(options.min_total_ms * 1e-3 / (fastest * batch));
    const double round_seconds = std::accumulate(estimate.begin(), estimate.end(), 0.0) * batch;
    const double affordable = std::floor(options.max_total_ms * 1e-3 / std::max(round_seconds, 1e-9));
    rounds = static_cast<int>(std::clamp(std::min(wanted, affordable), static_cast<double>(options.samples),
                                         static_cast<double>(std::max(options.samples, options.max_samples))));
  }
  std::vector<std::vector<double>> samples(n);
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  for (int s = 0; s < rounds; ++s) {
    // A fresh order each round (the same on every rank: same seed, same binary). A fixed cyclic order is
    // biased whenever one algorithm disturbs the next call (a large MPI_Allreduce that page-faults a fresh
    // temporary slows whatever runs next): the disturbed one would always be the same.
    std::mt19937 rng(static_cast<uint32_t>(s) * 2654435761u + 1u);
    std::shuffle(order.begin(), order.end(), rng);
    for (size_t k = 0; k < n; ++k) {
      const size_t i = order[k];
      restore();
      comm.barrier();
      const int64_t start = steady_now_ns();
      for (int b = 0; b < batch; ++b) run(i);
      samples[i].push_back((steady_now_ns() - start) * 1e-9 / batch);
    }
  }
  // Per round, the slowest rank's sample (all ranks took part in the same collective calls).
  const size_t total = n * static_cast<size_t>(rounds);
  std::vector<double> flat(total);
  for (size_t i = 0; i < n; ++i)
    for (int r = 0; r < rounds; ++r) flat[i * rounds + r] = samples[i][r];
  flat = max_over_ranks(comm, flat);
  std::vector<std::vector<double>> result(n);
  for (size_t i = 0; i < n; ++i) result[i].assign(flat.begin() + i * rounds, flat.begin() + (i + 1) * rounds);
  return result;
}

bool all_true(Communicator& comm, bool value) {
  int mine = value ? 1 : 0;
  std::vector<int> all(comm.size());
  comm.allgather(&mine, sizeof(int), all.data());
  return std::all_of(all.begin(), all.end(), [](int v) { return v == 1; });
}

// The checked call's event (bytes sent, the algorithm auto resolved to) goes into `result`.
void record_events_into(Measurement& result) {
  set_event_observer([&result](const CollectiveEvent& event) {
    result.bytes_sent = event.bytes_sent;
    result.algorithm = event.algorithm;
  });
}

void store_rounds(std::vector<Measurement>& results, std::vector<std::vector<double>>& rounds, int batch) {
  for (size_t a = 0; a < results.size(); ++a) {
    results[a].rounds = std::move(rounds[a]);
    results[a].seconds = median(results[a].rounds);
    results[a].batch = batch;
  }
}

// Whether this measurement includes the copy probe of MeasureOptions (the group can run it).
bool with_copy_probe(Communicator& comm, const MeasureOptions& options) {
  return options.copy_probe && can_copy_through_shm(comm);
}

}  // namespace

size_t pick_winner(std::span<const Measurement> results, size_t previous, double switch_margin) {
  size_t best = 0;
  for (size_t i = 1; i < results.size(); ++i)
    if (results[i].seconds < results[best].seconds) best = i;
  if (previous < results.size() && paired_ratio(results[previous], results[best]) <= switch_margin) return previous;
  return best;
}

int samples_for_size(uint64_t bytes, int samples, uint64_t budget_bytes) {
  if (bytes < (16u << 20)) return samples;
  return std::max(5, std::min(samples, static_cast<int>(budget_bytes / bytes)));
}

double paired_ratio(const Measurement& a, const Measurement& b) {
  const size_t rounds = std::min(a.rounds.size(), b.rounds.size());
  std::vector<double> ratios;  // per round both were timed in
  for (size_t r = 0; r < rounds; ++r)
    if (b.rounds[r] > 0) ratios.push_back(a.rounds[r] / b.rounds[r]);
  if (!ratios.empty()) return median(std::move(ratios));
  return b.seconds > 0 ? a.seconds / b.seconds : 0.0;  // nothing to pair: the medians
}

std::vector<Measurement> measure_allreduce(Communicator& comm, std::span<const AllreduceAlgo> algos, CommDType dtype,
                                           size_t count, const MeasureOptions& options, bool random_data) {
  const int p = comm.size(), r = comm.rank();
  const size_t elem = comm_dtype_buffer_size(dtype);
  std::vector<std::byte> input(count * elem), plain(options.registered ? 0 : count * elem);
  // The buffer the collective works on: plain memory, or registered memory (freed collectively at the end).
  struct Registered {
    Communicator& comm;
    void* data;
    ~Registered() { if (data) comm.free_registered(data); }
  } registered{comm, options.registered ? comm.alloc_registered(count * elem) : nullptr};
  const std::span<std::byte> buffer(options.registered ? static_cast<std::byte*>(registered.data) : plain.data(),
                                    count * elem);
  for (size_t i = 0; i < count; ++i) {
    const float x = pattern(r, i, random_data);
    if (dtype == CommDType::kBF16) {
      reinterpret_cast<uint16_t*>(input.data())[i] = f32_to_bf16(x);
    } else {
      reinterpret_cast<float*>(input.data())[i] = x;
    }
  }
  // The exact sum of element i (in double, from every rank's pattern) and the sum of magnitudes that scales
  // its error bound; recomputed per check (cheap next to the collective) instead of held for every element.
  auto exact_and_scale = [&](size_t i) {
    double exact = 0.0, scale = 0.0;
    for (int j = 0; j < p; ++j) {
      float x = pattern(j, i, random_data);
      if (dtype == CommDType::kBF16) x = bf16_to_f32(f32_to_bf16(x));
      exact += x, scale += std::fabs(x);
    }
    return std::pair{exact, scale};
  };
  const double unit = dtype == CommDType::kF32 ? 0.0 : dtype == CommDType::kBF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -4);
  const double bound = unit * (2.0 + std::ceil(std::log2(std::max(p, 2))));
  std::vector<Measurement> results(algos.size());
  for (size_t a = 0; a < algos.size(); ++a) {
    Measurement& result = results[a];
    record_events_into(result);
    std::memcpy(buffer.data(), input.data(), buffer.size());
    comm.allreduce(buffer.data(), count, dtype, algos[a]);
    set_event_observer({});
    for (size_t i = 0; i < count; ++i) {
      const double got = dtype == CommDType::kBF16 ? bf16_to_f32(reinterpret_cast<uint16_t*>(buffer.data())[i])
                                                   : reinterpret_cast<float*>(buffer.data())[i];
      const auto [exact, scale] = exact_and_scale(i);
      result.max_error = std::max(result.max_error, std::fabs(got - exact) / std::max(scale, 1e-30));
    }
    result.correct = all_true(comm, result.max_error <= bound);
  }
  const bool probe = with_copy_probe(comm, options);
  std::vector<std::byte> copy_target(probe && r == 1 ? buffer.size() : 0);
  if (probe) results.emplace_back().algorithm = "copy";
  const auto restore = [&] { std::memcpy(buffer.data(), input.data(), buffer.size()); };
  int batch = 1;
  auto seconds = time_interleaved(
      comm, results.size(),
      [&](size_t a) {
        if (a < algos.size()) comm.allreduce(buffer.data(), count, dtype, algos[a]);
        else copy_through_shm(comm, input.data(), copy_target.data(), buffer.size(), options.copy_chunk_bytes,
                                   options.copy_streaming);
      },
      restore, options, batch);
  store_rounds(results, seconds, batch);
  return results;
}

std::vector<Measurement> measure_alltoall(Communicator& comm, std::span<const AlltoallAlgo> algos,
                                          size_t bytes_per_peer, const MeasureOptions& options) {
  const int p = comm.size(), r = comm.rank();
  std::vector<size_t> counts(p, bytes_per_peer), offsets(p);
  for (int j = 0; j < p; ++j) offsets[j] = j * bytes_per_peer;
  std::vector<uint8_t> send(p * bytes_per_peer), recv(p * bytes_per_peer);
  for (int j = 0; j < p; ++j)
    for (size_t k = 0; k < bytes_per_peer; ++k) send[j * bytes_per_peer + k] = static_cast<uint8_t>(r * 31 + j * 7 + k);
  std::vector<Measurement> results(algos.size());
  for (size_t a = 0; a < algos.size(); ++a) {
    Measurement& result = results[a];
    record_events_into(result);
    std::fill(recv.begin(), recv.end(), uint8_t{0});
    comm.alltoallv(send.data(), counts, offsets, recv.data(), counts, offsets, 1, algos[a]);
    set_event_observer({});
    bool ok = true;
    for (int j = 0; j < p; ++j)
      for (size_t k = 0; k < bytes_per_peer; ++k)
        ok &= recv[j * bytes_per_peer + k] == static_cast<uint8_t>(j * 31 + r * 7 + k);
    result.correct = all_true(comm, ok);
  }
  if (with_copy_probe(comm, options)) results.emplace_back().algorithm = "copy";
  int batch = 1;
  auto seconds = time_interleaved(
      comm, results.size(),
      [&](size_t a) {
        if (a < algos.size()) comm.alltoallv(send.data(), counts, offsets, recv.data(), counts, offsets, 1, algos[a]);
        else copy_through_shm(comm, reinterpret_cast<const std::byte*>(send.data()),
                              reinterpret_cast<std::byte*>(recv.data()), send.size(), options.copy_chunk_bytes,
                              options.copy_streaming);
      },
      [] {}, options, batch);
  store_rounds(results, seconds, batch);
  return results;
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

void keep_freed_memory_for_benchmarks() {
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, -1);
}

PeakCopy measure_peak_copy_bandwidth(Communicator& comm, size_t bytes) {
  const auto best = measure_copy_through_shm(comm, bytes, 5);
  return best.bytes_per_second > 0 ? PeakCopy{best.bytes_per_second, best.chunk_bytes, best.streaming} : PeakCopy{};
}

LinkCost measure_link_cost(Communicator& world, Communicator& level, size_t bytes, int reps) {
  const int partner = (level.rank() ^ 1) < level.size() ? level.rank() ^ 1 : -1;
  std::vector<std::byte> out(std::max<size_t>(bytes, 8)), in(out.size());
  std::vector<double> medians;
  for (const size_t size : {size_t{8}, bytes}) {
    std::vector<double> times;
    for (int rep = 0; rep < reps + 1; ++rep) {  // the first is a warm-up
      world.barrier();
      const int64_t start = steady_now_ns();
      if (partner >= 0) {
        P2PRequest requests[2] = {level.irecv(in.data(), size, partner, 7), level.isend(out.data(), size, partner, 7)};
        level.wait_all(requests);
      }
      if (rep > 0) times.push_back((steady_now_ns() - start) * 1e-9);
    }
    medians.push_back(partner >= 0 ? median(times) : 0.0);
  }
  medians = max_over_ranks(world, medians);
  LinkCost link;
  link.alpha_s = medians[0];
  link.beta_s_per_byte = std::max(0.0, (medians[1] - medians[0]) / static_cast<double>(bytes));
  link.measured = true;
  return link;
}

}  // namespace moex::comm
