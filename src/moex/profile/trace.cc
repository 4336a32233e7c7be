// Chrome trace-event JSON, written by hand (streamed) since a trace can hold millions of events.
#include "moex/profile/trace.h"

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <limits>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/profile/thread_buffer.h"

namespace moex::profile {

namespace {

constexpr int kStepsTrack = 0;  // tid of the per-rank "steps" track; thread t is tid t + 1

// Collects output and hands it to a file in large pieces, or keeps it all when there is no file.
class Sink {
 public:
  explicit Sink(std::FILE* file) : file_(file) {}
  void append(const char* format, ...) __attribute__((format(printf, 2, 3)));
  void append_string(const std::string& s) { text_ += s; }
  void flush_if_large() {
    if (file_ != nullptr && text_.size() > (1u << 20)) flush();
  }
  void flush() {
    if (file_ != nullptr && !text_.empty()) {
      ok_ &= std::fwrite(text_.data(), 1, text_.size(), file_) == text_.size();
      text_.clear();
    }
  }
  bool ok() const { return ok_; }
  std::string& text() { return text_; }

 private:
  std::FILE* file_;
  std::string text_;
  bool ok_ = true;
};

void Sink::append(const char* format, ...) {
  char line[512];
  va_list args;
  va_start(args, format);
  const int n = vsnprintf(line, sizeof line, format, args);
  va_end(args);
  text_.append(line, std::min<size_t>(static_cast<size_t>(std::max(n, 0)), sizeof line - 1));
}

double us_since(int64_t ns, int64_t origin_ns) { return static_cast<double>(ns - origin_ns) * 1e-3; }

std::string slice_name(const TraceSlice& slice, const ThreadTrace& thread) {
  std::string name = zone_name(slice.zone);
  if (slice.comm >= 0 && !thread.comm[slice.comm].algorithm.empty()) name += " (" + thread.comm[slice.comm].algorithm + ")";
  return name;
}

void write_slice_args(Sink& sink, const TraceSlice& slice, const ThreadTrace& thread) {
  sink.append(",\"args\":{\"phase\":\"%s\"", phase_name(slice.phase));
  if (slice.layer >= 0) sink.append(",\"layer\":%d", slice.layer);
  if (slice.comm >= 0) {
    const CommInfo& comm = thread.comm[slice.comm];
    sink.append(",\"algorithm\":");
    sink.append_string(nlohmann::json(comm.algorithm).dump());  // escapes whatever the comm layer named it
    const int64_t duration = slice.end_ns - slice.begin_ns;
    sink.append(",\"bytes\":%llu,\"wait_us\":%.3f,\"transfer_us\":%.3f", static_cast<unsigned long long>(comm.bytes),
                comm.wait_ns * 1e-3, (duration - comm.wait_ns) * 1e-3);
  }
  sink.append("}}");
}

// B/E pairs in pre-order: a slice's E is written once the next slice at its depth or above begins.
void write_thread(Sink& sink, bool& first, int pid, const ThreadTrace& thread, int64_t origin_ns) {
  const int tid = thread.thread + 1;
  auto separator = [&] {
    sink.append_string(first ? "\n" : ",\n");
    first = false;
  };
  std::vector<const TraceSlice*> open;
  auto close_top = [&] {
    const TraceSlice& slice = *open.back();
    separator();
    sink.append("{\"ph\":\"E\",\"ts\":%.3f,\"pid\":%d,\"tid\":%d}", us_since(slice.end_ns, origin_ns), pid, tid);
    open.pop_back();
  };
  for (const TraceSlice& slice : thread.slices) {
    while (!open.empty() && open.back()->depth >= slice.depth) close_top();
    separator();
    sink.append("{\"name\":");
    sink.append_string(nlohmann::json(slice_name(slice, thread)).dump());
    sink.append(",\"cat\":\"%s\",\"ph\":\"B\",\"ts\":%.3f,\"pid\":%d,\"tid\":%d", slice.comm >= 0 ? "comm" : "zone",
                us_since(slice.begin_ns, origin_ns), pid, tid);
    write_slice_args(sink, slice, thread);
    open.push_back(&slice);
    sink.flush_if_large();
  }
  while (!open.empty()) close_top();
}

void write_trace(Sink& sink, std::span<const RankTrace> ranks) {
  int64_t origin_ns = std::numeric_limits<int64_t>::max();
  for (const RankTrace& rank : ranks) {
    for (const StepSlice& step : rank.steps) origin_ns = std::min(origin_ns, step.begin_ns);
    for (const ThreadTrace& thread : rank.threads) {
      for (const TraceSlice& slice : thread.slices) origin_ns = std::min(origin_ns, slice.begin_ns);
    }
  }
  if (origin_ns == std::numeric_limits<int64_t>::max()) origin_ns = 0;

  sink.append_string("{\"displayTimeUnit\":\"ns\",\"traceEvents\":[");
  bool first = true;
  auto separator = [&] {
    sink.append_string(first ? "\n" : ",\n");
    first = false;
  };
  for (const RankTrace& rank : ranks) {
    const int pid = rank.rank;
    separator();
    sink.append("{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{\"name\":\"rank %d\"}}", pid, pid);
    separator();
    sink.append("{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{\"sort_index\":%d}}", pid,
                pid);
    separator();
    sink.append("{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"steps\"}}", pid,
                kStepsTrack);
    for (const ThreadTrace& thread : rank.threads) {
      separator();
      sink.append("{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"thread %d\"}}", pid,
                  thread.thread + 1, thread.thread);
    }
    // Steps as complete events on their own track: their wall time is the caller's, so they need not nest.
    for (const StepSlice& step : rank.steps) {
      separator();
      sink.append(
          "{\"name\":\"%s step\",\"cat\":\"step\",\"ph\":\"X\",\"ts\":%.3f,\"dur\":%.3f,\"pid\":%d,\"tid\":%d,"
          "\"args\":{\"tokens\":%d}}",
          phase_name(step.phase), us_since(step.begin_ns, origin_ns), (step.end_ns - step.begin_ns) * 1e-3, pid,
          kStepsTrack, step.tokens);
    }
    for (const ThreadTrace& thread : rank.threads) write_thread(sink, first, pid, thread, origin_ns);
  }
  sink.append_string("\n]}\n");
  sink.flush();
}

}  // namespace

RankTrace collect_trace() {
  RankTrace trace;
  trace.rank = rank();
  for (const detail::ThreadBuffer* buffer : detail::all_thread_buffers()) {
    trace.steps.insert(trace.steps.end(), buffer->steps.begin(), buffer->steps.end());
    if (buffer->slices.empty()) continue;
    std::vector<detail::RecordedSlice> recorded = buffer->slices;
    std::sort(recorded.begin(), recorded.end(),
              [](const detail::RecordedSlice& a, const detail::RecordedSlice& b) { return a.order < b.order; });
    ThreadTrace thread;
    thread.thread = buffer->thread;
    thread.slices.reserve(recorded.size());
    for (const detail::RecordedSlice& r : recorded) thread.slices.push_back(r.slice);
    thread.comm = buffer->comm;
    trace.threads.push_back(std::move(thread));
  }
  std::sort(trace.steps.begin(), trace.steps.end(),
            [](const StepSlice& a, const StepSlice& b) { return a.begin_ns < b.begin_ns; });
  return trace;
}

std::vector<uint8_t> trace_to_bytes(const RankTrace& trace) {
  nlohmann::json steps = nlohmann::json::array(), threads = nlohmann::json::array();
  for (const StepSlice& s : trace.steps) steps.push_back({s.begin_ns, s.end_ns, static_cast<int>(s.phase), s.tokens});
  for (const ThreadTrace& t : trace.threads) {
    nlohmann::json slices = nlohmann::json::array(), comm = nlohmann::json::array();
    for (const TraceSlice& s : t.slices) {
      slices.push_back({s.begin_ns, s.end_ns, static_cast<int>(s.zone), static_cast<int>(s.phase), s.depth, s.layer,
                        s.comm});
    }
    for (const CommInfo& c : t.comm) comm.push_back({c.algorithm, c.bytes, c.wait_ns});
    threads.push_back({{"thread", t.thread}, {"slices", slices}, {"comm", comm}});
  }
  return nlohmann::json::to_cbor({{"rank", trace.rank}, {"steps", steps}, {"threads", threads}});
}

RankTrace trace_from_bytes(std::span<const uint8_t> bytes) {
  try {
    const nlohmann::json json = nlohmann::json::from_cbor(bytes.begin(), bytes.end());
    RankTrace trace;
    trace.rank = json.at("rank").get<int>();
    for (const auto& s : json.at("steps")) {
      trace.steps.push_back({s.at(0).get<int64_t>(), s.at(1).get<int64_t>(), static_cast<Phase>(s.at(2).get<int>()),
                             s.at(3).get<int32_t>()});
    }
    for (const auto& tj : json.at("threads")) {
      ThreadTrace thread;
      thread.thread = tj.at("thread").get<int>();
      for (const auto& c : tj.at("comm")) {
        thread.comm.push_back({c.at(0).get<std::string>(), c.at(1).get<uint64_t>(), c.at(2).get<int64_t>()});
      }
      for (const auto& s : tj.at("slices")) {
        const int zone = s.at(2).get<int>(), phase = s.at(3).get<int>(), comm = s.at(6).get<int32_t>();
        MOEX_CHECK_INPUT(zone >= 0 && zone < kNumZones && phase >= 0 && phase < kNumPhases &&
                             comm < static_cast<int>(thread.comm.size()),
                         "profile trace: malformed slice ", s.dump());
        thread.slices.push_back({s.at(0).get<int64_t>(), s.at(1).get<int64_t>(), static_cast<Zone>(zone),
                                 static_cast<Phase>(phase), s.at(4).get<int16_t>(), s.at(5).get<int32_t>(), comm});
      }
      trace.threads.push_back(std::move(thread));
    }
    return trace;
  } catch (const nlohmann::json::exception& e) {
    throw_error(ErrorKind::kInvalidInput, std::string("profile trace: malformed bytes: ") + e.what());
  }
}

std::string chrome_trace_json(std::span<const RankTrace> ranks) {
  Sink sink(nullptr);
  write_trace(sink, ranks);
  return std::move(sink.text());
}

void write_chrome_trace(const std::string& path, std::span<const RankTrace> ranks) {
  std::FILE* file = std::fopen(path.c_str(), "wb");
  MOEX_CHECK_INPUT(file != nullptr, "cannot write the trace to ", path, ": ", std::strerror(errno));
  Sink sink(file);
  write_trace(sink, ranks);
  const bool closed = std::fclose(file) == 0;
  MOEX_CHECK_INPUT(sink.ok() && closed, "cannot write the trace to ", path, ": ", std::strerror(errno));
}

void write_chrome_trace(const std::string& path) {
  const RankTrace trace = collect_trace();
  write_chrome_trace(path, std::span<const RankTrace>(&trace, 1));
}

}  // namespace moex::profile
