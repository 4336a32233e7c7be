#include "moex/comm/topology.h"

#include <map>

#include "moex/base/error.h"

namespace moex::comm {

bool Topology::uniform() const {
  for (int count : ranks_per_host)
    if (count != ranks_per_host.front()) return false;
  return true;
}

std::vector<int> Topology::ranks_on_host(int host) const {
  std::vector<int> out;
  for (int r = 0; r < ranks(); ++r)
    if (host_of_rank[r] == host) out.push_back(r);
  return out;
}

Topology make_topology(std::span<const int> node_key, std::span<const std::string> names) {
  MOEX_CHECK(node_key.size() == names.size() && !node_key.empty(), "one key and one name per rank");
  Topology t;
  std::map<int, int> host_of_key;
  for (size_t r = 0; r < node_key.size(); ++r) {
    const auto [it, added] = host_of_key.try_emplace(node_key[r], t.hosts());
    if (added) {
      t.host_names.push_back(names[r]);
      t.ranks_per_host.push_back(0);
    }
    t.host_of_rank.push_back(it->second);
    t.local_rank.push_back(t.ranks_per_host[it->second]++);
  }
  return t;
}

std::vector<std::string> describe_topology(const Topology& topology) {
  std::vector<std::string> lines;
  for (int host = 0; host < topology.hosts(); ++host) {
    const std::vector<int> ranks = topology.ranks_on_host(host);
    std::string list;
    for (size_t i = 0; i < ranks.size();) {
      size_t j = i;
      while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
      if (!list.empty()) list += ',';
      list += std::to_string(ranks[i]);
      if (j > i) {
        list += '-';
        list += std::to_string(ranks[j]);
      }
      i = j + 1;
    }
    lines.push_back(::moex::detail::concat("host ", host, " ", topology.host_names[host], ": rank",
                                           ranks.size() > 1 ? "s " : " ", list));
  }
  return lines;
}

}  // namespace moex::comm
