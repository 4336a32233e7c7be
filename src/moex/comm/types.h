// Names shared by every part of comm: element types on the wire, collectives, algorithms, and the
// event a collective reports to an observer (the profiler, wired in by the engine; comm never includes it).
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace moex::comm {

// What the caller's buffer holds and what travels between ranks. Sums are always taken in fp32.
enum class CommDType : uint8_t {
  kF32,   // fp32 buffer, fp32 on the wire
  kBF16,  // bf16 buffer (uint16_t), bf16 on the wire, fp32 accumulation
  kF8,    // fp32 buffer, FP8 E4M3 + one fp32 scale per 128 elements on the wire
};
std::string_view comm_dtype_name(CommDType dtype);           // "f32", "bf16", "fp8"
std::optional<CommDType> comm_dtype_from_name(std::string_view name);
size_t comm_dtype_buffer_size(CommDType dtype);               // bytes per element of the caller's buffer

enum class Collective : uint8_t { kAllreduce, kAlltoall, kAllgather, kReduceScatter, kBroadcast };
std::string_view collective_name(Collective collective);     // "allreduce", "alltoall", ...
std::optional<Collective> collective_from_name(std::string_view name);

// kHier*: two levels (docs/comm.md "Hierarchical all-reduce"): a reduce-scatter inside each host, an all-reduce
// of each slice between hosts with the named flat algorithm, an all-gather inside each host. kHier lets the
// selector pick the inter-host algorithm; it is resolved to one of the four before anything runs.
enum class AllreduceAlgo : uint8_t {
  kAuto, kRing, kRecursiveDoubling, kRabenseifner, kNhr, kMesh, kShm, kMpi,
  kHier, kHierRing, kHierRecursiveDoubling, kHierRabenseifner, kHierNhr
};
// kHier: per destination host, one message per pair of local ranks (alltoall_hier.cc).
enum class AlltoallAlgo : uint8_t { kAuto, kPairwise, kBruck, kMpi, kHier };

std::string_view algo_name(AllreduceAlgo algo);  // "ring", "rd", ..., "mpi", "hier", "hier-ring", ..., "auto"
std::string_view algo_name(AlltoallAlgo algo);   // "pairwise", "bruck", "mpi", "hier", "auto"
std::optional<AllreduceAlgo> allreduce_algo_from_name(std::string_view name);
std::optional<AlltoallAlgo> alltoall_algo_from_name(std::string_view name);
// Every concrete algorithm (no kAuto, no kHier), in a fixed order: the bench and the tuner iterate these.
std::span<const AllreduceAlgo> all_allreduce_algos();
// kHierRing.. kHierNhr: the two-level all-reduces (kHier, unresolved, is not one).
bool is_hierarchical(AllreduceAlgo algo);
// The flat algorithm a two-level one runs between hosts (kHierNhr -> kNhr); kAuto for kHier; algo itself otherwise.
AllreduceAlgo inter_host_algo(AllreduceAlgo algo);
// kNhr -> kHierNhr (ring, rd, rabenseifner, nhr); kAuto for the others.
AllreduceAlgo hierarchical_of(AllreduceAlgo inter);
std::span<const AlltoallAlgo> all_alltoall_algos();
// "ring, rd, ..." for error messages.
std::string allreduce_algo_names();
std::string alltoall_algo_names();

// One finished collective, as the profiler wants it. Times are std::chrono::steady_clock nanoseconds.
struct CollectiveEvent {
  Collective collective = Collective::kAllreduce;
  std::string_view algorithm;  // a static name: "ring", "pairwise", ...
  CommDType dtype = CommDType::kF32;
  int group_size = 1;
  uint64_t bytes_in = 0;        // the caller's buffer
  uint64_t bytes_sent = 0;      // what this rank put on the wire (or into the shared window)
  uint64_t bytes_received = 0;  // what this rank took off the wire (or out of the shared window)
  int64_t start_ns = 0, end_ns = 0;
  int64_t wait_ns = 0;  // blocked on peers (MPI completion or a shared-memory flag); the rest moved/reduced data
};

using EventObserver = std::function<void(const CollectiveEvent&)>;
// Called on the thread that ran the collective (the progress thread for async ones); pass {} to remove.
void set_event_observer(EventObserver observer);
bool has_event_observer();
void notify_event(const CollectiveEvent& event);

}  // namespace moex::comm
