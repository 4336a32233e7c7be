#include "moex/moe/eplb.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"

namespace moex::eplb {

void Placement::index() {
  MOEX_CHECK_INPUT(experts > 0 && ranks > 0 && slots_per_rank > 0, "expert placement: experts, ranks and slots per rank must be positive");
  MOEX_CHECK_INPUT(static_cast<int64_t>(slot_expert.size()) == int64_t{ranks} * slots_per_rank, "expert placement: ",
                   slot_expert.size(), " slots, expected ranks x slots per rank = ", int64_t{ranks} * slots_per_rank);
  replica_offsets.assign(experts + 1, 0);
  for (int32_t e : slot_expert) {
    MOEX_CHECK_INPUT(e >= 0 && e < experts, "expert placement: slot holds expert ", e, ", outside [0, ", experts, ")");
    ++replica_offsets[e + 1];
  }
  for (int e = 0; e < experts; ++e) {
    MOEX_CHECK_INPUT(replica_offsets[e + 1] > 0, "expert placement: expert ", e, " has no replica");
    replica_offsets[e + 1] += replica_offsets[e];
  }
  replica_slots.resize(slot_expert.size());
  std::vector<int32_t> cursor(replica_offsets.begin(), replica_offsets.end() - 1);
  for (size_t s = 0; s < slot_expert.size(); ++s) replica_slots[cursor[slot_expert[s]]++] = static_cast<int32_t>(s);
}

Placement block_placement(int experts, int ranks) {
  MOEX_CHECK_INPUT(ranks > 0 && experts % ranks == 0, "expert placement: ", experts, " experts do not split over ", ranks, " ranks");
  Placement p;
  p.experts = experts;
  p.ranks = ranks;
  p.slots_per_rank = experts / ranks;
  p.slot_expert.resize(experts);
  std::iota(p.slot_expert.begin(), p.slot_expert.end(), 0);
  p.index();
  return p;
}

namespace {

// Replica counts for `slots` slots: one each, then every extra one to the expert whose load per replica is the
// largest. This minimises the largest load per replica (each step lowers the current maximum, and no count
// vector with the same total can have a smaller one).
std::vector<int> replicate(const std::vector<double>& load, int slots) {
  const int E = static_cast<int>(load.size());
  std::vector<int> count(E, 1);
  for (int extra = slots - E; extra > 0; --extra) {
    int best = 0;
    for (int e = 1; e < E; ++e)
      if (load[e] * count[best] > load[best] * count[e]) best = e;  // load[e]/count[e] > load[best]/count[best]
    ++count[best];
  }
  return count;
}

struct Item {
  int expert;
  double weight;
};

// Items onto `bins` bins of exactly `capacity` items each (items.size() == bins * capacity): heaviest first, each
// to the lightest bin that has room (ties: the lower bin), then pairwise swaps between the heaviest bin and any
// other while one lowers the heavier of the two. Returns the bin of each item.
std::vector<int> pack_bins(const std::vector<Item>& items, int bins, int capacity) {
  const int n = static_cast<int>(items.size());
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return items[a].weight > items[b].weight; });
  std::vector<int> bin_of(n, -1), used(bins, 0);
  std::vector<double> total(bins, 0.0);
  for (int i : order) {
    int best = -1;
    for (int b = 0; b < bins; ++b)
      if (used[b] < capacity && (best < 0 || total[b] < total[best])) best = b;
    bin_of[i] = best;
    ++used[best];
    total[best] += items[i].weight;
  }
  // Swaps: bounded, each strictly lowers the pair's maximum.
  for (int round = 0; round < 4 * n; ++round) {
    const int heavy = static_cast<int>(std::max_element(total.begin(), total.end()) - total.begin());
    double best_gain = 1e-12 * std::max(1.0, total[heavy]);
    int bi = -1, bj = -1;
    for (int i = 0; i < n; ++i) {
      if (bin_of[i] != heavy) continue;
      for (int j = 0; j < n; ++j) {
        const int other = bin_of[j];
        if (other == heavy) continue;
        const double delta = items[i].weight - items[j].weight;
        if (delta <= 0) continue;
        const double new_max = std::max(total[heavy] - delta, total[other] + delta);
        if (total[heavy] - new_max > best_gain) {
          best_gain = total[heavy] - new_max;
          bi = i;
          bj = j;
        }
      }
    }
    if (bi < 0) break;
    const int other = bin_of[bj];
    const double delta = items[bi].weight - items[bj].weight;
    total[heavy] -= delta;
    total[other] += delta;
    std::swap(bin_of[bi], bin_of[bj]);
  }
  return bin_of;
}

// Experts `experts` (global ids) with their loads onto `ranks` (global rank ids), `slots_per_rank` each: replica
// counts, then the replicas packed; writes slot_expert of those ranks.
void place_on_ranks(const std::vector<int>& experts, const std::vector<double>& load, const std::vector<int>& ranks,
                    int slots_per_rank, std::vector<int32_t>& slot_expert) {
  std::vector<double> local_load;
  for (int e : experts) local_load.push_back(load[e]);
  const int slots = static_cast<int>(ranks.size()) * slots_per_rank;
  const std::vector<int> count = replicate(local_load, slots);
  std::vector<Item> items;
  for (size_t i = 0; i < experts.size(); ++i)
    for (int r = 0; r < count[i]; ++r) items.push_back({experts[i], local_load[i] / count[i]});
  const std::vector<int> bin = pack_bins(items, static_cast<int>(ranks.size()), slots_per_rank);
  for (size_t b = 0; b < ranks.size(); ++b) {
    std::vector<int32_t> held;
    for (size_t i = 0; i < items.size(); ++i)
      if (bin[i] == static_cast<int>(b)) held.push_back(items[i].expert);
    std::sort(held.begin(), held.end());  // a rank's slots in expert order: the order its outputs are summed in
    std::copy(held.begin(), held.end(), slot_expert.begin() + int64_t{ranks[b]} * slots_per_rank);
  }
}

}  // namespace

Placement place_experts(const std::vector<double>& load, int ranks, int slots_per_rank,
                        const std::vector<int>& rank_host) {
  const int E = static_cast<int>(load.size());
  MOEX_CHECK_INPUT(E > 0 && ranks > 0 && slots_per_rank > 0, "expert placement: experts, ranks and slots per rank must be positive");
  MOEX_CHECK_INPUT(int64_t{ranks} * slots_per_rank >= E, "expert placement: ", ranks, " ranks x ", slots_per_rank,
                   " slots cannot hold ", E, " experts");
  for (double l : load) MOEX_CHECK_INPUT(std::isfinite(l) && l >= 0, "expert placement: a load must be finite and >= 0, not ", l);
  MOEX_CHECK_INPUT(rank_host.empty() || static_cast<int>(rank_host.size()) == ranks, "expert placement: ",
                   rank_host.size(), " host ids for ", ranks, " ranks");
  Placement p;
  p.experts = E;
  p.ranks = ranks;
  p.slots_per_rank = slots_per_rank;
  p.slot_expert.assign(int64_t{ranks} * slots_per_rank, 0);
  // Hosts in order of their first rank; hierarchical only when each has the same number of ranks and the experts
  // split evenly over them.
  std::vector<int> host_ids;
  std::vector<std::vector<int>> host_ranks;
  for (int r = 0; r < static_cast<int>(rank_host.size()); ++r) {
    auto it = std::find(host_ids.begin(), host_ids.end(), rank_host[r]);
    if (it == host_ids.end()) {
      host_ids.push_back(rank_host[r]);
      host_ranks.emplace_back();
      it = host_ids.end() - 1;
    }
    host_ranks[it - host_ids.begin()].push_back(r);
  }
  const int H = static_cast<int>(host_ids.size());
  bool hierarchical = H > 1 && E % H == 0;
  for (const auto& hr : host_ranks) hierarchical = hierarchical && hr.size() == host_ranks[0].size();
  std::vector<int> all(E);
  std::iota(all.begin(), all.end(), 0);
  if (!hierarchical) {
    std::vector<int> rank_ids(ranks);
    std::iota(rank_ids.begin(), rank_ids.end(), 0);
    place_on_ranks(all, load, rank_ids, slots_per_rank, p.slot_expert);
  } else {
    std::vector<Item> items;
    for (int e = 0; e < E; ++e) items.push_back({e, load[e]});
    const std::vector<int> host_of = pack_bins(items, H, E / H);
    for (int h = 0; h < H; ++h) {
      std::vector<int> mine;
      for (int e = 0; e < E; ++e)
        if (host_of[e] == h) mine.push_back(e);
      place_on_ranks(mine, load, host_ranks[h], slots_per_rank, p.slot_expert);
    }
  }
  p.index();
  return p;
}

namespace {
// Slots of rank r in `p` whose expert rank `b` of `q` does not hold (as a multiset).
int new_slots(const Placement& p, int r, const Placement& q, int b) {
  const int S = p.slots_per_rank;
  std::vector<int32_t> have(q.slot_expert.begin() + int64_t{b} * S, q.slot_expert.begin() + int64_t{b + 1} * S);
  int fresh = 0;
  for (int i = 0; i < S; ++i) {
    const auto it = std::find(have.begin(), have.end(), p.slot_expert[int64_t{r} * S + i]);
    if (it == have.end()) ++fresh;
    else *it = -1;
  }
  return fresh;
}
}  // namespace

int keep_experts_in_place(Placement& next, const Placement& prev, const std::vector<int>& rank_host) {
  MOEX_CHECK(next.ranks == prev.ranks && next.slots_per_rank == prev.slots_per_rank && next.experts == prev.experts,
             "keep_experts_in_place: placements of different shapes");
  const int N = next.ranks, S = next.slots_per_rank;
  const auto host = [&](int r) { return rank_host.empty() ? 0 : rank_host[r]; };
  std::vector<int> target(N, -1);  // next's rank r becomes rank target[r]
  std::vector<bool> taken(N, false);
  for (int round = 0; round < N; ++round) {
    int best_a = -1, best_b = -1, best_fresh = S + 1;
    for (int a = 0; a < N; ++a) {
      if (target[a] >= 0) continue;
      for (int b = 0; b < N; ++b) {
        if (taken[b] || host(a) != host(b)) continue;
        const int fresh = new_slots(next, a, prev, b);
        if (fresh < best_fresh) {
          best_fresh = fresh;
          best_a = a;
          best_b = b;
        }
      }
    }
    MOEX_CHECK(best_a >= 0, "keep_experts_in_place: ranks of a host do not match up");
    target[best_a] = best_b;
    taken[best_b] = true;
  }
  std::vector<int32_t> slots(next.slot_expert.size());
  for (int a = 0; a < N; ++a)
    std::copy(next.slot_expert.begin() + int64_t{a} * S, next.slot_expert.begin() + int64_t{a + 1} * S,
              slots.begin() + int64_t{target[a]} * S);
  next.slot_expert = std::move(slots);
  next.index();
  int fresh = 0;
  for (int r = 0; r < N; ++r) fresh += new_slots(next, r, prev, r);
  return fresh;
}

std::vector<double> rank_loads(const Placement& p, const std::vector<double>& load) {
  std::vector<double> out(p.ranks, 0.0);
  for (int s = 0; s < p.slots(); ++s) {
    const int e = p.slot_expert[s];
    out[s / p.slots_per_rank] += load[e] / p.replicas(e);
  }
  return out;
}

double balancedness(const std::vector<double>& loads) {
  if (loads.empty()) return 1.0;
  const double max = *std::max_element(loads.begin(), loads.end());
  if (max <= 0) return 1.0;
  return std::accumulate(loads.begin(), loads.end(), 0.0) / static_cast<double>(loads.size()) / max;
}

LoadWindow::LoadWindow(int layers, int experts, int window)
    : layers_(layers), experts_(experts), window_(window) {
  MOEX_CHECK_INPUT(window >= 1, "--eplb-window must be at least 1, not ", window);
  ring_.assign(static_cast<size_t>(window + 1) * layers * experts, 0);  // + the step in progress
  totals_.assign(static_cast<size_t>(layers) * experts, 0);
}

void LoadWindow::add(int layer, const int* counts) {
  const size_t base = static_cast<size_t>(steps_ % (window_ + 1)) * layers_ * experts_ + static_cast<size_t>(layer) * experts_;
  int64_t* slot = ring_.data() + base;
  int64_t* total = totals_.data() + static_cast<size_t>(layer) * experts_;
  for (int e = 0; e < experts_; ++e) {
    slot[e] += counts[e];
    total[e] += counts[e];
  }
}

void LoadWindow::end_step() {
  ++steps_;
  // The slot the next step writes held the step that now leaves the window.
  int64_t* slot = ring_.data() + static_cast<size_t>(steps_ % (window_ + 1)) * layers_ * experts_;
  for (size_t i = 0; i < static_cast<size_t>(layers_) * experts_; ++i) {
    totals_[i] -= slot[i];
    slot[i] = 0;
  }
}

std::vector<double> LoadWindow::load(int layer) const {
  const int64_t* total = totals_.data() + static_cast<size_t>(layer) * experts_;
  return std::vector<double>(total, total + experts_);
}

namespace {

using nlohmann::json;

json parse_object(const std::string& text, const std::string& what) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw_error(ErrorKind::kInvalidInput, what + ": not JSON (" + e.what() + ")");
  }
  MOEX_CHECK_INPUT(j.is_object(), what, ": expected a JSON object");
  return j;
}

int positive_int(const json& j, const char* key, const std::string& what) {
  MOEX_CHECK_INPUT(j.contains(key) && j[key].is_number_integer() && j[key].get<int64_t>() > 0 &&
                       j[key].get<int64_t>() <= (1 << 20),
                   what, ": \"", key, "\" must be a positive integer");
  return j[key].get<int>();
}

}  // namespace

std::string placement_json(const ModelPlacement& p) {
  json layers = json::array();
  for (const Placement& l : p.layers) layers.push_back(l.slot_expert);
  return json{{"format", "moex-expert-placement"}, {"experts", p.experts}, {"ranks", p.ranks},
              {"slots_per_rank", p.slots_per_rank}, {"layers", layers}}
             .dump() + "\n";
}

ModelPlacement parse_placement_json(const std::string& text) {
  const std::string what = "expert placement";
  const json j = parse_object(text, what);
  MOEX_CHECK_INPUT(j.value("format", "") == "moex-expert-placement", what, ": \"format\" must be \"moex-expert-placement\"");
  ModelPlacement p;
  p.experts = positive_int(j, "experts", what);
  p.ranks = positive_int(j, "ranks", what);
  p.slots_per_rank = positive_int(j, "slots_per_rank", what);
  MOEX_CHECK_INPUT(j.contains("layers") && j["layers"].is_array(), what, ": \"layers\" must be an array");
  for (const json& l : j["layers"]) {
    Placement layer;
    MOEX_CHECK_INPUT(l.is_array(), what, ": each layer must be an array of expert ids");
    if (!l.empty()) {
      layer.experts = p.experts;
      layer.ranks = p.ranks;
      layer.slots_per_rank = p.slots_per_rank;
      for (const json& e : l) {
        MOEX_CHECK_INPUT(e.is_number_integer(), what, ": layer ", p.layers.size(), ": expert ids must be integers");
        const int64_t v = e.get<int64_t>();
        MOEX_CHECK_INPUT(v >= 0 && v < p.experts, what, ": layer ", p.layers.size(), ": expert ", v, " outside [0, ", p.experts, ")");
        layer.slot_expert.push_back(static_cast<int32_t>(v));
      }
      layer.index();
    }
    p.layers.push_back(std::move(layer));
  }
  return p;
}

std::string load_json(const RecordedLoad& l) {
  return json{{"format", "moex-expert-load"}, {"experts", l.experts}, {"steps", l.steps}, {"layers", l.layers}}.dump() + "\n";
}

RecordedLoad parse_load_json(const std::string& text) {
  const std::string what = "expert load";
  const json j = parse_object(text, what);
  MOEX_CHECK_INPUT(j.value("format", "") == "moex-expert-load", what, ": \"format\" must be \"moex-expert-load\"");
  RecordedLoad l;
  l.experts = positive_int(j, "experts", what);
  MOEX_CHECK_INPUT(j.contains("steps") && j["steps"].is_number_integer() && j["steps"].get<int64_t>() >= 0, what,
                   ": \"steps\" must be an integer >= 0");
  l.steps = j["steps"].get<int64_t>();
  MOEX_CHECK_INPUT(j.contains("layers") && j["layers"].is_array(), what, ": \"layers\" must be an array");
  for (const json& layer : j["layers"]) {
    MOEX_CHECK_INPUT(layer.is_array() && (layer.empty() || static_cast<int>(layer.size()) == l.experts), what, ": layer ",
                     l.layers.size(), " must list ", l.experts, " loads (or none for a dense layer)");
    std::vector<double> v;
    for (const json& x : layer) {
      MOEX_CHECK_INPUT(x.is_number() && std::isfinite(x.get<double>()) && x.get<double>() >= 0, what, ": layer ",
                       l.layers.size(), ": a load must be a finite number >= 0");
      v.push_back(x.get<double>());
    }
    l.layers.push_back(std::move(v));
  }
  return l;
}

}  // namespace moex::eplb
