// A small persistent thread pool for the CPU kernels (vpage does not use OpenMP: it
// clashes with torch's runtime). Workers are created on first use and kept.
//
// fork(): a child process has only the forking thread, so the pool's workers do not exist
// there. A pthread_atfork handler waits for a running parallel_for to finish before the
// fork, and in the child abandons the old pool state (its threads and locks; a small
// leak) for a fresh one, whose workers are created on the child's first parallel_for.
// Forking from inside a task (fn) is not supported.
#pragma once

#include <cstdint>
#include <functional>

namespace vpage::cpu {

/// Runs `fn(task, thread_index)` for every task in [0, num_tasks). The calling thread takes
/// part as thread 0; tasks are handed out one at a time from a shared counter, so tasks
/// of uneven cost balance themselves (order them most expensive first). It returns when
/// every task has completed, without waiting for workers that woke up too late to claim one
/// (on a machine shared with other processes a worker can wait milliseconds for a core).
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
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

 private:
  struct State;  // workers and synchronisation (thread_pool.cpp)
  ThreadPool();
  static void before_fork();
  static void after_fork_in_parent();
  static void after_fork_in_child();

  State* state_;
};

}  // namespace vpage::cpu
