// The CPU kernels' parallel_for. It runs either on vpage's own small persistent thread pool
// (workers created on first use and kept), or, once share_loaded_openmp() found one, on the
// GNU OpenMP runtime another library already loaded into the process (torch's). vpage is not
// built with OpenMP itself: a second runtime would bring a second set of threads, and those
// spin for milliseconds after each parallel region, so torch's ops and vpage's kernels,
// alternating within every layer, would fight over the same cores.
//
// fork(): a child process has only the forking thread, so the pool's workers do not exist
// there. A pthread_atfork handler waits for a running parallel_for to finish before the
// fork, and in the child abandons the old pool state (its threads and locks; a small
// leak) for a fresh one, whose workers are created on the child's first parallel_for.
// Forking from inside a task (fn) is not supported.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace vpage::cpu {

/// Runs `fn(task, thread_index)` for every task in [0, num_tasks). The calling thread takes
/// part; each taking-part thread has its own thread_index in [0, threads). Tasks are handed
/// out one at a time from a shared counter, so tasks of uneven cost balance themselves
/// (order them most expensive first). It returns when every task has completed, without
/// waiting for workers that woke up too late to claim one (on a machine shared with other
/// processes a worker can wait milliseconds for a core).
/// Calls from several threads are serialised; `fn` must not call parallel_for itself.
class ThreadPool {
 public:
  using TaskFn = std::function<void(int64_t task, int thread_index)>;

  /// The process-wide pool.
  static ThreadPool& instance();

  /// Runs the tasks on min(num_threads, num_tasks) threads and returns when all are done.
  /// The first exception thrown by a task is rethrown here (the other tasks still run).
  void parallel_for(int64_t num_tasks, int num_threads, const TaskFn& fn);

  /// Looks for a loaded OpenMP runtime exporting the GNU entry point GOMP_parallel (libgomp,
  /// or Intel's libiomp5 which also provides it) and, when found, runs every later
  /// parallel_for on its threads. Returns the runtime's file name, or "" when none is loaded
  /// (the own pool stays in use). Not thread-safe against running parallel_for calls.
  std::string share_loaded_openmp();

  /// Goes back to the own pool (also what a fork()ed child does: an OpenMP team inherited
  /// through fork is not usable there).
  void stop_sharing_openmp();

  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

 private:
  struct State;  // workers and synchronisation (thread_pool.cpp)
  ThreadPool();
  static void before_fork();
  static void after_fork_in_parent();
  static void after_fork_in_child();

  // GNU OpenMP's `GOMP_parallel(fn, data, num_threads, flags)`: runs fn(data) on a team.
  using GompParallelFn = void (*)(void (*)(void*), void*, unsigned, unsigned);

  void parallel_for_on_openmp(int64_t num_tasks, int num_threads, const TaskFn& fn);

  State* state_;
  GompParallelFn gomp_parallel_ = nullptr;  // set by share_loaded_openmp()
};

}  // namespace vpage::cpu
