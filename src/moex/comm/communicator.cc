#include "moex/comm/communicator.h"

#include "moex/comm/codec.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "moex/base/error.h"
#include "moex/base/log.h"
#include "moex/comm/mpi_communicator.h"
#include "moex/comm/selector.h"

namespace moex::comm {
namespace {

std::atomic<bool> g_comm_failed{false};
std::atomic<double> g_timeout_s{-1.0};
bool g_mpi_started_here = false;
MPI_Comm g_error_comm = MPI_COMM_NULL;  // abort_job's messages between failing ranks (job.cc)
std::unique_ptr<Communicator> g_world;
std::mutex g_world_mutex;

double env_double(const char* name, double fallback) {
  const char* text = std::getenv(name);
  if (!text || !*text) return fallback;
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  MOEX_CHECK_INPUT(end && *end == '\0' && value > 0, name, "='", text, "' is not a positive number of seconds");
  return value;
}

// Spin briefly (a peer on another core answers within microseconds), then yield the core: with more
// ranks than cores the peer we wait for may need this very core to make progress.
inline void backoff(uint64_t spins) {
  if (spins < 256) {
    __builtin_ia32_pause();
  } else {
    sched_yield();
  }
}

std::string this_host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

// A size-1 group that never touches MPI: what a rank started without mpirun gets.
class SelfCommunicator final : public Communicator {
 public:
  SelfCommunicator() {
    const int key = 0;
    const std::string name = this_host_name();
    topology_ = make_topology({&key, 1}, {&name, 1});
  }
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string_view backend() const override { return "self"; }
  std::unique_ptr<Communicator> split(int, int) override { return std::make_unique<SelfCommunicator>(); }
  void barrier() override {}
  const Topology& topology() const override { return topology_; }
  void* alloc_registered(size_t bytes) override {
    buffers_.push_back(std::make_unique<std::byte[]>(std::max<size_t>(bytes, 1)));
    return buffers_.back().get();
  }
  void free_registered(void* buffer) override {
    std::erase_if(buffers_, [&](const auto& b) { return b.get() == buffer; });
  }
  P2PRequest isend(const void*, size_t, int peer, int) override { bad_peer(peer); }
  P2PRequest irecv(void*, size_t, int peer, int) override { bad_peer(peer); }
  void wait_all(std::span<P2PRequest>) override {}
  bool test_all(std::span<P2PRequest>) override { return true; }
  void allreduce(void* data, size_t count, CommDType dtype, AllreduceAlgo algo) override {
    // Nothing crosses a wire, so nothing is quantised; the event still reports the call.
    const int64_t now = steady_now_ns();
    CollectiveEvent event{Collective::kAllreduce, algo_name(algo), dtype, 1, count * comm_dtype_buffer_size(dtype),
                          0, 0, now, now, 0};
    if (has_event_observer()) notify_event(event);
  }
  void alltoallv(const void* send, std::span<const size_t> send_counts, std::span<const size_t> send_offsets,
                 void* recv, std::span<const size_t> recv_counts, std::span<const size_t> recv_offsets,
                 size_t elem_bytes, AlltoallAlgo, std::optional<uint64_t> largest_block_bytes) override {
    MOEX_CHECK(send_counts.size() == 1 && recv_counts.size() == 1 && send_counts[0] == recv_counts[0]);
    MOEX_CHECK(!largest_block_bytes || send_counts[0] * elem_bytes <= *largest_block_bytes,
               "alltoallv: this rank's block of ", send_counts[0] * elem_bytes,
               " bytes is larger than the largest block passed, ", *largest_block_bytes);
    std::memmove(static_cast<std::byte*>(recv) + recv_offsets[0] * elem_bytes,
                 static_cast<const std::byte*>(send) + send_offsets[0] * elem_bytes, send_counts[0] * elem_bytes);
  }
  void allgather(const void* send, size_t bytes, void* recv) override {
    if (send != recv) std::memmove(recv, send, bytes);
  }
  void reduce_scatter(const void* send, void* recv, size_t count, CommDType dtype) override {
    if (send != recv) std::memmove(recv, send, count * comm_dtype_buffer_size(dtype));
  }
  void broadcast(void*, size_t, int root) override { bad_peer(root); }
  CommHandle start(std::function<void(Communicator&)> op) override {
    op(*this);  // nothing to overlap with: run now
    return CommHandle::completed();
  }

 private:
  [[noreturn]] static void bad_peer(int peer) {
    throw_error(ErrorKind::kInternal, ::moex::detail::concat("rank ", peer, " does not exist in a group of 1 rank"));
  }
  std::vector<std::unique_ptr<std::byte[]>> buffers_;
  Topology topology_;
};

}  // namespace

Communicator& Communicator::intra_host() {
  make_host_levels();
  return *intra_host_;
}

Communicator& Communicator::inter_host() {
  make_host_levels();
  return *inter_host_;
}

void Communicator::make_host_levels() {
  if (intra_host_) return;
  const Topology& t = topology();
  const int host = t.host_of_rank[rank()];
  intra_host_ = split(host, rank());
  inter_host_ = split(t.local_rank[rank()], host);
}

// ---------------------------------------------------------------------------------------------------
// start-up and shutdown

bool launched_by_mpi_launcher() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS"})
    if (std::getenv(name)) return true;
  return false;
}

double comm_timeout_seconds() {
  double value = g_timeout_s.load();
  if (value <= 0) {
    value = env_double("MOEX_COMM_TIMEOUT", 60.0);
    g_timeout_s.store(value);
  }
  return value;
}

void set_comm_timeout_seconds(double seconds) { g_timeout_s.store(seconds); }

void mark_comm_failed() { g_comm_failed.store(true); }

void throw_comm_error(const std::string& message) {
  mark_comm_failed();
  throw_error(ErrorKind::kComm, message);
}

void allreduce_f32(Communicator& comm, float* data, size_t count, CommDType wire, std::vector<uint16_t>& bf16_scratch) {
  if (wire != CommDType::kBF16) {
    comm.allreduce(data, count, wire);
    return;
  }
  if (bf16_scratch.size() < count) bf16_scratch.resize(count);
  f32_to_bf16_span(data, count, bf16_scratch.data());
  comm.allreduce(bf16_scratch.data(), count, CommDType::kBF16);
  bf16_to_f32_span(bf16_scratch.data(), count, data);
}

void alltoallv_f32(Communicator& comm, const float* send, std::span<const size_t> send_counts,
                   std::span<const size_t> send_offsets, float* recv, std::span<const size_t> recv_counts,
                   std::span<const size_t> recv_offsets, CommDType wire, WireScratch& scratch,
                   std::optional<size_t> largest_block_values) {
  const size_t P = static_cast<size_t>(comm.size());
  MOEX_CHECK(send_counts.size() == P && send_offsets.size() == P && recv_counts.size() == P && recv_offsets.size() == P,
             "alltoallv_f32: counts and offsets for ", P, " ranks");
  const WireFormat format = wire_format_for(wire);
  for (auto* v : {&scratch.send_bytes, &scratch.send_offsets, &scratch.recv_bytes, &scratch.recv_offsets}) v->resize(P);
  size_t send_total = 0, recv_total = 0;
  for (size_t p = 0; p < P; ++p) {
    scratch.send_offsets[p] = send_total;
    scratch.send_bytes[p] = wire_bytes(format, send_counts[p]);
    send_total += scratch.send_bytes[p];
    scratch.recv_offsets[p] = recv_total;
    scratch.recv_bytes[p] = wire_bytes(format, recv_counts[p]);
    recv_total += scratch.recv_bytes[p];
  }
  if (scratch.send.size() < std::max<size_t>(send_total, 1)) scratch.send.resize(std::max<size_t>(send_total, 1));
  if (scratch.recv.size() < std::max<size_t>(recv_total, 1)) scratch.recv.resize(std::max<size_t>(recv_total, 1));
  for (size_t p = 0; p < P; ++p)
    wire_encode(format, send + send_offsets[p], send_counts[p], scratch.send.data() + scratch.send_offsets[p]);
  // wire_bytes grows with the count, so the largest block in values is the largest on the wire.
  std::optional<uint64_t> largest_bytes;
  if (largest_block_values) largest_bytes = wire_bytes(format, *largest_block_values);
  comm.alltoallv(scratch.send.data(), scratch.send_bytes, scratch.send_offsets, scratch.recv.data(), scratch.recv_bytes,
                 scratch.recv_offsets, 1, AlltoallAlgo::kAuto, largest_bytes);
  for (size_t p = 0; p < P; ++p)
    wire_decode(format, scratch.recv.data() + scratch.recv_offsets[p], recv_counts[p], recv + recv_offsets[p]);
}

Communicator& world() {
  std::lock_guard lock(g_world_mutex);
  if (g_world) return *g_world;
  const char* force = std::getenv("MOEX_COMM_FORCE_MPI");
  if (!launched_by_mpi_launcher() && !(force && std::strcmp(force, "1") == 0)) {
    g_world = std::make_unique<SelfCommunicator>();
    return *g_world;
  }
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    // THREAD_MULTIPLE: the progress thread calls MPI while the caller's thread does too (other contexts).
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    g_mpi_started_here = true;
    std::atexit(finalize);
    if (provided < MPI_THREAD_MULTIPLE) MOEX_LOG(kWarn, "MPI gives no MPI_THREAD_MULTIPLE: async collectives run inline");
  }
  MPI_Comm_dup(MPI_COMM_WORLD, &g_error_comm);
  MPI_Comm_set_errhandler(g_error_comm, MPI_ERRORS_RETURN);  // a dead peer must not end the report early
  MPI_Comm world_dup;
  MPI_Comm_dup(MPI_COMM_WORLD, &world_dup);  // our own context: never mixes with other MPI users
  g_world = std::make_unique<MpiCommunicator>(world_dup);
  return *g_world;
}

Communicator& init() { return world(); }

MPI_Comm error_comm() { return g_error_comm; }

void finalize() {
  {
    std::lock_guard lock(g_world_mutex);
    if (!g_comm_failed.load()) g_world.reset();  // after a failure, destructors could wait on dead peers
  }
  if (!g_mpi_started_here) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (g_comm_failed.load()) {
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);  // kills the peers still waiting in a collective
  }
  if (g_error_comm != MPI_COMM_NULL) MPI_Comm_free(&g_error_comm);
  MPI_Finalize();
}

// ---------------------------------------------------------------------------------------------------
// MpiCommunicator: set-up, point-to-point, scratch

static bool mpi_thread_multiple() {
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  return level >= MPI_THREAD_MULTIPLE;
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm) : comm_(comm) {
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);  // errors come back to us, become one clear line
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node_comm_);
  int node_size = 0;
  MPI_Comm_size(node_comm_, &node_size);
  scratch_.resize(4);
  find_topology();
  // A group that spans hosts of a fake map (MOEX_COMM_FAKE_HOSTS) behaves as if it spanned machines: no shm.
  all_on_one_node_ = node_size == size_ && topology_.hosts() == 1;
}

namespace {

// MOEX_COMM_FAKE_HOSTS (tests, benchmarks on one machine): the host of each world rank, as "R" (R consecutive
// world ranks per host) or "h0,h1,..." (one host label per world rank, 0 <= label < world size). Empty when
// unset. Parsed once; a bad value is an input error (exit 2) on every rank.
const std::vector<int>& fake_host_of_world_rank() {
  static const std::vector<int> labels = [] {
    std::vector<int> out;
    const char* text = std::getenv("MOEX_COMM_FAKE_HOSTS");
    if (!text || !*text) return out;
    int world_size = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    const std::string value = text;
    auto bad = [&](const std::string& why) {
      throw_error(ErrorKind::kInvalidInput, ::moex::detail::concat("MOEX_COMM_FAKE_HOSTS='", value, "': ", why,
                                                                 " (R ranks per host, or one host label per rank: 0,0,1,1)"));
    };
    std::vector<long> numbers;
    size_t pos = 0;
    while (pos <= value.size()) {
      const size_t comma = std::min(value.find(',', pos), value.size());
      const std::string item = value.substr(pos, comma - pos);
      char* end = nullptr;
      const long number = std::strtol(item.c_str(), &end, 10);
      if (item.empty() || *end != '\0' || number < 0 || number >= world_size) bad("'" + item + "' is not a number from 0 to " + std::to_string(world_size - 1));
      numbers.push_back(number);
      pos = comma + 1;
    }
    if (numbers.size() == 1) {
      if (numbers[0] < 1) bad("0 ranks per host");
      for (int r = 0; r < world_size; ++r) out.push_back(r / static_cast<int>(numbers[0]));
    } else {
      if (numbers.size() != static_cast<size_t>(world_size))
        bad(::moex::detail::concat(numbers.size(), " labels for ", world_size, " ranks"));
      out.assign(numbers.begin(), numbers.end());
    }
    return out;
  }();
  return labels;
}

}  // namespace

// Every rank contributes its node's lowest rank (node rank 0, as the split above orders by rank: found
// locally by translating groups) and its host name; one all-gather gives every rank the whole map.
void MpiCommunicator::find_topology() {
  MPI_Group node_group, group;
  MPI_Comm_group(node_comm_, &node_group);
  MPI_Comm_group(comm_, &group);
  const int node_root = 0;
  int key = 0;
  MPI_Group_translate_ranks(node_group, 1, &node_root, group, &key);
  MPI_Group_free(&node_group);
  MPI_Group_free(&group);
  struct Entry {
    int key;
    char name[MPI_MAX_PROCESSOR_NAME + 1];
  };
  Entry own{key, {}};
  int length = 0;
  MPI_Get_processor_name(own.name, &length);
  if (const std::vector<int>& fake = fake_host_of_world_rank(); !fake.empty()) {
    int world_rank = 0, world_size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    own.key = key * world_size + fake[world_rank];  // a fake host never joins ranks of two real hosts
    std::snprintf(own.name + length, sizeof(own.name) - length, "/fake%d", fake[world_rank]);
  }
  std::vector<Entry> all(size_);
  stats_ = CollectiveStats{"topology"};
  check(MPI_Allgather(&own, sizeof(Entry), MPI_BYTE, all.data(), sizeof(Entry), MPI_BYTE, comm_), "MPI_Allgather");
  std::vector<int> keys;
  std::vector<std::string> names;
  for (const Entry& e : all) {
    keys.push_back(e.key);
    names.emplace_back(e.name, strnlen(e.name, MPI_MAX_PROCESSOR_NAME));
  }
  topology_ = make_topology(keys, names);
}

MpiCommunicator::~MpiCommunicator() {
  progress_.reset();  // drains started operations first
  async_twin_.reset();
  shm_.reset();
  if (node_comm_ != MPI_COMM_NULL) MPI_Comm_free(&node_comm_);
  if (comm_ != MPI_COMM_WORLD) MPI_Comm_free(&comm_);
}

void MpiCommunicator::check(int rc, const char* call) const {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(rc, text, &length);
  throw_comm_error(::moex::detail::concat(stats_.operation, ": ", call, " failed on rank ", rank_, ": ",
                                  std::string(text, length)));
}

HostLevels MpiCommunicator::host_levels() const {
  HostLevels levels;
  levels.hosts = topology_.hosts();
  levels.ranks_per_host = *std::min_element(topology_.ranks_per_host.begin(), topology_.ranks_per_host.end());
  return levels;
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key) {
  MPI_Comm sub;
  check(MPI_Comm_split(comm_, color, key, &sub), "MPI_Comm_split");
  return std::make_unique<MpiCommunicator>(sub);
}

void MpiCommunicator::barrier() {
  stats_ = CollectiveStats{"barrier"};
  MPI_Request request;
  check(MPI_Ibarrier(comm_, &request), "MPI_Ibarrier");
  wait_collective(request);
}

static_assert(sizeof(MPI_Request) <= sizeof(uint64_t));
static MPI_Request to_mpi(P2PRequest request) {
  MPI_Request out;
  std::memcpy(&out, &request.opaque, sizeof(out));
  return out;
}
static P2PRequest from_mpi(MPI_Request request) {
  P2PRequest out;
  std::memcpy(&out.opaque, &request, sizeof(request));
  return out;
}

P2PRequest MpiCommunicator::isend(const void* data, size_t bytes, int peer, int tag) {
  MOEX_CHECK(bytes <= static_cast<size_t>(INT32_MAX), "message of ", bytes, " bytes: split it below 2 GiB");
  MPI_Request request;
  check(MPI_Isend(data, static_cast<int>(bytes), MPI_BYTE, peer, tag, comm_, &request), "MPI_Isend");
  stats_.bytes_sent += bytes;
  P2PRequest out = from_mpi(request);
  out.peer = peer;
  return out;
}

P2PRequest MpiCommunicator::irecv(void* data, size_t bytes, int peer, int tag) {
  MOEX_CHECK(bytes <= static_cast<size_t>(INT32_MAX), "message of ", bytes, " bytes: split it below 2 GiB");
  MPI_Request request;
  check(MPI_Irecv(data, static_cast<int>(bytes), MPI_BYTE, peer, tag, comm_, &request), "MPI_Irecv");
  stats_.bytes_received += bytes;
  P2PRequest out = from_mpi(request);
  out.peer = peer;
  return out;
}

void MpiCommunicator::wait_all(std::span<P2PRequest> requests) {
  if (requests.empty()) return;
  MPI_Request mpi_requests[64];
  std::vector<MPI_Request> many;
  MPI_Request* handles = mpi_requests;
  if (requests.size() > 64) {
    many.resize(requests.size());
    handles = many.data();
  }
  for (size_t i = 0; i < requests.size(); ++i) handles[i] = to_mpi(requests[i]);
  const int64_t start = steady_now_ns();
  const int64_t limit_ns = static_cast<int64_t>(comm_timeout_seconds() * 1e9);
  for (uint64_t spins = 0;; ++spins) {
    int done = 0;
    check(MPI_Testall(static_cast<int>(requests.size()), handles, &done, MPI_STATUSES_IGNORE), "MPI_Testall");
    if (done) break;
    backoff(spins);
    if ((spins & 1023) == 1023 && steady_now_ns() - start > limit_ns) {
      throw_comm_error(::moex::detail::concat(
          stats_.operation, ": rank ", rank_, " of ", size_, " on host ", topology_.host_name_of(rank_), " waited ",
          comm_timeout_seconds(), " s with no progress from its peers", pending_peers(requests, handles),
          "; a rank has died, stopped or lost its link, or ranks called collectives in different orders "
          "(MOEX_COMM_TIMEOUT sets the limit)"));
    }
  }
  stats_.wait_ns += steady_now_ns() - start;
  for (auto& request : requests) request = from_mpi(MPI_REQUEST_NULL);
}

// " (still waiting for rank 1 on host moex-h1, ...)": the peers of the requests not yet complete (MPI_Testall
// left them all in place), or "" when those are a collective's, whose peers MPI does not say.
std::string MpiCommunicator::pending_peers(std::span<const P2PRequest> requests, MPI_Request* handles) const {
  std::vector<int> peers;
  for (size_t i = 0; i < requests.size(); ++i) {
    int done = 1;
    MPI_Request_get_status(handles[i], &done, MPI_STATUS_IGNORE);
    if (!done && requests[i].peer >= 0 && std::find(peers.begin(), peers.end(), requests[i].peer) == peers.end())
      peers.push_back(requests[i].peer);
  }
  std::string out;
  for (int peer : peers)
    out += ::moex::detail::concat(out.empty() ? " (still waiting for " : ", ", "rank ", peer, " on host ",
                                  topology_.host_name_of(peer));
  return out.empty() ? out : out + ")";
}

void MpiCommunicator::wait_collective(MPI_Request request) {
  P2PRequest handle = from_mpi(request);
  wait_all({&handle, 1});
}

bool MpiCommunicator::test_all(std::span<P2PRequest> requests) {
  std::vector<MPI_Request> handles(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) handles[i] = to_mpi(requests[i]);
  int done = 0;
  check(MPI_Testall(static_cast<int>(handles.size()), handles.data(), &done, MPI_STATUSES_IGNORE), "MPI_Testall");
  if (!done) return false;  // MPI_Testall leaves the requests as they were
  for (auto& request : requests) request = from_mpi(MPI_REQUEST_NULL);
  return true;
}

void MpiCommunicator::sendrecv(const void* send, size_t send_bytes, int dest, void* recv, size_t recv_bytes,
                               int src) {
  P2PRequest requests[2];
  int n = 0;
  if (src >= 0) requests[n++] = irecv(recv, recv_bytes, src, 0);
  if (dest >= 0) requests[n++] = isend(send, send_bytes, dest, 0);
  wait_all({requests, static_cast<size_t>(n)});
}

void* MpiCommunicator::scratch(int slot, size_t bytes) {
  auto& buffer = scratch_[slot];
  if (buffer.size() < bytes) {
    buffer.clear();
    buffer.shrink_to_fit();
    buffer.resize(bytes + bytes / 4);  // headroom so slowly growing sizes do not reallocate every call
  }
  return buffer.data();
}

ShmWindow& MpiCommunicator::shm_window(size_t capacity) {
  MOEX_CHECK(all_on_one_node_, "the shm algorithm needs every rank on one node");
  if (!shm_ || shm_->capacity() < capacity) {
    size_t rounded = 1 << 16;
    while (rounded < capacity) rounded <<= 1;
    if (shm_) shm_->barrier(stats_);  // nobody still reads the old window
    shm_.reset();
    shm_ = std::make_unique<ShmWindow>(node_comm_, rounded);
  }
  return *shm_;
}

CommHandle MpiCommunicator::start(std::function<void(Communicator&)> op) {
  if (!mpi_thread_multiple()) {
    op(*this);
    return CommHandle::completed();
  }
  if (!async_twin_) {  // first start(): collective, so every rank dups here at the same point
    MPI_Comm twin;
    check(MPI_Comm_dup(comm_, &twin), "MPI_Comm_dup");
    async_twin_ = std::make_unique<MpiCommunicator>(twin);
    progress_ = std::make_unique<ProgressThread>();
  }
  MpiCommunicator* twin = async_twin_.get();
  return progress_->submit([twin, op = std::move(op)] { op(*twin); });
}

void* MpiCommunicator::alloc_registered(size_t bytes) {
  if (!all_on_one_node_ || size_ == 1) {
    registered_plain_.push_back(std::make_unique<std::byte[]>(std::max<size_t>(bytes, 1)));
    return registered_plain_.back().get();
  }
  registered_.push_back(std::make_unique<ShmWindow>(node_comm_, std::max<size_t>(bytes, 64)));
  return registered_.back()->slot(rank_);
}

void MpiCommunicator::free_registered(void* buffer) {
  std::erase_if(registered_plain_, [&](const auto& b) { return b.get() == buffer; });
  for (auto it = registered_.begin(); it != registered_.end(); ++it) {
    if ((*it)->slot(rank_) != buffer) continue;
    (*it)->barrier(stats_);  // no peer still reads it
    registered_.erase(it);   // MPI_Win_free: collective
    return;
  }
}

ShmWindow* MpiCommunicator::registered_window(const void* data, size_t bytes, size_t* offset) const {
  const auto* address = static_cast<const std::byte*>(data);
  for (const auto& window : registered_) {
    const std::byte* base = window->slot(rank_);
    if (address >= base && address + bytes <= base + window->capacity()) {
      *offset = static_cast<size_t>(address - base);
      return window.get();
    }
  }
  return nullptr;
}

// ---------------------------------------------------------------------------------------------------
// ShmWindow

namespace {
constexpr size_t kCacheLine = 64;
constexpr size_t kControlBytes = 4096;  // two flag lines, padded to a page so data slots stay aligned
}  // namespace

ShmWindow::ShmWindow(MPI_Comm node_comm, size_t capacity) : capacity_(capacity) {
  MPI_Comm_rank(node_comm, &rank_);
  MPI_Comm_size(node_comm, &size_);
  std::byte* own = nullptr;
  MPI_Info info;
  MPI_Info_create(&info);
  MPI_Info_set(info, "alloc_shared_noncontig", "true");  // each rank's part on its own pages (first touch)
  const int rc = MPI_Win_allocate_shared(static_cast<MPI_Aint>(kControlBytes + capacity), 1, info, node_comm, &own,
                                         &window_);
  MPI_Info_free(&info);
  if (rc != MPI_SUCCESS)
    throw_comm_error(::moex::detail::concat("MPI_Win_allocate_shared of ", capacity, " bytes per rank failed"));
  std::memset(own, 0, kControlBytes);
  slots_.resize(size_);
  flags_.resize(size_);
  posts_.resize(size_);
  for (int peer = 0; peer < size_; ++peer) {
    MPI_Aint size = 0;
    int disp_unit = 0;
    std::byte* base = nullptr;
    MPI_Win_shared_query(window_, peer, &size, &disp_unit, &base);
    flags_[peer] = reinterpret_cast<uint64_t*>(base);
    posts_[peer] = reinterpret_cast<uint64_t*>(base + kCacheLine);
    slots_[peer] = base + kControlBytes;
  }
  MPI_Barrier(node_comm);  // every rank's flags are zeroed before anyone uses them
}

ShmWindow::~ShmWindow() {
  if (window_ != MPI_WIN_NULL) MPI_Win_free(&window_);
}

void ShmWindow::barrier(CollectiveStats& stats) {
  const uint64_t epoch = next_epoch();
  std::atomic_ref<uint64_t>(*flags_[rank_]).store(epoch, std::memory_order_release);
  const int64_t start = steady_now_ns();
  for (int peer = 0; peer < size_; ++peer) {
    std::atomic_ref<uint64_t> flag(*flags_[peer]);
    for (uint64_t spins = 0; flag.load(std::memory_order_acquire) < epoch; ++spins) {
      backoff(spins);
      if ((spins & 4095) == 4095 && steady_now_ns() - start > static_cast<int64_t>(comm_timeout_seconds() * 1e9))
        throw_comm_error(::moex::detail::concat(stats.operation, ": rank ", rank_, " waited ", comm_timeout_seconds(),
                                        " s for node rank ", peer,
                                        " at a shared-memory barrier; that rank has died or is stuck"));
    }
  }
  stats.wait_ns += steady_now_ns() - start;
}

void ShmWindow::post(uint64_t value) {
  std::atomic_ref<uint64_t>(*posts_[rank_]).store(value, std::memory_order_release);
}

void ShmWindow::wait_for(int peer, uint64_t value, CollectiveStats& stats) {
  const int64_t start = steady_now_ns();
  std::atomic_ref<uint64_t> flag(*posts_[peer]);
  for (uint64_t spins = 0; flag.load(std::memory_order_acquire) < value; ++spins) {
    backoff(spins);
    if ((spins & 4095) == 4095 && steady_now_ns() - start > static_cast<int64_t>(comm_timeout_seconds() * 1e9))
      throw_comm_error(::moex::detail::concat(stats.operation, ": rank ", rank_, " waited ", comm_timeout_seconds(),
                                      " s for node rank ", peer, " in a shared-memory copy"));
  }
  stats.wait_ns += steady_now_ns() - start;
}

}  // namespace moex::comm
