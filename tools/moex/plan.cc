// `moex plan`: predicts each parallel plan's decode throughput, communication share and bytes on the wire for
// a model on a cluster described by a file (tools/lib/planner.h, docs/plan.md), ranked. `moex plan calibrate`
// writes the file for this machine from its probes (and, under mpirun, the links between ranks).
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include <time.h>

#include <nlohmann/json.hpp>

#include "moex/base/cpu.h"
#include "moex/base/error.h"
#include "moex/base/progress.h"
#include "moex/base/threads.h"
#include "moex/comm/communicator.h"
#include "moex/comm/selector.h"
#include "moex/base/dtype.h"
#include "moex/kernels/matmul.h"
#include "moex/kernels/packed.h"
#include "tools/lib/probes.h"
#include "moex/model/gguf.h"
#include "tools/lib/output_dir.h"
#include "tools/lib/planner.h"
#include "tools/lib/synthetic.h"
#include "tools/moex/command.h"
#include "tools/moex/flags.h"

namespace moex::tools {
namespace {

struct PlanFlags {
  std::string model, cluster;
  std::vector<int> ranks;  // empty: 1, 2, 4, ... up to the cluster's devices
  int batch = 16, context = 512;
  std::vector<std::string> weights = {"bf16"};
  std::vector<std::string> comm_dtypes = {"f32"};
  bool json = false;
};

ModelConfig model_config(const std::string& model) {
  if (std::filesystem::is_directory(model) || std::filesystem::exists(model)) return load_checkpoint_config(model);
  for (const std::string& name : synthetic_preset_names())
    if (name == model) return synthetic_preset(model);
  std::string list;
  for (const std::string& name : synthetic_preset_names()) list += (list.empty() ? "" : ", ") + name;
  throw_error(ErrorKind::kInvalidInput, "--model " + model + ": neither a checkpoint nor a preset (" + list + ")");
}

nlohmann::json to_json(const plan::Prediction& p) {
  nlohmann::json cols = nlohmann::json::array();
  for (const plan::CollectiveCost& c : p.collectives)
    cols.push_back({{"what", c.what}, {"algorithm", c.algorithm}, {"bytes", c.bytes}, {"per_step", c.per_step},
                    {"seconds", c.seconds}, {"wire_bytes", c.wire_bytes}, {"crosses_hosts", c.crosses_hosts},
                    {"link_bytes", c.link_bytes}, {"burst_credit_seconds_per_step", c.burst_credit_s}});
  return {{"plan", p.plan.name()}, {"moe", p.plan.moe}, {"attn", p.plan.attn}, {"tp", p.plan.tp}, {"ep", p.plan.ep},
          {"ranks", p.ranks}, {"weights", p.plan.weights}, {"comm_dtype", p.plan.comm_dtype},
          {"step_seconds", p.step_s}, {"tokens_per_s", p.tokens_per_s}, {"comm_share", p.comm_share},
          {"attention_seconds", p.attention_s}, {"routing_seconds", p.routing_s}, {"experts_seconds", p.experts_s},
          {"other_seconds", p.other_s}, {"comm_seconds", p.comm_s}, {"logits_seconds", p.logits_s}, {"wait_seconds", p.wait_s},
          {"imbalance_wait_seconds", p.imbalance_wait_s}, {"longest_segment_seconds", p.longest_segment_s},
          {"wire_share", p.wire_share}, {"time_share", p.time_share}, {"wire_bytes_per_token", p.wire_bytes_per_token},
          {"device_bytes", p.device_bytes}, {"fits", p.fits}, {"expert_imbalance", p.expert_imbalance},
          {"collectives", cols}};
}

void run_plan(const PlanFlags& f) {
  const ModelConfig model = model_config(f.model);
  const plan::Cluster cluster = plan::load_cluster(f.cluster);
  const int devices = cluster.hosts * cluster.devices_per_host;
  std::vector<int> ranks = f.ranks;
  if (ranks.empty())
    for (int n = 1; n <= devices; n *= 2) ranks.push_back(n);
  for (int n : ranks)
    MOEX_CHECK_INPUT(n <= devices, "--ranks ", n, ": cluster \"", cluster.name, "\" has ", devices, " devices");
  const plan::Workload work{f.batch, f.context};
  std::vector<plan::Prediction> rows;
  for (int n : ranks)
    for (const std::string& w : f.weights)
      for (const std::string& dt : f.comm_dtypes)
        for (const plan::PlanChoice& p : plan::candidate_plans(model, n, w, dt))
          rows.push_back(plan::predict(model, cluster, p, n, work));
  MOEX_CHECK_INPUT(!rows.empty(), "no plan of ", f.model, " runs on the ranks asked for");
  std::stable_sort(rows.begin(), rows.end(), [](const plan::Prediction& a, const plan::Prediction& b) {
    if (a.fits != b.fits) return a.fits;
    return a.tokens_per_s > b.tokens_per_s;
  });
  if (f.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const plan::Prediction& p : rows) out.push_back(to_json(p));
    std::printf("%s\n", nlohmann::json{{"model", f.model}, {"cluster", cluster.name}, {"batch", f.batch},
                                        {"context", f.context}, {"plans", out}}
                            .dump(1)
                            .c_str());
    return;
  }
  std::printf("moex plan: %s on %s (%d host%s x %d %s), decode batch %d, context %d\n", f.model.c_str(),
              cluster.name.c_str(), cluster.hosts, cluster.hosts > 1 ? "s" : "", cluster.devices_per_host,
              cluster.device.name.c_str(), f.batch, f.context);
  std::printf("%-3s %-20s %5s %-9s %-4s %10s %8s %9s %9s %9s %9s %9s %12s %10s  %s\n", "#", "plan", "ranks", "weights", "comm",
              "tokens/s", "comm %", "attn ms", "route ms", "expert ms", "wire ms", "wait ms", "wire B/tok", "per device",
              "collectives (algorithm the cost model picks)");
  int i = 0;
  for (const plan::Prediction& p : rows) {
    std::string cols;
    for (const plan::CollectiveCost& c : p.collectives)
      cols += (cols.empty() ? "" : ", ") + c.what + " " + c.algorithm + (c.crosses_hosts ? " (inter-host)" : "");
    std::printf("%-3d %-20s %5d %-9s %-4s %10.1f %7.1f%% %9.2f %9.3f %9.2f %9.3f %9.3f %12s %10s  %s%s\n", ++i,
                p.plan.name().c_str(), p.ranks, p.plan.weights.c_str(), p.plan.comm_dtype.c_str(), p.tokens_per_s,
                100 * p.comm_share, p.attention_s * 1e3, p.routing_s * 1e3, p.experts_s * 1e3, p.comm_s * 1e3, p.wait_s * 1e3,
                bytes_text(p.wire_bytes_per_token).c_str(), bytes_text(p.device_bytes).c_str(),
                p.fits ? "" : "DOES NOT FIT; ", cols.empty() ? "-" : cols.c_str());
  }
}

// ---- calibrate ------------------------------------------------------------------------------------------------

struct CalibrateFlags {
  std::string out;
  bool force = false;
  bool time_sharing = false;
  double message_kb = 4;     // --time-sharing: the all-reduce after each segment
  int devices_per_host = 0;  // 0: the cores
};

// "AMD EPYC (family 25 model 17)": every calibrated figure names the CPU it came from.
std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, name = "unknown CPU", family, model;
  const auto value = [](const std::string& l) { return l.substr(l.find(':') + 2); };
  while (std::getline(in, line) && (name == "unknown CPU" || family.empty() || model.empty())) {
    if (line.rfind("model name", 0) == 0) name = value(line);
    else if (line.rfind("cpu family", 0) == 0) family = value(line);
    else if (line.rfind("model\t", 0) == 0) model = value(line);
  }
  return name + " (family " + family + " model " + model + ")";
}

nlohmann::json fig(double value, const std::string& source) { return {{"value", value}, {"source", source}}; }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The fastest tenth's boundary: a link's own time, where the median of a loaded machine's round trips also holds
// the scheduler's delays (which the time-sharing wait table prices, so they must not enter the link too).
double fast_tenth(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 10];
}

// Seconds of `fn` on this rank's threads, by their CPU time: the thread's own when a rank runs one thread, the
// process's shared over its threads otherwise (`fn` keeps all of them busy). Other processes sharing the cores
// then do not count: the file describes the device, not the machine's load. Memory traffic of others still
// slows the reads, as it would the engine's.
template <typename Fn>
double timed(Fn&& fn) {
  const int threads = num_threads();
  const clockid_t clock = threads == 1 ? CLOCK_THREAD_CPUTIME_ID : CLOCK_PROCESS_CPUTIME_ID;
  timespec a{}, b{};
  clock_gettime(clock, &a);
  fn();
  clock_gettime(clock, &b);
  return (double(b.tv_sec - a.tv_sec) + 1e-9 * double(b.tv_nsec - a.tv_nsec)) / threads;
}

// One format's matmul as the engine runs it, on this rank's threads, at each decode token count: two shapes of
// the same weights, [4096 x 4096] and [16384 x 1024], four distinct matrices of each called in turn (128 MB in
// bf16, so a call reads memory, not a last-level cache holding the previous one; a working set as large as a
// model's reads at the same rate). Their difference gives the cost per output row, the rest the cost per
// weight (planner.h, KernelTable): medians.
constexpr int kTableTokens[] = {1, 4, 16, 64};
struct KernelPoint {
  int tokens = 0;
  double per_weight_s = 0, per_row_s = 0;
};
struct KernelRates {
  double bytes_per_s = 0, flops = 0;  // the 1-token read rate and the 128-token arithmetic on [4096 x 4096]
  std::vector<KernelPoint> table;
};
KernelRates kernel_rates(const std::string& format) {
  constexpr int64_t kWeights = 4096 * 4096, kMany = 128;
  constexpr int kMatrices = 4;
  struct Shape2 {
    int64_t rows, cols;
  };
  const Shape2 shapes[] = {{4096, 4096}, {16384, 1024}};
  std::vector<float> x(kMany * 4096, 0.25f), y(kMany * 16384);
  KernelRates r;
  std::vector<std::vector<double>> seconds(2);  // [shape][token count index]
  for (int s = 0; s < 2; ++s) {
    const Shape2 sh = shapes[s];
    std::vector<std::vector<uint16_t>> w(kMatrices, std::vector<uint16_t>(kWeights));
    std::vector<TensorView> views;
    std::vector<std::shared_ptr<kernels::PackedWeights>> packed(kMatrices);
    for (int m = 0; m < kMatrices; ++m) {
      for (size_t i = 0; i < w[m].size(); ++i)
        w[m][i] = f32_to_bf16(static_cast<float>(((i + 7919 * m) * 2654435761u) % 1000) * 1e-3f - 0.5f);
      views.push_back(TensorView{w[m].data(), DType::kBF16, Shape{sh.rows, sh.cols}});
      const TensorView& view = views.back();
      const auto keep = [&](kernels::QuantizedMatrix q) { packed[m] = std::make_shared<kernels::PackedWeights>(kernels::pack(q)); };
      // Grouped formats at g32 (what the planner's int4 rows price), symmetric as a load quantizes.
      if (const auto f = kernels::weight_format_from_name(format)) keep(kernels::quantize(view, *f, 32, true));
    }
    const auto time = [&](int64_t rows, int reps) {
      std::vector<double> t;
      for (int rep = 0; rep < reps; ++rep) {
        const int m = rep % kMatrices;
        t.push_back(timed([&] {
          if (packed[m]) kernels::packed_matmul(x.data(), rows, *packed[m], y.data());
          else kernels::matmul(x.data(), rows, views[m], y.data());  // as-stored: the f32-activation loop over bf16
        }));
      }
      return median(t);
    };
    for (int tokens : kTableTokens) seconds[s].push_back(time(tokens, tokens >= 16 ? 8 : 16));
    if (s == 0) {
      r.bytes_per_s = (packed[0] ? double(packed[0]->weight_bytes()) : double(views[0].bytes())) / seconds[0][0];
      r.flops = 2.0 * kMany * kWeights / time(kMany, 8);
    }
  }
  for (size_t i = 0; i < std::size(kTableTokens); ++i) {
    // t = rows * per_row + weights * per_weight for both shapes (same weights): solve, per_row at least 0.
    const double per_row = std::max(0.0, (seconds[1][i] - seconds[0][i]) / double(shapes[1].rows - shapes[0].rows));
    const double per_weight = std::max(0.0, (seconds[0][i] + seconds[1][i] - per_row * double(shapes[0].rows + shapes[1].rows)) /
                                                (2.0 * kWeights));
    r.table.push_back({kTableTokens[i], per_weight, per_row});
  }
  return r;
}

// One call's floor: a 1-row bf16 call over 64 x 64, median.
double call_seconds() {
  std::vector<float> w(64 * 64, 0.5f), x(64, 0.25f), y(64);
  const kernels::PackedWeights tiny = kernels::pack(kernels::quantize_bf16(TensorView{w.data(), DType::kF32, Shape{64, 64}}));
  std::vector<double> t;
  for (int r = 0; r < 201; ++r) t.push_back(timed([&] { kernels::packed_matmul(x.data(), 1, tiny, y.data()); }));
  return median(t);
}

// Hosts that are one machine: network namespaces on one VM (scripts/cluster.sh) are hosts to MPI, but their
// ranks share its cores and its memory. Ranks whose /proc/sys/kernel/random/boot_id equals rank 0's run on rank 0's
// machine; `hosts` counts the topology's hosts among them, `ranks` the ranks. Every rank takes part.
struct SharedMachine {
  int hosts = 1, ranks = 1;
};
SharedMachine shared_machine(comm::Communicator& world) {
  constexpr size_t kId = 40;
  std::array<char, kId> mine{};
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  // Without a boot_id (not Linux) every rank counts as its own machine's: nothing is divided.
  if (id.empty()) id = "rank " + std::to_string(world.rank());
  std::copy_n(id.begin(), std::min(id.size(), kId - 1), mine.begin());
  std::vector<char> all(kId * world.size());
  world.allgather(mine.data(), kId, all.data());
  const comm::Topology& topo = world.topology();
  SharedMachine out{0, 0};
  std::vector<bool> host_seen(std::max(1, topo.hosts()), false);
  for (int r = 0; r < world.size(); ++r) {
    if (std::memcmp(all.data() + r * kId, all.data(), kId) != 0) continue;
    ++out.ranks;
    const int h = topo.host_of_rank.empty() ? 0 : topo.host_of_rank[r];
    if (!host_seen[h]) host_seen[h] = true, ++out.hosts;
  }
  return out;
}

// Round trip between rank 0 and `peer` (ping-pong of `bytes`), the fastest tenth of `reps`: alpha + bytes / rate
// each way.
// With `idle_s`, every rank sleeps that long before each round trip (a shaped link's bucket fills meanwhile).
double ping_pong(comm::Communicator& world, int peer, size_t bytes, int reps, double idle_s = 0) {
  std::vector<char> buf(std::max<size_t>(bytes, 1));
  std::vector<double> t;
  const int me = world.rank();
  for (int r = 0; r < reps; ++r) {
    world.barrier();
    if (idle_s > 0) {
      std::this_thread::sleep_for(std::chrono::duration<double>(idle_s));
      world.barrier();
    }
    const auto start = std::chrono::steady_clock::now();
    if (me == 0) {
      comm::P2PRequest s = world.isend(buf.data(), bytes, peer, 7);
      world.wait_all(std::span(&s, 1));
      comm::P2PRequest q = world.irecv(buf.data(), bytes, peer, 8);
      world.wait_all(std::span(&q, 1));
    } else if (me == peer) {
      comm::P2PRequest q = world.irecv(buf.data(), bytes, 0, 7);
      world.wait_all(std::span(&q, 1));
      comm::P2PRequest s = world.isend(buf.data(), bytes, 0, 8);
      world.wait_all(std::span(&s, 1));
    }
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return fast_tenth(t);
}

// alpha from 8 B round trips. A shaped link (tbf) lets a bucket of bytes through at once after it idled, so its rate
// is two sizes apart: back to back, 4 MB each way finds its direction's bucket full again (it refilled while the
// other direction moved its 4 MB), and so does 1 MB after an idle spell; each way t / 2 = alpha + (size - burst) /
// rate, whence the rate from the difference and the burst (0 for a link without a bucket, up to noise).
nlohmann::json measure_link(comm::Communicator& world, int peer, const std::string& what, bool bucket) {
  constexpr size_t kLarge = 4 << 20, kMid = 1 << 20;
  // Rank 0's times on every rank: they decide what runs next, and every rank must run it.
  double times[2] = {ping_pong(world, peer, 8, 201), ping_pong(world, peer, kLarge, 21)};
  world.broadcast(times, sizeof times, 0);
  const double small = times[0], large = times[1];
  const double alpha = small / 2;
  double rate = kLarge / std::max(large / 2 - alpha, 1e-9), burst = 0;
  if (large <= small) {
    // 4 MB no slower than 8 B: the scheduler, not the link, set these times (more ranks than cores on a loaded
    // machine). The defaults say less that is wrong than such a figure would.
    const comm::CostModel m;
    const std::string src = "comm::CostModel defaults (docs/comm.md): calibrate's ping-pong rank 0 <-> rank " +
                            std::to_string(peer) + " (" + what + ") timed 4 MB no slower than 8 B, the scheduler's doing";
    return {{"latency_us", fig((bucket ? m.inter_alpha_s : m.alpha_s) * 1e6, src)},
            {"bandwidth_GBps", fig(1e-9 / (bucket ? m.inter_beta_s_per_byte : m.beta_s_per_byte), src)},
            {"reduce_GBps", fig(1e-9 / m.gamma_s_per_byte, src)}};
  }
  const std::string how = "moex plan calibrate: ping-pong rank 0 <-> rank " + std::to_string(peer) + " (" + what +
                          "), fastest tenth of the round trips; 8 B -> latency, ";
  nlohmann::json out = {{"latency_us", fig(alpha * 1e6, how + "latency")},
                        {"reduce_GBps", fig(10, "comm::CostModel's default gamma (docs/comm.md), not measured")}};
  if (bucket) {
    // Idle long enough to refill a bucket of 1 MB at the back-to-back rate (20-150 ms: below TCP's 200 ms minimum
    // retransmission timeout, after which an idle connection would restart from a small congestion window).
    const double idle = std::clamp(2.0 * kMid / rate, 0.02, 0.15);
    double mid = ping_pong(world, peer, kMid, 11, idle);
    world.broadcast(&mid, sizeof mid, 0);
    if (large > mid) rate = double(kLarge - kMid) / ((large - mid) / 2);
    burst = std::clamp(double(kMid) - (mid / 2 - alpha) * rate, 0.0, double(kMid));
    out["burst_KB"] = fig(burst / 1e3, how + "4 MB back to back and 1 MB after " + std::to_string(std::lround(idle * 1e3)) +
                                           " ms idle -> bucket (what passes at once after an idle spell)");
    out["bandwidth_GBps"] = fig(rate / 1e9, how + "the difference of 4 MB back to back and 1 MB after an idle spell -> "
                                                  "bandwidth beyond the bucket");
  } else {
    out["bandwidth_GBps"] = fig(rate / 1e9, how + "4 MB -> bandwidth");
  }
  return out;
}

// Ranks sharing the cores (planner.h, Cluster::TimeSharing), under mpirun with N ranks, each one thread: the
// decode step's pattern, compute segments of the same length on every rank (as TP gives), each followed by an
// all-reduce of --message-KB (the step's own size: its cost on the cores, TCP's across hosts, grows with it), at each
// segment length of kSegmentMs (the model's segments between collectives run from none, back to back, through a
// fraction of a millisecond at batch 1 to tens at large batches). A segment is 1-row as-stored matmuls over distinct
// [512 x 1024] weights in turn (64 MB a rank, more than the last-level cache: memory-bound, as decode is). Per
// length, the mean over ranks of the CPU time of a segment and of the wall time inside one all-reduce give a point
// of the wait table; slowdown = wall time / (max(1, ranks per core) x the segments' CPU time), mean over ranks;
// busy_slowdown the same for ranks computing while the others wait (below).
// The point for this ranks-per-core ratio replaces any earlier one in the existing --out file.
void run_time_sharing(const CalibrateFlags& f) {
  comm::Communicator& world = comm::world();
  const int n = world.size(), cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const SharedMachine machine = shared_machine(world);
  // Every rank checks, so that none is left waiting in a collective for a rank 0 that stopped.
  MOEX_CHECK_INPUT(std::filesystem::exists(f.out), "--out ", f.out,
                   ": --time-sharing adds to a file `moex plan calibrate` wrote; it does not exist");
  nlohmann::json j;
  if (world.rank() == 0) {
    std::ifstream in(f.out);
    MOEX_CHECK_INPUT(in.good(), "--out ", f.out, ": cannot read it");
    try {
      j = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      throw_error(ErrorKind::kInvalidInput, "--out " + f.out + ": not JSON (" + e.what() + ")");
    }
  }
  set_num_threads(1);
  constexpr int64_t kRows = 512, kCols = 1024;
  constexpr int kMatrices = 64;
  // 0: back to back, no compute between two collectives (dp attention's dispatch after its counts, planner.cc).
  constexpr double kSegmentMs[] = {0, 0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32};
  constexpr double kCpuPerLength = 0.3;  // seconds of segments per length and rank
  std::vector<std::vector<uint16_t>> w(kMatrices);
  std::vector<TensorView> views;
  for (int m = 0; m < kMatrices; ++m) {
    w[m].resize(kRows * kCols);
    for (size_t i = 0; i < w[m].size(); ++i) w[m][i] = f32_to_bf16(static_cast<float>((i * 2654435761u + m) % 1000) * 1e-6f);
    views.push_back(TensorView{w[m].data(), DType::kBF16, Shape{kRows, kCols}});
  }
  std::vector<float> x(kCols, 0.25f), y(kRows),
      sum(std::max<size_t>(1, static_cast<size_t>(std::lround(f.message_kb * 1e3 / 4))), 1.0f);
  // Every rank on rank 0's machine reads one clock (CLOCK_MONOTONIC is the kernel's, network namespaces or not):
  // then an all-reduce's own time is measured as it runs after each segment, from the last rank's arrival to this
  // rank's return, and the wait is the time before that arrival.
  const bool one_clock = machine.ranks == n;
  const auto cpu_now = [] {
    timespec t{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
  };
  const auto wall_now = [] { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); };
  int next = 0;
  const auto call = [&] { kernels::matmul(x.data(), 1, views[next++ % kMatrices], y.data()); };
  // One call's CPU time, the mean over ranks, so that every rank runs the same number of calls per segment.
  for (int i = 0; i < 2 * kMatrices; ++i) call();
  std::vector<double> one;
  for (int i = 0; i < 64; ++i) {
    const double c0 = cpu_now();
    call();
    one.push_back(cpu_now() - c0);
  }
  std::vector<float> call_s = {static_cast<float>(median(one))};
  world.allreduce(call_s.data(), 1, comm::CommDType::kF32);
  const double per_call = call_s[0] / n;
  // The all-reduce's own time, with no compute before it: the fastest tenth of back-to-back calls. A wait is the
  // time inside the all-reduce beyond its own, since the planner prices the wire itself from the links (across
  // hosts an all-reduce over TCP is tens of microseconds, over a shaped link hundreds: not a wait). With one clock
  // (above) the own time is measured instead as each call runs after its segment: back to back, a shaped link's
  // bucket is empty, while after a segment it has refilled, so the bare call's time is not what the calls after
  // segments spend on the wire (subtracted, it gave a slowdown below 1 over a shaped link).
  double bare = 0;
  {
    std::vector<double> t;
    for (int i = 0; i < 400; ++i) {
      const double t0 = wall_now();
      world.allreduce(sum.data(), sum.size(), comm::CommDType::kF32);
      t.push_back(wall_now() - t0);
    }
    std::vector<float> b = {static_cast<float>(fast_tenth(t))};
    world.allreduce(b.data(), 1, comm::CommDType::kF32);
    bare = b[0] / n;
  }
  // Per length: [segment CPU seconds, wait seconds per all-reduce, own seconds per all-reduce]; then the whole
  // run's wall and CPU time.
  std::vector<float> stats;
  double cpu_all = 0, wall_all = 0;
  std::vector<double> enter, leave, all_enter;
  for (double ms : kSegmentMs) {
    const int calls = ms > 0 ? std::max(1, static_cast<int>(std::lround(ms * 1e-3 / per_call))) : 0;
    const int iterations = calls > 0 ? std::clamp(static_cast<int>(kCpuPerLength / (calls * per_call)), 30, 1000) : 400;
    double cpu = 0, inside = 0;
    enter.assign(iterations, 0), leave.assign(iterations, 0);
    world.barrier();
    const double start = wall_now();
    for (int it = 0; it < iterations; ++it) {
      const double c0 = cpu_now();
      for (int c = 0; c < calls; ++c) call();
      cpu += cpu_now() - c0;
      enter[it] = wall_now();
      world.allreduce(sum.data(), sum.size(), comm::CommDType::kF32);
      leave[it] = wall_now();
      inside += leave[it] - enter[it];
    }
    const double wall = wall_now() - start;
    double own = bare * iterations;
    if (one_clock) {
      all_enter.resize(static_cast<size_t>(n) * iterations);
      world.allgather(enter.data(), iterations * sizeof(double), all_enter.data());
      own = 0;
      for (int it = 0; it < iterations; ++it) {
        double last = enter[it];
        for (int r = 0; r < n; ++r) last = std::max(last, all_enter[static_cast<size_t>(r) * iterations + it]);
        own += std::max(0.0, leave[it] - last);
      }
    }
    if (calls > 0) {  // the slowdown is of compute: back-to-back calls have none
      wall_all += wall - own;  // the wire is the links' to price, not the cores'.
      cpu_all += cpu;
    }
    stats.push_back(static_cast<float>(cpu / iterations));
    stats.push_back(static_cast<float>(std::max(0.0, (inside - own) / iterations)));
    stats.push_back(static_cast<float>(own / iterations));
  }
  // Ranks per core of rank 0's machine: the ranks of every host on it (namespaces on one VM share its cores).
  const double ratio = double(machine.ranks) / cores;
  stats.push_back(static_cast<float>(wall_all / (std::max(1.0, ratio) * cpu_all)));
  // Unequal work (EP's experts at small batches, dp attention's own sequences): each iteration half the ranks,
  // in turn, compute a segment of kBusyMs while the others go straight into the all-reduce and wait there
  // (spinning, then yielding: communicator.cc). The busy ranks' wall time over their CPU time is how fast a rank
  // runs while the others wait, which with more ranks than cores is not a core of its own.
  constexpr double kBusyMs = 2;
  {
    const int calls = std::max(1, static_cast<int>(std::lround(kBusyMs * 1e-3 / per_call)));
    const int iterations = std::clamp(static_cast<int>(2 * kCpuPerLength / (calls * per_call)), 30, 1000);
    double cpu = 0, wall = 0;
    world.barrier();
    for (int it = 0; it < iterations; ++it) {
      if (n == 1 || (world.rank() + it) % 2 == 0) {
        const double w0 = wall_now(), c0 = cpu_now();
        for (int c = 0; c < calls; ++c) call();
        cpu += cpu_now() - c0;
        wall += wall_now() - w0;
      }
      world.allreduce(sum.data(), sum.size(), comm::CommDType::kF32);
    }
    stats.push_back(static_cast<float>(wall / std::max(cpu, 1e-9)));
  }
  world.allreduce(stats.data(), stats.size(), comm::CommDType::kF32);
  if (world.rank() != 0) return;
  for (float& v : stats) v /= n;
  const double busy_slowdown = stats.back();
  const double slowdown = stats[stats.size() - 2];
  char kb[32];
  std::snprintf(kb, sizeof kb, "%g KB", f.message_kb);
  const std::string own_how =
      one_clock ? "its own time as it ran after the segment (from the last rank's arrival, one clock: every rank on rank "
                  "0's machine) and the wait before that"
                : "the wall time inside it less its own (" + std::to_string(std::lround(bare * 1e6)) +
                      " us: the fastest tenth of back-to-back calls)";
  const std::string src = "moex plan calibrate --time-sharing on " + cpu_name() + ": " + std::to_string(machine.ranks) +
                          " ranks on " + std::to_string(cores) + " cores (of " + std::to_string(n) + " in the job), one thread "
                          "each; per segment length, segments of 1-row as-stored "
                          "[512 x 1024] calls over 64 distinct weights in turn, each followed by a " + kb + " all-reduce; " +
                          own_how + ", mean over the ranks";
  nlohmann::json points = nlohmann::json::array();
  std::string summary;
  for (size_t i = 0; i < std::size(kSegmentMs); ++i) {
    // The back-to-back point's segment is the loop's own few nanoseconds; the file needs lengths above 0.
    const double seg = std::max<double>(stats[3 * i], 1e-9), wait = stats[3 * i + 1], own = stats[3 * i + 2];
    // Its own time beyond the bare call's: with ranks sharing cores, each round of the algorithm waits for its ranks'
    // turns on the cores (and across hosts for the network stack's work on them), which grows with the message.
    points.push_back({{"segment_us", seg * 1e6}, {"wait_us", wait * 1e6}, {"allreduce_us", own * 1e6},
                      {"excess_us", std::max(0.0, own - bare) * 1e6}});
    char line[128];
    std::snprintf(line, sizeof line, "%s%.2f ms: %.0f us (%.1f%%; own %.0f us)", summary.empty() ? "" : ", ", seg * 1e3,
                  wait * 1e6, 100 * wait / (seg * std::max(1.0, ratio) * slowdown + wait), own * 1e6);
    summary += line;
  }
  nlohmann::json list = nlohmann::json::array();
  if (j.contains("time_sharing") && j["time_sharing"].is_array())
    for (const nlohmann::json& e : j["time_sharing"])
      if (!(e.contains("ranks_per_core") && e["ranks_per_core"].contains("value") && e["ranks_per_core"]["value"] == ratio))
        list.push_back(e);
  const std::string busy_src = "moex plan calibrate --time-sharing on " + cpu_name() + ": " + std::to_string(n) +
                               " ranks in the job, " + std::to_string(machine.ranks) + " on " + std::to_string(cores) +
                               " cores, one thread each; half the ranks in turn "
                               "compute a 2 ms segment (as above) while the others wait in the all-reduce after it; "
                               "the busy ranks' wall time / CPU time, mean over the ranks";
  list.push_back({{"ranks_per_core", fig(ratio, src)}, {"slowdown", fig(slowdown, src)},
                  {"busy_slowdown", fig(busy_slowdown, busy_src)}, {"wait", {{"points", points}, {"source", src}}}});
  std::sort(list.begin(), list.end(), [](const nlohmann::json& a, const nlohmann::json& b) {
    return a["ranks_per_core"]["value"].get<double>() < b["ranks_per_core"]["value"].get<double>();
  });
  j["time_sharing"] = list;
  StagingFile file(std::filesystem::path(f.out), "calibrate");
  {
    std::ofstream o(file.path());
    o << j.dump(2) << "\n";
    MOEX_CHECK_INPUT(o.good(), "--out ", f.out, ": cannot write");
  }
  file.publish();
  std::printf("moex plan calibrate --time-sharing: %d ranks on %d cores: slowdown %.2f (%.2f while half wait); a bare "
              "%s all-reduce %.0f us back to back; wait per all-reduce after a segment of %s; added to %s\n", machine.ranks,
              cores, slowdown, busy_slowdown, kb, bare * 1e6, summary.c_str(), f.out.c_str());
}

void run_calibrate(const CalibrateFlags& f) {
  comm::Communicator& world = comm::world();
  const std::filesystem::path out = f.out;
  if (world.rank() == 0)
    MOEX_CHECK_INPUT(f.force || !std::filesystem::exists(out), "--out ", f.out, " exists: give --force to replace it");
  const int machine_cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // Hosts on one machine (namespaces) share its cores, its read rate and its memory: each is given its share, so
  // that a file of 2 such hosts of 2 ranks prices 4 ranks on 2 cores, not one a core.
  const SharedMachine machine = shared_machine(world);
  const int cores = std::max(1, machine_cores / machine.hosts);
  const int devices = f.devices_per_host > 0 ? f.devices_per_host : cores;
  const int threads = std::max(1, cores / devices);
  // Links first (every rank takes part), then the probes on rank 0 alone.
  nlohmann::json links = nlohmann::json::object();
  const comm::Topology& topo = world.topology();
  if (world.size() > 1) {
    int same = -1, other = -1;
    for (int r = 1; r < world.size(); ++r) {
      if (topo.host_of_rank[r] == topo.host_of_rank[0]) { if (same < 0) same = r; }
      else if (other < 0) other = r;
    }
    if (same > 0) links["intra_host"] = measure_link(world, same, "same host", false);
    if (other > 0) links["inter_host"] = measure_link(world, other, "another host", true);
  }
  if (world.rank() != 0) return;
  if (!links.contains("intra_host")) {
    const comm::CostModel m;
    const std::string src = "comm::CostModel defaults (docs/comm.md), not measured: run calibrate under mpirun -n 2";
    links["intra_host"] = {{"latency_us", fig(m.alpha_s * 1e6, src)}, {"bandwidth_GBps", fig(1e-9 / m.beta_s_per_byte, src)},
                           {"reduce_GBps", fig(1e-9 / m.gamma_s_per_byte, src)}};
  }
  // Streaming reads of 1 GB, median of 5: all cores at once (the host's rate, shared by its ranks), and one
  // rank's threads alone; a rank reads at the smaller of its own rate and its share of the host's.
  std::vector<char> buf(size_t{1} << 30, 1);
  const auto read_rate = [&] {
    std::vector<double> t;
    for (int r = 0; r < 5; ++r)
      t.push_back(timed([&] {
        volatile float s = kernels::stream_read(buf.data(), buf.size());
        (void)s;
      }));
    return buf.size() / median(t);
  };
  set_num_threads(machine_cores);
  const double host_read = read_rate() / machine.hosts;
  set_num_threads(threads);
  const double rank_read = read_rate();
  buf = {};
  const double bf16 = kernels::dot_peak_bf16(1 << 22, true).per_second;
  const double vnni = kernels::dot_peak_vnni(1 << 22, true).per_second;
  const double f32 = kernels::fma_peak_f32(1 << 22, true).per_second;
  const KernelRates k = kernel_rates("bf16");
  const double call_s = call_seconds();
  const double device_read = std::min(rank_read, host_read / std::min(devices, cores));
  const double memory_efficiency = std::min(1.0, k.bytes_per_s / rank_read);
  const std::string cpu = cpu_name();
  const std::string probe = "moex plan calibrate on " + cpu + ": ";
  const std::string clock = "CPU time";
  const std::string shared = machine.hosts > 1 ? ", divided by the " + std::to_string(machine.hosts) +
                                                     " hosts on this machine (same boot_id)"
                                               : "";
  const std::string probe_all_cores = probe + "stream_read probe of 1 GB on all " + std::to_string(machine_cores) +
                                      " cores, by their CPU time, median of 5" + shared;
  nlohmann::json j;
  j["name"] = "this machine (" + std::to_string(cores) + " cores, " + std::to_string(devices) + " ranks of " +
              std::to_string(threads) + " thread" + (threads > 1 ? "s" : "") + ")";
  j["hosts"] = std::max(1, topo.hosts());
  j["devices_per_host"] = devices;
  j["cores_per_host"] = cores;
  j["hosts_per_machine"] = fig(machine.hosts, probe + "hosts of the job whose ranks have rank 0's boot_id: they share its " +
                                                  std::to_string(machine_cores) + " cores, read rate and memory");
  j["shared_memory_collectives"] = true;
  j["host_read_GBps"] = fig(host_read / 1e9, probe_all_cores);
  const double total_memory = [] {
    std::ifstream in("/proc/meminfo");
    std::string key;
    double kb = 0;
    while (in >> key >> kb)
      if (key == "MemTotal:") return kb * 1024;
    return 0.0;
  }();
  j["device"] = {
      {"name", "CPU rank"},
      {"memory_GB", fig(total_memory / machine.hosts / devices / 1e9, probe + "/proc/meminfo MemTotal / devices" + shared)},
      {"read_GBps", fig(rank_read / 1e9, probe + "stream_read probe of 1 GB on one rank's " + std::to_string(threads) +
                                             " thread(s) alone, by CPU time, median of 5")},
      {"bf16_TFLOPS", fig(bf16 / 1e12, probe + "vdpbf16ps probe per rank (its threads, CPU clock)")},
      {"int8_TOPS", fig(vnni / 1e12, probe + "vpdpbusd probe per rank (its threads, CPU clock)")},
      {"f32_TFLOPS", fig(f32 / 1e12, probe + "vfmadd231ps probe per rank (its threads, CPU clock)")},
      {"memory_efficiency", fig(memory_efficiency, probe + "bf16 packed_matmul, 1 row over four 4096 x 4096 in turn, on one rank's threads, "
                                                           "against the read probe on the same threads (the KV cache's read; "
                                                           "the matmuls use kernel_tables)")},
      {"compute_efficiency", fig(bf16 > 0 ? std::min(1.0, k.flops / bf16) : 1.0,
                                 probe + "bf16 packed_matmul, 128 rows over 4096 x 4096, against the vdpbf16ps probe")},
      {"op_overhead_us", fig(call_s * 1e6, probe + "bf16 packed_matmul of 1 row over 64 x 64, median")}};
  // Each format's own kernels, timed at the decode token counts (planner.h, KernelTable).
  nlohmann::json tables = nlohmann::json::object();
  for (const std::string format : {"as-stored", "bf16", "int8", "int8-w8a8", "int4", "int4-w4a8", "fp8"}) {
    const KernelRates r = format == "bf16" ? k : kernel_rates(format);
    nlohmann::json points = nlohmann::json::array();
    for (const KernelPoint& p : r.table)
      points.push_back({{"tokens", p.tokens}, {"per_weight_ns", p.per_weight_s * 1e9}, {"per_row_ns", p.per_row_s * 1e9}});
    tables[format] = {{"points", points},
                      {"source", probe + format + " kernel on " + std::to_string(threads) + " thread(s), " + clock +
                                     ": four distinct [4096 x 4096] and four [16384 x 1024] weights in turn, median per "
                                     "token count; per row = the difference of the two shapes' times / 12288 rows"}};
  }
  j["device"]["kernel_tables"] = tables;
  j["links"] = links;
  StagingFile file(out, "calibrate");
  {
    std::ofstream o(file.path());
    o << j.dump(2) << "\n";
    MOEX_CHECK_INPUT(o.good(), "--out ", f.out, ": cannot write");
  }
  file.publish();
  std::printf("moex plan calibrate: wrote %s (read %.1f GB/s per rank, bf16 %.2f TFLOPS, decode %.0f%%, GEMM %.0f%%)\n",
              f.out.c_str(), device_read / 1e9, bf16 / 1e12, 100 * memory_efficiency,
              bf16 > 0 ? 100 * std::min(1.0, k.flops / bf16) : 100.0);
}

void setup_plan(CLI::App& app) {
  auto f = std::make_shared<PlanFlags>();
  auto* cmd = app.add_subcommand("plan", "Predict each parallel plan's decode throughput and communication share on a cluster");
  cmd->add_option("--model", f->model, "Checkpoint folder or file, or a gen-model preset (mixtral-8x7b, ...)");
  cmd->add_option("--cluster", f->cluster, "Cluster file (docs/plan.md; `moex plan calibrate` writes one for this machine)");
  add_list_flag(cmd, "--ranks", f->ranks, "Rank counts to plan for (default 1, 2, 4, ... up to the cluster's devices)")
      ->check(whole_number_in(1, 1 << 16));
  cmd->add_option("--batch", f->batch, "Sequences decoding together")->check(whole_number_in(1, 1 << 16))->capture_default_str();
  cmd->add_option("--context", f->context, "Positions each sequence's attention reads")
      ->check(whole_number_in(1, 1 << 24))
      ->capture_default_str();
  add_list_flag(cmd, "--weights", f->weights, "Weight formats: as-stored, bf16, int8, int8-w8a8, int4, int4-w4a8, fp8")
      ->check(CLI::IsMember({"as-stored", "bf16", "int8", "int8-w8a8", "int4", "int4-w4a8", "fp8"}));
  add_list_flag(cmd, "--comm-dtype", f->comm_dtypes, "Activation dtypes between ranks: f32, bf16, fp8")
      ->check(CLI::IsMember(kCommDTypeNames));
  cmd->add_flag("--json", f->json, "Machine-readable output");
  auto c = std::make_shared<CalibrateFlags>();
  auto* cal = cmd->add_subcommand("calibrate", "Measure this machine (run under mpirun for its links) and write a cluster file");
  add_output_flag(cal, "--out", c->out, "Cluster file to write")->required();
  cal->add_flag("--force", c->force, "Replace --out if it exists");
  cal->add_option("--devices-per-host", c->devices_per_host, "Ranks per host the file describes (default: one per core)")
      ->check(whole_number_in(1, 1 << 12));
  cal->add_flag("--time-sharing", c->time_sharing,
                "Under mpirun -n N: measure how N one-thread ranks share the cores (slowdown of equal work and of a rank others "
                "wait for, wait in collectives) and add it to the existing --out file");
  cal->add_option("--message-KB", c->message_kb,
                  "With --time-sharing: the all-reduce after each segment (the step's own: d x batch x the comm dtype's "
                  "bytes)")
      ->check(CLI::Range(0.004, 65536.0))
      ->capture_default_str();
  cal->callback([c] {
    if (c->time_sharing) run_time_sharing(*c);
    else run_calibrate(*c);
  });
  cmd->callback([cmd, f] {
    if (!cmd->got_subcommand("calibrate")) {
      MOEX_CHECK_INPUT(!f->model.empty() && !f->cluster.empty(), "moex plan needs --model and --cluster (or: moex plan calibrate --out FILE)");
      run_plan(*f);
    }
  });
}
MOEX_REGISTER_COMMAND(setup_plan);

}  // namespace
}  // namespace moex::tools
