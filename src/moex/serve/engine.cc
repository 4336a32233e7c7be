#include "moex/serve/engine.h"

#include <algorithm>
#include <cstdio>
#include <exception>

#include "moex/base/error.h"
#include "moex/base/threads.h"
#include "moex/profile/profile.h"
#include "moex/comm/job.h"

namespace moex::serve {

// ---- RequestStream -------------------------------------------------------------------------------------

RequestStream::Read RequestStream::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait_for(lock, timeout, [&] { return !tokens_.empty() || finished_; });
  Read r;
  r.tokens.swap(tokens_);
  r.logprobs.swap(logprobs_);
  r.finished = finished_;
  r.finish_reason = finish_reason_;
  r.error = error_;
  return r;
}

void RequestStream::on_token(int32_t token, const SampledToken* logprobs) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tokens_.push_back(token);
    if (logprobs) logprobs_.push_back(*logprobs);
  }
  cv_.notify_all();
}

void RequestStream::on_finish(FinishReason reason, const std::string& error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    finished_ = true;
    finish_reason_ = finish_reason_name(reason);
    error_ = error;
  }
  cv_.notify_all();
}

// ---- Engine --------------------------------------------------------------------------------------------

Engine::Engine(DecoderModel& model, const EngineOptions& options) : core_(model, options) {
  thread_ = std::thread([this] {
    become_compute_thread();  // this thread and its OpenMP team on the CPUs, not all on the main thread's one
    loop();
  });
}

Engine::~Engine() {
  stop_.store(true);
  core_.interrupt();
  if (thread_.joinable()) thread_.join();
  core_.stop_workers();  // the other ranks leave their loop
  core_.abort_all("the server is shutting down");
}

std::shared_ptr<RequestStream> Engine::submit(GenerationRequest request) {
  auto stream = std::make_shared<RequestStream>(static_cast<int64_t>(request.prompt.size()));
  if (!core_.submit(std::move(request), stream)) return nullptr;
  return stream;
}

// Steps while there is work; idle, a step every 100 ms keeps the other ranks' wait for rank 0 short.
void Engine::loop() {
  while (!stop_.load()) {
    core_.wait_for_work(std::chrono::milliseconds(100));
    if (stop_.load()) return;
    try {
      core_.step();
    } catch (const std::exception& e) {
      // A rank that stopped answering (or died) leaves the ranks out of step: the job ends here (mpirun
      // then stops the other ranks), with the message.
      const auto* error = dynamic_cast<const Error*>(&e);
      if (core_.options().comm && error && error->kind() == ErrorKind::kComm && comm::in_multi_rank_job()) {
        std::fflush(stdout);
        comm::abort_job(error->exit_code(), e.what(), "moex serve: error: ");  // tells the peers, then MPI_Abort
      }
      // Never reached on valid input (requests are validated in submit); if it is, every request in flight
      // fails with the message and the engine goes on with an empty batch.
      std::fprintf(stderr, "moex serve: error in a step: %s\n", e.what());
      core_.abort_all(std::string("internal error: ") + e.what());
    }
  }
}

}  // namespace moex::serve
