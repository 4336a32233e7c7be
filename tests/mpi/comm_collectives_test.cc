// Multi-rank tests of every collective algorithm; run under mpirun with 1..8 ranks (tests/mpi/CMakeLists.txt).
// Every algorithm x dtype x count (0, 1, p-1, p+1, not divisible by p, one-shot and multi-segment shm sizes),
// and the rank -> host map with its intra-host and inter-host groups.
// fp32 integer data must be exact; bf16 and fp8 errors are bounded; all ranks must end bit-identical.
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

// The C API only (as mpi_communicator.h): the C++ bindings would need libmpi_cxx.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include "moex/base/dtype.h"
#include "moex/base/error.h"
#include "moex/comm/communicator.h"
#include "moex/comm/selector.h"

using namespace moex::comm;

namespace {
int g_iallreduce_count = 0;
}  // namespace

// MPI's profiling interface: this definition takes the calls of the comm library linked into this test, so a test can
// see whether a collective ran an all-reduce (alltoallv's size agreement is the only MPI_Iallreduce outside the
// `mpi` all-reduce).
extern "C" int MPI_Iallreduce(const void* send, void* recv, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm,
                              MPI_Request* request) {
  ++g_iallreduce_count;
  return PMPI_Iallreduce(send, recv, count, type, op, comm, request);
}

namespace {

int g_failures = 0;
int g_rank = 0;

#define EXPECT(cond, ...)                                        \
  do {                                                           \
    if (!(cond)) {                                               \
      ++g_failures;                                              \
      std::fprintf(stderr, "rank %d: FAIL %s:%d: ", g_rank, __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                         \
      std::fputc('\n', stderr);                                  \
    }                                                            \
  } while (0)

// Rank `rank`'s input element i: integer-valued (exact sums) or random in [-1, 1].
float input_value(int rank, size_t i, bool integer) {
  if (integer) return static_cast<float>(static_cast<int>((i * 7 + rank * 13) % 17) - 8);
  uint64_t h = (static_cast<uint64_t>(rank) << 40) ^ (i * 0x9e3779b97f4a7c15ull);  // splitmix64: cheap, stateless
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
  h ^= h >> 31;
  return static_cast<float>(h >> 40) / static_cast<float>(1 << 23) - 1.0f;  // [-1, 1)
}

uint64_t hash_bytes(const void* data, size_t bytes) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < bytes; ++i) h = (h ^ static_cast<const uint8_t*>(data)[i]) * 1099511628211ull;
  return h;
}

// Error allowed relative to sum_j |x_j| (the scale of the reduction); log-step algorithms re-round partial
// sums up to ceil(log2 p) times, the others round each contribution once plus the result once. Two-level
// algorithms round each contribution once inside its host, each host's partial sum as their inter-host
// algorithm rounds a contribution on `hosts` ranks, and the result once.
double tolerance(CommDType dtype, AllreduceAlgo algo, int p, int hosts) {
  const double unit = dtype == CommDType::kBF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -4);
  const bool hier = is_hierarchical(algo);
  const AllreduceAlgo flat = inter_host_algo(algo);
  const bool log_steps = flat == AllreduceAlgo::kRecursiveDoubling || flat == AllreduceAlgo::kRabenseifner ||
                         flat == AllreduceAlgo::kNhr;
  const int steps_over = hier ? hosts : p;
  return unit * ((hier ? 3.0 : 2.0) + (log_steps ? std::ceil(std::log2(std::max(steps_over, 2))) : 0.0));
}

void test_allreduce(Communicator& comm, AllreduceAlgo algo, CommDType dtype, size_t count, bool integer,
                    bool registered = false) {
  const int p = comm.size(), r = comm.rank();
  std::vector<float> values(count);
  std::vector<uint16_t> values_bf16(count);
  std::vector<double> exact(count, 0.0), scale(count, 0.0);
  for (size_t i = 0; i < count; ++i) {
    for (int j = 0; j < p; ++j) {
      float x = input_value(j, i, integer);
      if (dtype == CommDType::kBF16) x = moex::bf16_to_f32(moex::f32_to_bf16(x));
      exact[i] += x;
      scale[i] += std::fabs(x);
    }
    values[i] = input_value(r, i, integer);
    values_bf16[i] = moex::f32_to_bf16(values[i]);
  }
  void* buffer = dtype == CommDType::kBF16 ? static_cast<void*>(values_bf16.data()) : values.data();
  // Registered memory: the same values at a 64-byte offset inside a registered allocation.
  const size_t elem = comm_dtype_buffer_size(dtype);
  std::byte* shared = registered ? static_cast<std::byte*>(comm.alloc_registered(count * elem + 64)) : nullptr;
  std::string_view ran;
  set_event_observer([&](const CollectiveEvent& event) { ran = event.algorithm; });
  if (shared) {
    std::memcpy(shared + 64, buffer, count * elem);
    comm.allreduce(shared + 64, count, dtype, algo);
    std::memcpy(buffer, shared + 64, count * elem);
    comm.free_registered(shared);
  } else {
    comm.allreduce(buffer, count, dtype, algo);
  }
  set_event_observer({});
  if (registered && algo == AllreduceAlgo::kShm && dtype == CommDType::kF32 && p > 1 && count * 4 >= 2048)
    EXPECT(ran == "shm-registered", "registered shm p=%d count=%zu ran %s, not the zero-copy path", p, count,
           std::string(ran).c_str());
  double worst = 0.0;
  for (size_t i = 0; i < count; ++i) {
    const double got = dtype == CommDType::kBF16 ? moex::bf16_to_f32(values_bf16[i]) : values[i];
    worst = std::max(worst, std::fabs(got - exact[i]) / std::max(scale[i], 1e-30));
  }
  const bool exact_expected = integer && dtype == CommDType::kF32;
  // What ran (auto and hier resolved) sets the tolerance.
  const AllreduceAlgo resolved = allreduce_algo_from_name(ran).value_or(algo);
  const double allowed = exact_expected ? 0.0 : tolerance(dtype, resolved, p, comm.topology().hosts());
  EXPECT(worst <= allowed, "allreduce %s %s p=%d count=%zu: error %.3g > %.3g", std::string(algo_name(algo)).c_str(),
         std::string(comm_dtype_name(dtype)).c_str(), p, count, worst, allowed);
  // Bit-identical on every rank (TP ranks must not drift apart).
  uint64_t h = hash_bytes(buffer, count * comm_dtype_buffer_size(dtype));
  std::vector<uint64_t> all(p);
  comm.allgather(&h, sizeof(h), all.data());
  for (int j = 0; j < p; ++j)
    EXPECT(all[j] == h, "allreduce %s %s p=%d count=%zu: rank %d differs", std::string(algo_name(algo)).c_str(),
           std::string(comm_dtype_name(dtype)).c_str(), p, count, j);
}

// fp32 random data: `algo` against MPI_Allreduce (the `mpi` algorithm) on the same input. They add in other
// orders, so they may differ by fp32 rounding: each rounds p-1 partial sums, at most 2^-24 of sum_j |x_j| each.
void test_against_mpi(Communicator& comm, AllreduceAlgo algo, size_t count) {
  const int p = comm.size(), r = comm.rank();
  std::vector<float> ours(count), theirs(count), scale(count, 0.0f);
  for (size_t i = 0; i < count; ++i) {
    ours[i] = theirs[i] = input_value(r, i, /*integer=*/false);
    for (int j = 0; j < p; ++j) scale[i] += std::fabs(input_value(j, i, false));
  }
  comm.allreduce(ours.data(), count, CommDType::kF32, algo);
  comm.allreduce(theirs.data(), count, CommDType::kF32, AllreduceAlgo::kMpi);
  double worst = 0;
  for (size_t i = 0; i < count; ++i)
    worst = std::max(worst, std::fabs(static_cast<double>(ours[i]) - theirs[i]) / std::max(scale[i], 1e-30f));
  const double allowed = 2 * (p - 1) * std::ldexp(1.0, -24);
  EXPECT(worst <= allowed, "allreduce %s p=%d count=%zu against MPI_Allreduce: %.3g > %.3g",
         std::string(algo_name(algo)).c_str(), p, count, worst, allowed);
}

void test_alltoallv(Communicator& comm, AlltoallAlgo algo) {
  const int p = comm.size(), r = comm.rank();
  // Uneven: rank s sends (s + 2d) % 5 elements to rank d (some zero).
  auto count_of = [](int s, int d) { return static_cast<size_t>((s + 2 * d) % 5); };
  std::vector<size_t> send_counts(p), send_offsets(p), recv_counts(p), recv_offsets(p);
  size_t send_total = 0, recv_total = 0;
  for (int j = 0; j < p; ++j) {
    send_counts[j] = count_of(r, j), send_offsets[j] = send_total, send_total += send_counts[j];
    recv_counts[j] = count_of(j, r), recv_offsets[j] = recv_total, recv_total += recv_counts[j];
  }
  std::vector<int32_t> send(send_total), recv(recv_total + 1, -1);
  for (int j = 0; j < p; ++j)
    for (size_t k = 0; k < send_counts[j]; ++k) send[send_offsets[j] + k] = r * 100000 + j * 100 + static_cast<int>(k);
  comm.alltoallv(send.data(), send_counts, send_offsets, recv.data(), recv_counts, recv_offsets, 4, algo);
  for (int j = 0; j < p; ++j)
    for (size_t k = 0; k < recv_counts[j]; ++k)
      EXPECT(recv[recv_offsets[j] + k] == j * 100000 + r * 100 + static_cast<int>(k), "alltoallv %s p=%d from %d",
             std::string(algo_name(algo)).c_str(), p, j);
}

// The caller that knows the group's largest block passes it (the MoE dispatch path, moe_layer.cc): no agreement
// runs, and every algorithm, `auto` included, moves the same data as after agreeing, auto picking the same one. Two
// scales: blocks of 0-16 bytes (Bruck above 2 ranks on one host) and 0-4.8 KB (pairwise; hier across hosts). A
// figure above the truth, the same on every rank, is as good; one below a rank's own block is refused on that rank
// before anything moves, so the group goes on.
void test_alltoallv_known_largest(Communicator& comm) {
  const int p = comm.size(), r = comm.rank();
  std::vector<AlltoallAlgo> algos(all_alltoall_algos().begin(), all_alltoall_algos().end());
  algos.push_back(AlltoallAlgo::kAuto);
  for (size_t scale : {size_t{1}, size_t{300}}) {
    auto count_of = [&](int s, int d) { return scale * static_cast<size_t>((s + 2 * d) % 5); };
    uint64_t largest = 0;
    for (int s = 0; s < p; ++s)
      for (int d = 0; d < p; ++d) largest = std::max<uint64_t>(largest, count_of(s, d) * 4);
    std::vector<size_t> send_counts(p), send_offsets(p), recv_counts(p), recv_offsets(p);
    size_t send_total = 0, recv_total = 0;
    for (int j = 0; j < p; ++j) {
      send_counts[j] = count_of(r, j), send_offsets[j] = send_total, send_total += send_counts[j];
      recv_counts[j] = count_of(j, r), recv_offsets[j] = recv_total, recv_total += recv_counts[j];
    }
    std::vector<int32_t> send(send_total), expected(recv_total);
    for (int j = 0; j < p; ++j) {
      for (size_t k = 0; k < send_counts[j]; ++k) send[send_offsets[j] + k] = r * 100000 + j * 1000 + static_cast<int>(k);
      for (size_t k = 0; k < recv_counts[j]; ++k) expected[recv_offsets[j] + k] = j * 100000 + r * 1000 + static_cast<int>(k);
    }
    for (AlltoallAlgo algo : algos) {
      const std::string name(algo_name(algo));
      std::string_view ran_agreeing, ran_known;
      std::vector<int32_t> agreeing(recv_total + 1, -1), known(recv_total + 1, -1), above(recv_total + 1, -1);
      int calls = g_iallreduce_count;
      set_event_observer([&](const CollectiveEvent& event) { ran_agreeing = event.algorithm; });
      comm.alltoallv(send.data(), send_counts, send_offsets, agreeing.data(), recv_counts, recv_offsets, 4, algo);
      const bool agrees = algo == AlltoallAlgo::kAuto && comm_options().alltoall_algo == AlltoallAlgo::kAuto && p > 1;
      EXPECT(g_iallreduce_count - calls == (agrees ? 1 : 0), "alltoallv %s p=%d: %d agreements without the largest block",
             name.c_str(), p, g_iallreduce_count - calls);
      calls = g_iallreduce_count;
      set_event_observer([&](const CollectiveEvent& event) { ran_known = event.algorithm; });
      comm.alltoallv(send.data(), send_counts, send_offsets, known.data(), recv_counts, recv_offsets, 4, algo, largest);
      set_event_observer({});
      EXPECT(g_iallreduce_count == calls, "alltoallv %s p=%d: an agreement ran with the largest block passed",
             name.c_str(), p);
      EXPECT(ran_known == ran_agreeing, "alltoallv %s p=%d scale %zu: ran %s with the largest block passed, %s agreeing",
             name.c_str(), p, scale, std::string(ran_known).c_str(), std::string(ran_agreeing).c_str());
      comm.alltoallv(send.data(), send_counts, send_offsets, above.data(), recv_counts, recv_offsets, 4, algo,
                     largest + 4096);
      for (size_t i = 0; i < recv_total; ++i) {
        EXPECT(agreeing[i] == expected[i] && known[i] == expected[i] && above[i] == expected[i],
               "alltoallv %s p=%d scale %zu: element %zu is %d agreeing, %d and %d with the largest block passed (want %d)",
               name.c_str(), p, scale, i, agreeing[i], known[i], above[i], expected[i]);
        if (agreeing[i] != expected[i] || known[i] != expected[i] || above[i] != expected[i]) break;
      }
      EXPECT(known[recv_total] == -1, "alltoallv %s p=%d: wrote past the output", name.c_str(), p);
    }
  }
  // The fp32 helper with a wire dtype passes the largest block in values: the same bits as agreeing.
  for (CommDType wire : {CommDType::kF32, CommDType::kBF16, CommDType::kF8}) {
    const size_t count = 300;  // values to every peer
    std::vector<size_t> counts(p, count), offsets(p);
    for (int j = 0; j < p; ++j) offsets[j] = j * count;
    std::vector<float> send(p * count), agreeing(p * count), known(p * count);
    for (size_t i = 0; i < send.size(); ++i) send[i] = input_value(r, i, false);
    WireScratch scratch;
    const int calls = g_iallreduce_count;
    alltoallv_f32(comm, send.data(), counts, offsets, agreeing.data(), counts, offsets, wire, scratch);
    const int agreements = g_iallreduce_count - calls;
    alltoallv_f32(comm, send.data(), counts, offsets, known.data(), counts, offsets, wire, scratch, count);
    EXPECT(g_iallreduce_count - calls == agreements, "alltoallv_f32 p=%d: an agreement ran with the largest block passed", p);
    EXPECT(std::memcmp(agreeing.data(), known.data(), known.size() * 4) == 0,
           "alltoallv_f32 %s p=%d: other values with the largest block passed", std::string(comm_dtype_name(wire)).c_str(), p);
  }
  // Too small: every rank sends one int32 to every rank (its own included) and says the largest block is 0 bytes.
  std::vector<size_t> ones(p, 1), offsets(p);
  for (int j = 0; j < p; ++j) offsets[j] = j;
  std::vector<int32_t> send(p, r), recv(p, -1);
  bool refused = false;
  try {
    comm.alltoallv(send.data(), ones, offsets, recv.data(), ones, offsets, 4, AlltoallAlgo::kAuto, 0);
  } catch (const moex::Error& e) {
    refused = e.kind() == moex::ErrorKind::kInternal && std::string_view(e.what()).find("largest block") != std::string_view::npos;
  }
  EXPECT(refused, "alltoallv p=%d: a largest block below this rank's own was not refused", p);
  EXPECT(recv == std::vector<int32_t>(p, -1), "alltoallv p=%d: the refused call wrote the output", p);
  // Nothing moved: the group goes on to the next collective.
  comm.alltoallv(send.data(), ones, offsets, recv.data(), ones, offsets, 4, AlltoallAlgo::kAuto, 4);
  for (int j = 0; j < p; ++j) EXPECT(recv[j] == j, "alltoallv p=%d after a refused call: from %d got %d", p, j, recv[j]);
}

// Starting comm leaves the process's allocator as glibc set it up: a 64 MB allocation is its own mmap,
// returned to the kernel on free (the engine's memory use is not the comm library's to change).
void test_init_leaves_the_allocator_alone() {
  const size_t mapped_before = mallinfo2().hblks;
  {
    std::vector<char> big(64 << 20, 1);
    const size_t mapped_during = mallinfo2().hblks;
    EXPECT(mapped_during == mapped_before + 1, "a 64 MB allocation was not mmapped (%zu -> %zu mapped chunks)",
           mapped_before, mapped_during);
  }
  EXPECT(mallinfo2().hblks == mapped_before, "a freed 64 MB allocation stayed mapped");
}

void test_other_collectives(Communicator& comm) {
  const int p = comm.size(), r = comm.rank();
  // all-gather
  std::vector<int32_t> mine = {r, r * 10, r * 100}, all(3 * p);
  comm.allgather(mine.data(), mine.size() * 4, all.data());
  for (int j = 0; j < p; ++j) EXPECT(all[3 * j + 1] == j * 10, "allgather p=%d", p);
  // reduce-scatter, 5 elements per rank, all dtypes
  for (CommDType dtype : {CommDType::kF32, CommDType::kBF16, CommDType::kF8}) {
    const size_t count = 5;
    std::vector<float> send(p * count), recv(count);
    std::vector<uint16_t> send16(p * count), recv16(count);
    for (size_t i = 0; i < p * count; ++i) send[i] = static_cast<float>(i % 7 + r), send16[i] = moex::f32_to_bf16(send[i]);
    if (dtype == CommDType::kBF16) {
      comm.reduce_scatter(send16.data(), recv16.data(), count, dtype);
    } else {
      comm.reduce_scatter(send.data(), recv.data(), count, dtype);
    }
    for (size_t k = 0; k < count; ++k) {
      const size_t i = r * count + k;
      const double want = p * static_cast<double>(i % 7) + p * (p - 1) / 2.0;
      const double got = dtype == CommDType::kBF16 ? moex::bf16_to_f32(recv16[k]) : recv[k];
      EXPECT(std::fabs(got - want) <= (dtype == CommDType::kF32 ? 0 : want * 0.07 + 0.5), "reduce_scatter %s p=%d",
             std::string(comm_dtype_name(dtype)).c_str(), p);
    }
  }
  // broadcast from the last rank
  int64_t value = r == p - 1 ? 4242 : 0;
  comm.broadcast(&value, sizeof(value), p - 1);
  EXPECT(value == 4242, "broadcast p=%d", p);
  // point to point ring
  int32_t out = r, in = -1;
  P2PRequest requests[2] = {comm.irecv(&in, 4, (r + p - 1) % p, 5), comm.isend(&out, 4, (r + 1) % p, 5)};
  comm.wait_all(requests);
  EXPECT(in == (r + p - 1) % p, "p2p p=%d", p);
}

void test_groups_and_async(Communicator& comm) {
  const int p = comm.size(), r = comm.rank();
  // TP x EP style split: two groups by parity, ordered by rank.
  auto group = comm.split(r % 2, r);
  const int group_size = (p - r % 2 + 1) / 2;
  EXPECT(group->size() == group_size && group->rank() == r / 2, "split p=%d", p);
  float x = 1.0f;
  group->allreduce(&x, 1, CommDType::kF32, AllreduceAlgo::kRing);
  EXPECT(x == static_cast<float>(group_size), "split allreduce p=%d: %f", p, x);

  // Non-blocking: start, do other work (a blocking collective on the same communicator), wait.
  std::vector<float> data(10007, 1.0f);
  CommHandle handle = comm.start_allreduce(data.data(), data.size(), CommDType::kF32, AllreduceAlgo::kNhr);
  float y = 2.0f;
  comm.allreduce(&y, 1, CommDType::kF32, AllreduceAlgo::kMesh);
  handle.wait();
  EXPECT(data[10006] == static_cast<float>(p) && y == 2.0f * p, "async p=%d", p);

  // Pipelined compute + reduce.
  std::vector<float> out(5000, 0.0f);
  pipelined_allreduce(comm, out.data(), out.size(), CommDType::kF32, 4, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) out[i] = static_cast<float>(i % 3);
  });
  bool ok = true;
  for (size_t i = 0; i < out.size(); ++i) ok &= out[i] == static_cast<float>((i % 3) * p);
  EXPECT(ok, "pipelined_allreduce p=%d", p);

  // Events: a collective reports its bytes; fp8 puts about half the bytes of bf16 on the wire.
  uint64_t sent_bf16 = 0, sent_fp8 = 0;
  std::vector<float> f(1 << 14, 0.5f);
  std::vector<uint16_t> h(1 << 14, moex::f32_to_bf16(0.5f));
  set_event_observer([&](const CollectiveEvent& event) {
    (event.dtype == CommDType::kF8 ? sent_fp8 : sent_bf16) += event.bytes_sent;
  });
  comm.allreduce(h.data(), h.size(), CommDType::kBF16, AllreduceAlgo::kRing);
  comm.allreduce(f.data(), f.size(), CommDType::kF8, AllreduceAlgo::kRing);
  set_event_observer({});
  if (p > 1)
    EXPECT(sent_fp8 <= 0.53 * sent_bf16 && sent_fp8 > 0, "fp8 bytes %llu vs bf16 %llu",
           static_cast<unsigned long long>(sent_fp8), static_cast<unsigned long long>(sent_bf16));
}

// The rank -> host map agrees on every rank and with the two levels made from it: intra_host() holds this
// host's ranks, inter_host() one rank per host, and summing over one level then the other sums over all.
// expected_hosts < 0: any number (mpirun on one machine gives 1 host).
// Failures summed over the ranks; rank 0 prints the count. The exit code of every rank.
int report(Communicator& comm) {
  int failures = g_failures, total = 0;
  std::vector<int> all(comm.size());
  comm.allgather(&failures, sizeof(int), all.data());
  for (int f : all) total += f;
  if (comm.rank() == 0) std::printf("comm_collectives_test: %d ranks, %d failures\n", comm.size(), total);
  return total == 0 ? 0 : 1;
}

void test_host_levels(Communicator& comm, int expected_hosts) {
  const int p = comm.size(), r = comm.rank();
  const Topology& t = comm.topology();
  EXPECT(t.ranks() == p, "topology has %d ranks, group %d", t.ranks(), p);
  if (expected_hosts >= 0) EXPECT(t.hosts() == expected_hosts, "%d hosts, expected %d", t.hosts(), expected_hosts);
  std::string map;
  for (const std::string& line : describe_topology(t)) map += line + ";";
  const uint64_t own = hash_bytes(map.data(), map.size());
  std::vector<uint64_t> all(p);
  comm.allgather(&own, sizeof(own), all.data());
  for (int j = 0; j < p; ++j)
    EXPECT(all[j] == own, "rank %d sees another host map than rank %d: %s", j, r, map.c_str());
  const int host = t.host_of_rank[r];
  Communicator& intra = comm.intra_host();
  Communicator& inter = comm.inter_host();
  EXPECT(intra.size() == t.ranks_per_host[host] && intra.rank() == t.local_rank[r], "intra-host group %d of %d",
         intra.rank(), intra.size());
  EXPECT(intra.topology().hosts() == 1, "the intra-host group spans %d hosts", intra.topology().hosts());
  EXPECT(inter.topology().hosts() == inter.size(), "the inter-host group has %d ranks on %d hosts", inter.size(),
         inter.topology().hosts());
  if (t.uniform()) EXPECT(inter.size() == t.hosts() && inter.rank() == host, "inter-host group %d of %d, host %d",
                          inter.rank(), inter.size(), host);
  float x = static_cast<float>(r + 1);
  intra.allreduce(&x, 1, CommDType::kF32, AllreduceAlgo::kRing);
  float from_host = 0;  // what the host's ranks hold: the same on each
  for (int j : t.ranks_on_host(host)) from_host += static_cast<float>(j + 1);
  EXPECT(x == from_host, "intra-host sum %f, expected %f", x, from_host);
  if (t.uniform()) {
    inter.allreduce(&x, 1, CommDType::kF32, AllreduceAlgo::kRing);
    EXPECT(x == static_cast<float>(p * (p + 1) / 2), "two-level sum %f, expected %d", x, p * (p + 1) / 2);
  }
  if (t.hosts() > 1) {  // shm across hosts: an input error on every rank, before anything is sent
    bool refused = false;
    try {
      comm.allreduce(&x, 1, CommDType::kF32, AllreduceAlgo::kShm);
    } catch (const moex::Error& e) {
      refused = e.kind() == moex::ErrorKind::kInvalidInput;
    }
    EXPECT(refused, "the shm all-reduce across %d hosts was not refused as an input error", t.hosts());
  }
}

}  // namespace

// The collectives a run across hosts (or a fake host map) adds: every all-reduce algorithm, the two-level ones
// first, each dtype, at sizes around the slices' edges; each against MPI_Allreduce; all-to-all(v).
void test_across_hosts(Communicator& comm) {
  const int p = comm.size();
  std::vector<AllreduceAlgo> algos;
  for (AllreduceAlgo algo : all_allreduce_algos())
    if (is_hierarchical(algo)) algos.push_back(algo);
  for (AllreduceAlgo algo : all_allreduce_algos())
    if (!is_hierarchical(algo) && (algo != AllreduceAlgo::kShm || comm.topology().hosts() == 1)) algos.push_back(algo);
  algos.push_back(AllreduceAlgo::kHier);
  algos.push_back(AllreduceAlgo::kAuto);
  const std::vector<size_t> counts = {0, 1, static_cast<size_t>(p + 1), 128 * static_cast<size_t>(p) + 5, 20011};
  for (AllreduceAlgo algo : algos) {
    for (CommDType dtype : {CommDType::kF32, CommDType::kBF16, CommDType::kF8}) {
      for (size_t count : counts) {
        test_allreduce(comm, algo, dtype, count, /*integer=*/true);
        if (dtype != CommDType::kF32) test_allreduce(comm, algo, dtype, count, false);
      }
    }
    test_against_mpi(comm, algo, 20011);
  }
  for (AlltoallAlgo algo : all_alltoall_algos()) test_alltoallv(comm, algo);
  test_alltoallv(comm, AlltoallAlgo::kAuto);
  test_alltoallv_known_largest(comm);
}

// Arguments: none runs every test; `levels HOSTS` only the host map and its two levels, expecting HOSTS hosts;
// `hosts HOSTS` those and the collectives across hosts: what a run across hosts adds to the runs on one machine.
int main(int argc, char** argv) {
  try {
    Communicator& comm = init();
    g_rank = comm.rank();
    const int p = comm.size();
    if (argc == 3 && std::string_view(argv[1]) == "levels") {
      test_host_levels(comm, std::atoi(argv[2]));
      return report(comm);
    }
    if (argc == 3 && std::string_view(argv[1]) == "hosts") {
      test_host_levels(comm, std::atoi(argv[2]));
      test_across_hosts(comm);
      return report(comm);
    }
    test_init_leaves_the_allocator_alone();
    const std::vector<size_t> counts = {0, 1, static_cast<size_t>(std::max(p - 1, 1)), static_cast<size_t>(p + 1),
                                        1000 * static_cast<size_t>(p) + 3, 128 * static_cast<size_t>(p) + 5,
                                        20011 /* shm two-shot */, 300007 /* several shm segments */};
    // Two-level algorithms on one host are the mesh's two halves: `hosts` runs (fake host maps, tests/cluster)
    // test them where they differ.
    for (AllreduceAlgo algo : all_allreduce_algos()) {
      if (is_hierarchical(algo)) continue;
      for (CommDType dtype : {CommDType::kF32, CommDType::kBF16, CommDType::kF8}) {
        for (size_t count : counts) {
          test_allreduce(comm, algo, dtype, count, /*integer=*/true);
          if (dtype != CommDType::kF32 && count < 100000) test_allreduce(comm, algo, dtype, count, false);
        }
      }
    }
    // Registered memory works with every algorithm; shm reads peers' buffers in place from 2 KB up.
    for (AllreduceAlgo algo : all_allreduce_algos())
      for (size_t count : {size_t{1}, static_cast<size_t>(p + 1), size_t{1001}, size_t{20011}, size_t{300007}})
        if (!is_hierarchical(algo))
        test_allreduce(comm, algo, CommDType::kF32, count, /*integer=*/true, /*registered=*/true);
    test_allreduce(comm, AllreduceAlgo::kShm, CommDType::kF8, 20011, /*integer=*/true, /*registered=*/true);
    for (AlltoallAlgo algo : all_alltoall_algos()) test_alltoallv(comm, algo);
    test_alltoallv(comm, AlltoallAlgo::kAuto);
    test_alltoallv_known_largest(comm);
    test_allreduce(comm, AllreduceAlgo::kAuto, CommDType::kF32, 4099, true);
    test_other_collectives(comm);
    test_groups_and_async(comm);
    test_host_levels(comm, -1);
    return report(comm);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: error: %s\n", g_rank, e.what());
    return 3;
  }
}
