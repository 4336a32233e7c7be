// Non-blocking collectives. A started collective runs on a progress thread that owns a private twin of
// the communicator, so it advances while the caller computes, whether or not the caller ever polls.
// Why a thread and not MPI's own async progress: OpenMPI's shared-memory transport only moves data
// inside MPI calls (no async progress thread for vader/ob1), and our shm/ring algorithms are multi-step
// schedules that need a CPU to drive each step anyway.
#pragma once
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "moex/comm/types.h"

namespace moex::comm {

class Communicator;

// The completion of one started operation. wait() rethrows an error the operation raised.
class CommHandle {
 public:
  struct State {
    std::mutex mutex;
    std::condition_variable done_cv;
    bool done = false;
    std::exception_ptr error;
  };
  CommHandle() = default;
  explicit CommHandle(std::shared_ptr<State> state) : state_(std::move(state)) {}
  static CommHandle completed();

  bool valid() const { return state_ != nullptr; }
  bool test() const;  // done yet? never blocks
  void wait();        // blocks until done; no-op for an invalid or already waited handle

 private:
  std::shared_ptr<State> state_;
};

// Runs queued jobs one at a time, in order, on its own thread.
class ProgressThread {
 public:
  ProgressThread();
  ~ProgressThread();  // drains the queue, then joins
  CommHandle submit(std::function<void()> job);

 private:
  void run();
  std::mutex mutex_;
  std::condition_variable queue_cv_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<CommHandle::State>>> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

// Compute-then-reduce in chunks: for chunk i, calls compute(begin, end) on this thread (filling
// data[begin, end)) and starts its all-reduce, so reducing chunk i overlaps computing chunk i+1.
// Returns when every chunk is reduced. Chunk edges fall on multiples of 128 elements (the fp8 block).
// data [count] of dtype (see Communicator::allreduce).
void pipelined_allreduce(Communicator& comm, void* data, size_t count, CommDType dtype, int chunks,
                         const std::function<void(size_t begin, size_t end)>& compute,
                         AllreduceAlgo algo = AllreduceAlgo::kAuto);

}  // namespace moex::comm
