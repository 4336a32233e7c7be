// `moex plan`: a model of a decode step, to predict a deployment before it exists. For a model's geometry,
// a cluster (devices, hosts, links) and a parallel plan it adds up, per rank and per layer, what the step
// must do: the bytes each rank reads and the arithmetic it does (each matmul bound by whichever of the two
// takes longer on its device), the routed experts' imbalance across EP ranks (sampled), and the collectives
// the plan sends, each priced by the communicator's own alpha-beta model (comm/selector.h) with the
// algorithm that model would pick. It knows nothing the engine does not: a step is the sum of its parts,
// with no overlap except what --overlap does. docs/plan.md lists what it leaves out.
#pragma once
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "moex/model/config.h"

namespace moex::tools::plan {

// A format's matmul as timed on the device (`moex plan calibrate`): for each token count, the seconds per weight
// and per output row of one call, so that t(tokens, N x K) = N * per_row + N * K * per_weight. The row term is
// the kernel's fixed work per output (a horizontal sum, a loop's start); it is why an as-stored [3584 x 1024]
// matrix reads at two thirds of the rate of a [4096 x 4096] one. Token counts between two measured ones are
// interpolated linearly, beyond the last extrapolated from the last two.
struct KernelTable {
  std::vector<double> tokens, per_weight_s, per_row_s;
  double seconds(double rows, double n_out, double k_in) const;
};

// One accelerator or one CPU rank. Rates are what one device reaches while every device of its host runs.
struct Device {
  std::string name;
  double memory_bytes = 0;         // capacity (weights + KV cache must fit)
  double read_bytes_per_s = 0;     // streaming read rate
  double bf16_flops = 0;           // dot-product peaks by activation type (FLOP/s; int8: OP/s)
  double int8_ops = 0;
  double f32_flops = 0;
  double memory_efficiency = 1;    // share of read_bytes_per_s the engine's decode kernels reach
  double compute_efficiency = 1;   // share of the peaks its GEMMs reach
  // The same per weight format where measured (`moex plan calibrate` times each format's own kernels):
  // format name -> {memory, compute}; a format not listed takes the two above.
  std::map<std::string, std::pair<double, double>> format_efficiency;
  // Measured matmul tables by format; a format with a table is priced by it (and the host's read rate as a
  // floor), one without by the rates and efficiencies above.
  std::map<std::string, KernelTable> kernel_tables;
  double op_overhead_s = 0;        // fixed cost of one matmul call (a parallel region, a launch)
};

// A level of the network: alpha-beta-gamma as comm::CostModel takes them.
struct Link {
  double alpha_s = 0;             // per message
  double bytes_per_s = 0;         // per byte moved (1 / beta)
  double reduce_bytes_per_s = 0;  // per byte reduced (1 / gamma)
  // A shaped link's token bucket (tc's tbf: scripts/cluster.sh --rate): after an idle spell this many bytes pass
  // at once, beyond the rate; 0 for a link without one. The bucket refills at the rate while the ranks compute, so
  // a collective after a compute segment of `s` seconds moves min(burst, s x rate) of its bytes for free.
  double burst_bytes = 0;
};

struct Cluster {
  std::string name;
  int hosts = 1;
  int devices_per_host = 1;
  // A CPU host: ranks share its cores; more ranks than cores time-share them (0: devices are separate chips).
  int cores_per_host = 0;
  // A CPU host's read rate with every core reading (0: none given): its ranks share it, each reading at most
  // device.read_bytes_per_s.
  double host_read_bytes_per_s = 0;
  bool shared_memory_collectives = false;  // ranks of one host may use the shm all-reduce
  // Ranks sharing a CPU host's cores, measured (`moex plan calibrate --time-sharing` under mpirun -n N): at
  // `ranks_per_core`, a step's compute takes max(1, ranks_per_core) x slowdown of one rank's alone (where the ranks'
  // work is the same; the busiest of unequal ones runs while the others yield, planner.cc), and a rank that
  // computed `segment_s` (its CPU time) since the last collective spends `wait` of wall time inside the next one,
  // waiting for ranks the scheduler has not run yet or ran later (wait_s(segment): linear between the measured
  // segment lengths, the nearest one's outside them; calibrate measures 0.125-32 ms). Linear in
  // ranks_per_core between measured points, the nearest one's outside them; (1, 1, no wait) is the first point when
  // none is measured at or below one rank per core; without any point, slowdown 1 and no wait.
  // busy_slowdown: wall over CPU time of a rank computing while others wait in the collective for it (they spin,
  // then yield; calibrate measures it with half the ranks busy); prices the busiest rank of unequal work (EP's
  // experts, dp attention's sequences). A file without it takes `slowdown`.
  struct TimeSharing {
    double ranks_per_core = 1, slowdown = 1, busy_slowdown = 1;
    std::vector<double> segment_s, wait_s;  // increasing segment lengths; empty: no wait
    // The collective's own time after such a segment beyond its time back to back (the wire, which the links
    // price): the rounds of the algorithm waiting for their ranks' turns on the cores. Step time, not overlapped by
    // compute. Empty (files before it was measured, whose wait held it): none.
    std::vector<double> excess_s;
    double wait(double segment) const;
    double excess(double segment) const;
  };
  std::vector<TimeSharing> time_sharing;
  Device device;
  Link intra, inter;  // inside a host; between hosts (unused with one host)
};

// Reads and checks a cluster file (docs/plan.md: every figure is {"value": x, "source": "..."}). Throws
// Error(kInvalidInput) with one line naming the field.
Cluster load_cluster(const std::string& path);
Cluster parse_cluster(const nlohmann::json& j, const std::string& origin);

struct Workload {
  int batch = 1;      // sequences decoding together (one token each per step)
  int context = 512;  // positions each sequence's attention reads
  // An engine whose dp-attention dispatch path agrees on the largest block by an 8-byte all-reduce before each
  // of its three all-to-alls (six collectives a MoE layer, four back to back; this tree's moe_layer.cc sends the
  // block with the counts: three, one back to back). The recordings of tests/plan measured before that change
  // are predicted with it (planner_test.cc; docs/plan.md says which).
  bool dispatch_size_agreements = false;
};

struct PlanChoice {
  std::string moe = "tp";   // tp | ep | tpxep
  std::string attn = "tp";  // tp | dp
  int tp = 1, ep = 1;       // MoE split: tp * ep = ranks
  std::string weights = "bf16";  // as-stored | bf16 | int8 | int8-w8a8 | int4 | int4-w4a8 | fp8 (experts and dense)
  std::string comm_dtype = "f32";
  int group = 32;            // int4 group size
  std::string name() const;  // "EP=4 dp-attn bf16"
};

struct CollectiveCost {
  std::string what;       // "attention all-reduce", "MoE all-reduce", "dispatch all-to-all", ...
  std::string algorithm;  // the one the cost model picks
  double bytes = 0;       // the payload each rank contributes
  int per_step = 0;       // calls per decode step
  double seconds = 0;     // per call
  double wire_bytes = 0;  // bytes each rank sends per call (what the profiler counts as sent)
  bool crosses_hosts = false;
  double link_bytes = 0;  // bytes one host's link carries out per call (across hosts)
  double burst_credit_s = 0;  // per step: what the inter-host link's bucket saves of seconds x per_step
};

struct Prediction {
  PlanChoice plan;
  int ranks = 1;
  double attention_s = 0, routing_s = 0, experts_s = 0, other_s = 0;  // compute of the busiest rank
  double comm_s = 0;   // the collectives themselves (alpha-beta, on the wire), part of the step
  // Under dp attention: every rank's logit rows sent to rank 0 after the forward (point to point, f32 rows of the
  // vocabulary; runtime/engine.cc), part of the step but not of a collective the profiler counts.
  double logits_s = 0;
  // What a rank's profiler counts inside collectives besides the wire: the wait for the slowest rank (expert
  // imbalance under EP; ranks the scheduler ran later, from the time-sharing table at the length of each segment
  // of compute between two collectives). Rank 0's expectation; it is not added to the step (the slowest rank's
  // compute is).
  double wait_s = 0;
  double imbalance_wait_s = 0;  // the part of wait_s that is expert imbalance
  double longest_segment_s = 0;  // the longest compute between two collectives (wall), for the report
  double step_s = 0;
  double tokens_per_s = 0;
  double comm_share = 0;       // (comm_s + wait_s) / step_s: what the profiler attributes to collectives
  double wire_share = 0;       // comm_s / step_s
  double wire_bytes_per_token = 0;       // bytes one rank sends per generated token, all layers
  double device_bytes = 0;               // weights + KV cache one rank holds
  bool fits = true;
  double expert_imbalance = 1;           // busiest EP rank's expert time / mean (1 without EP)
  double time_share = 1;                 // each part's factor for ranks sharing cores (1 on separate devices)
  std::vector<CollectiveCost> collectives;
};

// Every plan `ranks` can run for this model (the engine's own constraints, moe/parallel_plan.h), in `weights`.
std::vector<PlanChoice> candidate_plans(const ModelConfig& model, int ranks, const std::string& weights,
                                        const std::string& comm_dtype);
// Throws Error(kInvalidInput) when the plan cannot run (splits, ranks beyond the cluster).
Prediction predict(const ModelConfig& model, const Cluster& cluster, const PlanChoice& plan, int ranks,
                   const Workload& workload);

}  // namespace moex::tools::plan
