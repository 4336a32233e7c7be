#include "moex/moe/parallel_plan.h"

#include "moex/base/error.h"

namespace moex {

std::string ParallelPlan::describe() const {
  std::string moe_name = moe == MoEParallel::kTP ? "moe tp=" + std::to_string(tp)
                         : moe == MoEParallel::kEP ? "moe ep=" + std::to_string(ep)
                                                   : "moe tp=" + std::to_string(tp) + " x ep=" + std::to_string(ep);
  return moe_name + ", attention " + (attn == AttnParallel::kTP ? "tp" : "dp") + ", comm " +
         std::string(comm::comm_dtype_name(comm_dtype)) + (overlap ? ", overlap" : "");
}

AutoMoE resolve_auto_moe(const PlanShape& s, int world, const comm::Topology* t) {
  if (world <= 1 || t == nullptr || t->ranks() != world || t->hosts() <= 1 || !t->uniform()) return {"tp", 0, 0};
  const int hosts = t->hosts(), per_host = world / hosts;
  for (int r = 0; r < world; ++r)
    if (t->host_of_rank[r] != r / per_host) return {"tp", 0, 0};  // a TP group would span hosts
  if (s.experts % hosts != 0 || s.intermediate % per_host != 0) return {"tp", 0, 0};
  if (per_host == 1) return {"ep", 1, hosts};
  return {"tpxep", per_host, hosts};
}

ParallelPlan make_parallel_plan(const PlanRequest& request, const PlanShape& s, int world, int rank,
                                const comm::Topology* topology) {
  PlanRequest r = request;
  if (r.moe == "auto") {
    if (r.attn == "dp") {
      r.moe = "ep";  // tokens reach their experts by all-to-all: the one MoE plan attention DP runs with
    } else if (r.tp || r.ep) {
      r.moe = "tpxep";  // sizes given: the hybrid with those sizes (tp = world is plain TP)
    } else {
      const AutoMoE a = resolve_auto_moe(s, world, topology);
      r.moe = a.moe;
      r.tp = a.tp;
      r.ep = a.ep;
    }
  }
  ParallelPlan p;
  p.world = world;
  p.rank = rank;
  p.overlap = r.overlap;
  const auto dtype = comm::comm_dtype_from_name(r.comm_dtype);
  MOEX_CHECK_INPUT(dtype.has_value(), "unknown --comm-dtype \"", r.comm_dtype, "\" (valid: f32, bf16, fp8)");
  p.comm_dtype = *dtype;
  if (r.attn == "tp") p.attn = AttnParallel::kTP;
  else if (r.attn == "dp") p.attn = AttnParallel::kDP;
  else throw_error(ErrorKind::kInvalidInput, "unknown --attn-parallel \"" + r.attn + "\" (valid: tp, dp)");

  if (r.moe == "tp") {
    p.moe = MoEParallel::kTP;
    p.tp = r.tp ? r.tp : world;
    p.ep = r.ep ? r.ep : 1;
  } else if (r.moe == "ep") {
    p.moe = MoEParallel::kEP;
    p.ep = r.ep ? r.ep : world;
    p.tp = r.tp ? r.tp : 1;
  } else if (r.moe == "tpxep") {
    p.moe = MoEParallel::kTPxEP;
    p.tp = r.tp ? r.tp : (r.ep ? world / r.ep : 2);
    p.ep = r.ep ? r.ep : world / p.tp;
  } else {
    throw_error(ErrorKind::kInvalidInput, "unknown --moe-parallel \"" + r.moe + "\" (valid: auto, tp, ep, tpxep)");
  }
  MOEX_CHECK_INPUT(p.tp >= 1 && p.ep >= 1 && p.tp * p.ep == world, "--tp ", p.tp, " x --ep ", p.ep,
                   " must equal the number of ranks (", world, ")");
  MOEX_CHECK_INPUT(p.moe != MoEParallel::kTP || p.ep == 1, "--moe-parallel tp needs --ep 1");
  MOEX_CHECK_INPUT(p.moe != MoEParallel::kEP || p.tp == 1, "--moe-parallel ep needs --tp 1");
  MOEX_CHECK_INPUT(s.experts % p.ep == 0, s.experts, " experts cannot be split evenly over ", p.ep,
                   " EP ranks (choose --ep dividing ", s.experts, ")");
  MOEX_CHECK_INPUT(s.intermediate % p.tp == 0, "intermediate_size ", s.intermediate, " cannot be split evenly over ",
                   p.tp, " TP ranks");
  if (p.attn == AttnParallel::kTP) {
    MOEX_CHECK_INPUT(s.heads % world == 0, s.heads, " attention heads cannot be split over ", world,
                     " ranks (attention TP needs heads divisible by the number of ranks; try --attn-parallel dp)");
    MOEX_CHECK_INPUT(s.kv_heads % world == 0 || world % s.kv_heads == 0, s.kv_heads, " KV heads cannot be split or ",
                     "replicated evenly over ", world, " ranks");
  } else {
    MOEX_CHECK_INPUT(p.moe == MoEParallel::kEP || world == 1,
                     "--attn-parallel dp needs --moe-parallel ep (tokens reach their experts by all-to-all)");
  }
  return p;
}

ExpertRange local_experts(const ParallelPlan& p, int experts) {
  const int per_rank = experts / p.ep;
  return {p.ep_rank() * per_rank, per_rank};
}

SliceRange local_intermediate(const ParallelPlan& p, int64_t intermediate) {
  const int64_t per_rank = intermediate / p.tp;
  return {p.tp_rank() * per_rank, (p.tp_rank() + 1) * per_rank};
}

SliceRange local_heads(const ParallelPlan& p, int heads) {
  if (p.attn == AttnParallel::kDP) return {0, heads};
  const int per_rank = heads / p.world;
  return {p.rank * per_rank, (p.rank + 1) * per_rank};
}

SliceRange local_kv_heads(const ParallelPlan& p, int heads, int kv_heads) {
  if (p.attn == AttnParallel::kDP) return {0, kv_heads};
  const SliceRange q = local_heads(p, heads);
  const int group = heads / kv_heads;  // query heads per KV head
  return {q.begin / group, (q.end + group - 1) / group};
}

}  // namespace moex
