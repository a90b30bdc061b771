// A small persistent thread pool for the CPU kernels (vpage does not use OpenMP: it
// clashes with torch's runtime). Workers are created on first use and kept.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace vpage::cpu {

/// Runs `fn(task, thread_index)` for every task in [0, num_tasks). The calling thread takes
/// part as thread 0; tasks are handed out one at a time from a shared counter, so tasks
/// of uneven cost balance themselves (order them most expensive first).
/// Calls from several threads are serialised; `fn` must not call parallel_for itself.
class ThreadPool {
 public:
  using TaskFn = std::function<void(int64_t task, int thread_index)>;

  /// The process-wide pool.
  static ThreadPool& instance();

  /// Runs the tasks on min(num_threads, num_tasks) threads and returns when all are done.
  /// The first exception thrown by a task is rethrown here (the other tasks still run).
  void parallel_for(int64_t num_tasks, int num_threads, const TaskFn& fn);

  ~ThreadPool();

 private:
  ThreadPool() = default;
  void ensure_workers(int count);
  void worker_loop(int worker_index);
  void run_tasks(int thread_index);

  std::mutex run_mutex_;  // one parallel_for at a time
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::thread> workers_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  int active_workers_ = 0;  // workers taking part in the current job
  int pending_workers_ = 0;  // of those, still running
  const TaskFn* fn_ = nullptr;
  int64_t num_tasks_ = 0;
  std::atomic<int64_t> next_task_{0};
  std::exception_ptr error_;
};

}  // namespace vpage::cpu
