#include "moex/comm/async.h"

#include <algorithm>
#include <vector>

#include "moex/comm/codec.h"
#include "moex/comm/communicator.h"

namespace moex::comm {

CommHandle CommHandle::completed() {
  auto state = std::make_shared<State>();
  state->done = true;
  return CommHandle(std::move(state));
}

bool CommHandle::test() const {
  if (!state_) return true;
  std::lock_guard lock(state_->mutex);
  return state_->done;
}

void CommHandle::wait() {
  if (!state_) return;
  std::exception_ptr error;
  {
    std::unique_lock lock(state_->mutex);
    state_->done_cv.wait(lock, [&] { return state_->done; });
    error = state_->error;
  }
  state_.reset();
  if (error) std::rethrow_exception(error);
}

ProgressThread::ProgressThread() : thread_([this] { run(); }) {}

ProgressThread::~ProgressThread() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  queue_cv_.notify_one();
  thread_.join();
}

CommHandle ProgressThread::submit(std::function<void()> job) {
  auto state = std::make_shared<CommHandle::State>();
  {
    std::lock_guard lock(mutex_);
    queue_.emplace_back(std::move(job), state);
  }
  queue_cv_.notify_one();
  return CommHandle(state);
}

void ProgressThread::run() {
  for (;;) {
    std::function<void()> job;
    std::shared_ptr<CommHandle::State> state;
    {
      std::unique_lock lock(mutex_);
      queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      job = std::move(queue_.front().first);
      state = std::move(queue_.front().second);
      queue_.pop_front();
    }
    std::exception_ptr error;
    try {
      job();
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard lock(state->mutex);
      state->done = true;
      state->error = error;
    }
    state->done_cv.notify_all();
  }
}

CommHandle Communicator::start_allreduce(void* data, size_t count, CommDType dtype, AllreduceAlgo algo) {
  return start([=](Communicator& twin) { twin.allreduce(data, count, dtype, algo); });
}

void pipelined_allreduce(Communicator& comm, void* data, size_t count, CommDType dtype, int chunks,
                         const std::function<void(size_t begin, size_t end)>& compute, AllreduceAlgo algo) {
  chunks = std::max(chunks, 1);
  const size_t blocks = (count + kF8BlockElems - 1) / kF8BlockElems;
  const size_t elem_bytes = comm_dtype_buffer_size(dtype);
  std::vector<CommHandle> pending;
  pending.reserve(chunks);
  for (int chunk = 0; chunk < chunks; ++chunk) {
    const size_t begin = std::min(count, blocks * chunk / chunks * kF8BlockElems);
    const size_t end = std::min(count, blocks * (chunk + 1) / chunks * kF8BlockElems);
    compute(begin, end);
    // Every rank starts the same chunk sequence, including empty chunks, so the ops stay matched.
    pending.push_back(comm.start_allreduce(static_cast<char*>(data) + begin * elem_bytes, end - begin, dtype, algo));
  }
  for (auto& handle : pending) handle.wait();
}

}  // namespace moex::comm
