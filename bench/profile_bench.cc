// Cost of one profiler zone, off and on: the numbers behind "zones compile to nothing measurable".
#include <benchmark/benchmark.h>

#include "moex/profile/profile.h"

namespace {

using moex::profile::Zone;

constexpr int kZonesBetweenResets = 1 << 16;  // keeps the trace buffer small and its growth amortised

void BM_NoZone(benchmark::State& state) {
  int work = 0;
  for (auto _ : state) benchmark::DoNotOptimize(++work);
}
BENCHMARK(BM_NoZone);

void BM_ZoneOff(benchmark::State& state) {
  moex::profile::enable(false);
  int work = 0;
  for (auto _ : state) {
    MOEX_ZONE(kRouter);
    benchmark::DoNotOptimize(++work);
  }
}
BENCHMARK(BM_ZoneOff);

// `nested` zones per iteration, each inside the previous one; reported per zone.
void BM_ZoneOn(benchmark::State& state) {
  const int nested = static_cast<int>(state.range(0));
  moex::profile::reset();
  moex::profile::enable(true);
  int work = 0, zones = 0;
  for (auto _ : state) {
    if (nested == 1) {
      MOEX_ZONE_LAYER(kRouter, 3);
      benchmark::DoNotOptimize(++work);
    } else {
      MOEX_ZONE_LAYER(kAttention, 3);
      MOEX_ZONE_LAYER(kAllReduce, 3);
      benchmark::DoNotOptimize(++work);
    }
    zones += nested;
    if (zones >= kZonesBetweenResets) {
      state.PauseTiming();
      moex::profile::reset();
      state.ResumeTiming();
      zones = 0;
    }
  }
  moex::profile::enable(false);
  moex::profile::reset();
  state.SetItemsProcessed(state.iterations() * nested);  // items/s = zones/s
}
BENCHMARK(BM_ZoneOn)->Arg(1)->Arg(2);

void BM_SteadyClockRead(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(moex::profile::now_ns());
}
BENCHMARK(BM_SteadyClockRead);

}  // namespace
