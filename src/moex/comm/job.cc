#include "moex/comm/job.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>

#include "moex/comm/mpi_communicator.h"

namespace moex::comm {
namespace {

// How long a failing rank listens for errors its peers raise at about the same time before one of them
// reports; long enough for ranks that fail at the same step a little apart, short next to "within seconds".
constexpr double kGraceSeconds = 0.5;
// A rank that is not the lowest failing one waits this long for that rank's abort, then aborts itself.
constexpr double kLowerRankWaitSeconds = 3.0;
constexpr int kErrorTag = 0x6d6f;  // on error_comm() only
constexpr size_t kMaxMessageBytes = 2000;  // stays an eager send: delivered without the receiver's help

double now_seconds() { return steady_now_ns() * 1e-9; }

// "rank 1" / "ranks 0,1"
std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? "," : "") + std::to_string(ranks[i]);
  return out;
}

// One line per distinct (code, message), in the order of the lowest rank that has it.
std::vector<std::string> report_lines(const std::map<int, std::pair<int, std::string>>& failures) {
  std::vector<std::pair<std::pair<int, std::string>, std::vector<int>>> distinct;
  for (const auto& [rank, failure] : failures) {
    auto it = std::find_if(distinct.begin(), distinct.end(), [&](const auto& d) { return d.first == failure; });
    if (it == distinct.end()) {
      distinct.push_back({failure, {rank}});
    } else {
      it->second.push_back(rank);
    }
  }
  std::vector<std::string> lines;
  for (const auto& [failure, ranks] : distinct) lines.push_back(rank_list(ranks) + ": " + failure.second);
  return lines;
}

std::string serialize(const Description& description) {
  std::string out;
  for (const auto& [name, value] : description) out += name + '\x1f' + value + '\x1e';
  return out;
}

Description deserialize(const std::string& text) {
  Description out;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t sep = text.find('\x1f', pos), end = text.find('\x1e', pos);
    out.emplace_back(text.substr(pos, sep - pos), text.substr(sep + 1, end - sep - 1));
    pos = end + 1;
  }
  return out;
}

// Every rank's (code, text), rank order. Collective.
std::vector<std::pair<int, std::string>> exchange(Communicator& comm, int code, const std::string& text) {
  const int n = comm.size();
  const uint64_t own_bytes = sizeof(int32_t) + text.size();
  std::vector<uint64_t> sizes(n);
  comm.allgather(&own_bytes, sizeof(own_bytes), sizes.data());
  const uint64_t width = *std::max_element(sizes.begin(), sizes.end());
  std::vector<char> own(width, 0), all(width * n);
  const int32_t code32 = code;
  std::memcpy(own.data(), &code32, sizeof(code32));
  std::memcpy(own.data() + sizeof(code32), text.data(), text.size());
  comm.allgather(own.data(), width, all.data());
  std::vector<std::pair<int, std::string>> out(n);
  for (int r = 0; r < n; ++r) {
    const char* base = all.data() + width * r;
    int32_t c = 0;
    std::memcpy(&c, base, sizeof(c));
    out[r] = {c, std::string(base + sizeof(c), sizes[r] - sizeof(c))};
  }
  return out;
}

}  // namespace

std::string first_difference(int rank, const Description& mine, const Description& reference) {
  if (mine == reference) return "";
  auto find = [](const Description& d, const std::string& name) -> const std::string* {
    for (const auto& [key, value] : d)
      if (key == name) return &value;
    return nullptr;
  };
  auto shown = [](const std::string* value) { return value ? (value->empty() ? "''" : *value) : "(not set)"; };
  auto differ = [&](const std::string& name) -> std::string {
    const std::string* a = find(mine, name);
    const std::string* b = find(reference, name);
    if (a && b && *a == *b) return "";
    return ::moex::detail::concat("rank ", rank, " differs from rank 0: ", name, " is ", shown(a), ", rank 0 has ",
                                  shown(b));
  };
  for (const auto& [name, value] : reference)
    if (std::string d = differ(name); !d.empty()) return d;
  for (const auto& [name, value] : mine)
    if (std::string d = differ(name); !d.empty()) return d;
  // The same names and values in another order (or one name twice): say where the order differs.
  for (size_t i = 0; i < std::min(mine.size(), reference.size()); ++i)
    if (mine[i] != reference[i])
      return ::moex::detail::concat("rank ", rank, " differs from rank 0 in order: its item ", i + 1, " is ", mine[i].first,
                                    ", rank 0's is ", reference[i].first);
  return ::moex::detail::concat("rank ", rank, " differs from rank 0: ", mine.size(), " items, rank 0 has ",
                                reference.size());
}

void check_same_on_all_ranks(Communicator& comm, const std::function<Description()>& describe) {
  int code = 0;
  std::string text;
  try {
    text = serialize(describe());
  } catch (const Error& e) {
    code = e.exit_code();
    text = e.what();
  } catch (const std::exception& e) {
    code = static_cast<int>(ErrorKind::kInternal);
    text = e.what();
  }
  if (comm.size() == 1) {
    if (code != 0) throw_error(static_cast<ErrorKind>(code), text);
    return;
  }
  const auto all = exchange(comm, code, text);
  const bool reporter = comm.rank() == 0;
  std::map<int, std::pair<int, std::string>> failures;
  for (int r = 0; r < comm.size(); ++r)
    if (all[r].first != 0) failures[r] = all[r];
  if (!failures.empty()) {
    std::vector<std::string> lines = report_lines(failures);
    const std::string first = lines.front();
    throw JobError(static_cast<ErrorKind>(failures.begin()->second.first), first,
                   reporter ? std::move(lines) : std::vector<std::string>{});
  }
  const Description reference = deserialize(all[0].second);
  for (int r = 1; r < comm.size(); ++r) {
    if (all[r].second == all[0].second) continue;
    const std::string message = first_difference(r, deserialize(all[r].second), reference);
    throw JobError(ErrorKind::kInvalidInput, message,
                   reporter ? std::vector<std::string>{message} : std::vector<std::string>{});
  }
}

bool in_multi_rank_job() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized || error_comm() == MPI_COMM_NULL) return false;
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size > 1;
}

void abort_job(int exit_code, const std::string& message, std::string_view prefix) {
  MPI_Comm comm = error_comm();
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  // Tell every peer (never waited on: eager sends complete without the receiver, and we abort anyway).
  std::string payload(sizeof(int32_t), '\0');
  const int32_t code32 = exit_code;
  std::memcpy(payload.data(), &code32, sizeof(code32));
  payload += message.substr(0, kMaxMessageBytes);
  std::vector<MPI_Request> sends;
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    MPI_Request request;
    if (MPI_Isend(payload.data(), static_cast<int>(payload.size()), MPI_BYTE, peer, kErrorTag, comm, &request) ==
        MPI_SUCCESS)
      sends.push_back(request);
  }
  std::map<int, std::pair<int, std::string>> failures;
  failures[rank] = {exit_code, message};
  auto listen_until = [&](double deadline) {
    while (now_seconds() < deadline) {
      int arrived = 0;
      MPI_Status status;
      while (MPI_Iprobe(MPI_ANY_SOURCE, kErrorTag, comm, &arrived, &status) == MPI_SUCCESS && arrived) {
        int bytes = 0;
        MPI_Get_count(&status, MPI_BYTE, &bytes);
        std::string received(static_cast<size_t>(std::max(bytes, 0)), '\0');
        MPI_Recv(received.data(), bytes, MPI_BYTE, status.MPI_SOURCE, kErrorTag, comm, MPI_STATUS_IGNORE);
        int32_t code = 1;
        if (received.size() >= sizeof(code)) std::memcpy(&code, received.data(), sizeof(code));
        failures[status.MPI_SOURCE] = {code, received.size() >= sizeof(code) ? received.substr(sizeof(code)) : ""};
      }
      usleep(1000);
    }
  };
  const double start = now_seconds();
  listen_until(start + kGraceSeconds);
  // A lower failing rank reports (it heard from us within its own grace period, or it failed after us and
  // hears it now); we wait to be killed by its abort, and only report ourselves if it never comes.
  if (failures.begin()->first != rank) {
    listen_until(start + kGraceSeconds + kLowerRankWaitSeconds);
    failures = {{rank, {exit_code, message}}};
  }
  for (const std::string& line : report_lines(failures))
    std::fprintf(stderr, "%.*s%s\n", static_cast<int>(prefix.size()), prefix.data(), line.c_str());
  std::fflush(stderr);
  std::fflush(stdout);
  mark_comm_failed();
  MPI_Abort(MPI_COMM_WORLD, exit_code);
  _exit(exit_code);  // not reached
}

}  // namespace moex::comm
