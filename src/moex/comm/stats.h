// The two statistics every timing comparison in comm uses (bench-comm, tune-comm, auto's online race).
#pragma once
#include <algorithm>
#include <span>
#include <vector>

namespace moex::comm {

// Median (mean of the middle two for an even count); 0 for none.
inline double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const size_t m = values.size() / 2;
  return values.size() % 2 ? values[m] : 0.5 * (values[m - 1] + values[m]);
}

// Median over rounds r of a[r] / b[r] (rounds both were timed in; b[r] > 0): how much slower a is than b,
// robust to the machine drifting between rounds. 0 when no round pairs up.
inline double paired_median_ratio(std::span<const double> a, std::span<const double> b) {
  std::vector<double> ratios;
  for (size_t r = 0; r < std::min(a.size(), b.size()); ++r)
    if (b[r] > 0) ratios.push_back(a[r] / b[r]);
  return median(std::move(ratios));
}

}  // namespace moex::comm
