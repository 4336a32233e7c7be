#include "moex/comm/types.h"

#include <array>
#include <memory>
#include <mutex>
#include <utility>

namespace moex::comm {
namespace {

template <typename Enum>
struct NamedValue {
  std::string_view name;
  Enum value;
};

constexpr NamedValue<CommDType> kDTypes[] = {
    {"f32", CommDType::kF32}, {"bf16", CommDType::kBF16}, {"fp8", CommDType::kF8}};
constexpr NamedValue<Collective> kCollectives[] = {
    {"allreduce", Collective::kAllreduce}, {"alltoall", Collective::kAlltoall},
    {"allgather", Collective::kAllgather}, {"reduce_scatter", Collective::kReduceScatter},
    {"broadcast", Collective::kBroadcast}};
constexpr NamedValue<AllreduceAlgo> kAllreduceAlgos[] = {
    {"ring", AllreduceAlgo::kRing}, {"rd", AllreduceAlgo::kRecursiveDoubling},
    {"rabenseifner", AllreduceAlgo::kRabenseifner}, {"nhr", AllreduceAlgo::kNhr},
    {"mesh", AllreduceAlgo::kMesh}, {"shm", AllreduceAlgo::kShm}, {"mpi", AllreduceAlgo::kMpi},
    {"hier", AllreduceAlgo::kHier}, {"hier-ring", AllreduceAlgo::kHierRing},
    {"hier-rd", AllreduceAlgo::kHierRecursiveDoubling}, {"hier-rabenseifner", AllreduceAlgo::kHierRabenseifner},
    {"hier-nhr", AllreduceAlgo::kHierNhr}, {"auto", AllreduceAlgo::kAuto}};
constexpr NamedValue<AlltoallAlgo> kAlltoallAlgos[] = {
    {"pairwise", AlltoallAlgo::kPairwise}, {"bruck", AlltoallAlgo::kBruck}, {"mpi", AlltoallAlgo::kMpi},
    {"hier", AlltoallAlgo::kHier}, {"auto", AlltoallAlgo::kAuto}};

constexpr std::array<AllreduceAlgo, 11> kConcreteAllreduce = {
    AllreduceAlgo::kRing,     AllreduceAlgo::kRecursiveDoubling,     AllreduceAlgo::kRabenseifner,
    AllreduceAlgo::kNhr,      AllreduceAlgo::kMesh,                  AllreduceAlgo::kShm,
    AllreduceAlgo::kMpi,      AllreduceAlgo::kHierRing,              AllreduceAlgo::kHierRecursiveDoubling,
    AllreduceAlgo::kHierRabenseifner, AllreduceAlgo::kHierNhr};
// Two-level algorithm <-> the flat algorithm it runs between hosts.
constexpr std::pair<AllreduceAlgo, AllreduceAlgo> kHierInter[] = {
    {AllreduceAlgo::kHierRing, AllreduceAlgo::kRing},
    {AllreduceAlgo::kHierRecursiveDoubling, AllreduceAlgo::kRecursiveDoubling},
    {AllreduceAlgo::kHierRabenseifner, AllreduceAlgo::kRabenseifner},
    {AllreduceAlgo::kHierNhr, AllreduceAlgo::kNhr}};
constexpr std::array<AlltoallAlgo, 4> kConcreteAlltoall = {AlltoallAlgo::kPairwise, AlltoallAlgo::kBruck,
                                                           AlltoallAlgo::kMpi, AlltoallAlgo::kHier};

template <typename Enum, size_t N>
std::string_view name_of(const NamedValue<Enum> (&table)[N], Enum value) {
  for (const auto& entry : table)
    if (entry.value == value) return entry.name;
  return "?";
}
template <typename Enum, size_t N>
std::optional<Enum> value_of(const NamedValue<Enum> (&table)[N], std::string_view name) {
  for (const auto& entry : table)
    if (entry.name == name) return entry.value;
  return std::nullopt;
}
template <typename Enum, size_t N>
std::string names_of(const NamedValue<Enum> (&table)[N]) {
  std::string out;
  for (const auto& entry : table) out += (out.empty() ? "" : ", ") + std::string(entry.name);
  return out;
}

std::mutex g_observer_mutex;
std::shared_ptr<const EventObserver> g_observer;  // swapped whole so notify never holds the lock while calling

}  // namespace

std::string_view comm_dtype_name(CommDType dtype) { return name_of(kDTypes, dtype); }
std::optional<CommDType> comm_dtype_from_name(std::string_view name) { return value_of(kDTypes, name); }
size_t comm_dtype_buffer_size(CommDType dtype) { return dtype == CommDType::kBF16 ? 2 : 4; }
std::string_view collective_name(Collective collective) { return name_of(kCollectives, collective); }
std::optional<Collective> collective_from_name(std::string_view name) { return value_of(kCollectives, name); }
std::string_view algo_name(AllreduceAlgo algo) { return name_of(kAllreduceAlgos, algo); }
std::string_view algo_name(AlltoallAlgo algo) { return name_of(kAlltoallAlgos, algo); }
std::optional<AllreduceAlgo> allreduce_algo_from_name(std::string_view name) {
  return value_of(kAllreduceAlgos, name);
}
std::optional<AlltoallAlgo> alltoall_algo_from_name(std::string_view name) {
  return value_of(kAlltoallAlgos, name);
}
std::span<const AllreduceAlgo> all_allreduce_algos() { return kConcreteAllreduce; }
std::span<const AlltoallAlgo> all_alltoall_algos() { return kConcreteAlltoall; }
bool is_hierarchical(AllreduceAlgo algo) {
  for (const auto& [hier, inter] : kHierInter)
    if (hier == algo) return true;
  return false;
}
AllreduceAlgo inter_host_algo(AllreduceAlgo algo) {
  if (algo == AllreduceAlgo::kHier) return AllreduceAlgo::kAuto;
  for (const auto& [hier, inter] : kHierInter)
    if (hier == algo) return inter;
  return algo;
}
AllreduceAlgo hierarchical_of(AllreduceAlgo inter) {
  for (const auto& [hier, flat] : kHierInter)
    if (flat == inter) return hier;
  return AllreduceAlgo::kAuto;
}
std::string allreduce_algo_names() { return names_of(kAllreduceAlgos); }
std::string alltoall_algo_names() { return names_of(kAlltoallAlgos); }

void set_event_observer(EventObserver observer) {
  auto next = observer ? std::make_shared<const EventObserver>(std::move(observer)) : nullptr;
  std::lock_guard lock(g_observer_mutex);
  g_observer = std::move(next);
}

bool has_event_observer() {
  std::lock_guard lock(g_observer_mutex);
  return g_observer != nullptr;
}

void notify_event(const CollectiveEvent& event) {
  std::shared_ptr<const EventObserver> observer;
  {
    std::lock_guard lock(g_observer_mutex);
    observer = g_observer;
  }
  if (observer) (*observer)(event);
}

}  // namespace moex::comm
