// The rank -> host map (comm/topology.h) from what each rank reports; under mpirun, comm_collectives_test
// checks the map and its two levels (tests/mpi).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "moex/comm/communicator.h"
#include "moex/comm/topology.h"

namespace moex::comm {
namespace {

TEST(CommTopology, HostsAreNumberedByTheirLowestRankAndLocalRanksFollowRankOrder) {
  // Round-robin placement over 2 hosts, as `mpirun --map-by node` gives: keys are each node's lowest rank.
  const std::vector<int> keys = {0, 1, 0, 1, 0, 1};
  const std::vector<std::string> names = {"a", "b", "a", "b", "a", "b"};
  const Topology t = make_topology(keys, names);
  EXPECT_EQ(t.ranks(), 6);
  EXPECT_EQ(t.hosts(), 2);
  EXPECT_EQ(t.host_of_rank, (std::vector<int>{0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(t.local_rank, (std::vector<int>{0, 0, 1, 1, 2, 2}));
  EXPECT_EQ(t.host_names, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(t.ranks_per_host, (std::vector<int>{3, 3}));
  EXPECT_TRUE(t.uniform());
  EXPECT_EQ(t.ranks_on_host(1), (std::vector<int>{1, 3, 5}));
  EXPECT_EQ(t.host_name_of(3), "b");
  EXPECT_EQ(describe_topology(t), (std::vector<std::string>{"host 0 a: ranks 0,2,4", "host 1 b: ranks 1,3,5"}));
}

TEST(CommTopology, TheKeyNotTheNameTellsHostsApart) {
  // Namespaces sharing the machine's hostname are still two hosts; runs of ranks print as ranges.
  const std::vector<int> keys = {7, 7, 7, 3, 3};
  const std::vector<std::string> names(5, "vm");
  const Topology t = make_topology(keys, names);
  EXPECT_EQ(t.hosts(), 2);
  EXPECT_EQ(t.host_of_rank, (std::vector<int>{0, 0, 0, 1, 1}));
  EXPECT_EQ(t.local_rank, (std::vector<int>{0, 1, 2, 0, 1}));
  EXPECT_FALSE(t.uniform());
  EXPECT_EQ(describe_topology(t), (std::vector<std::string>{"host 0 vm: ranks 0-2", "host 1 vm: ranks 3-4"}));
}

TEST(CommTopology, OneRankAlone) {
  const Communicator& self = world();  // not launched by mpirun: the size-1 group
  ASSERT_EQ(self.size(), 1);
  const Topology& t = self.topology();
  EXPECT_EQ(t.hosts(), 1);
  EXPECT_EQ(t.host_of_rank, std::vector<int>{0});
  EXPECT_EQ(describe_topology(t).size(), 1u);
  EXPECT_EQ(describe_topology(t)[0].rfind("host 0 ", 0), 0u);
  EXPECT_NE(describe_topology(t)[0].find(": rank 0"), std::string::npos);
}

}  // namespace
}  // namespace moex::comm
