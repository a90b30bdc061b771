#include "thread_pool.h"

#include "vpage/common.h"
#include "vpage/kernels/cpu_kernels.h"

#include <pthread.h>
#if defined(__linux__)
#include <dlfcn.h>
#include <link.h>
#endif

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace vpage::cpu {

// One parallel_for call. Workers hold it by shared_ptr, so a worker that wakes up late
// (its core busy with other processes) finds every task claimed and does nothing, and the
// caller returns as soon as all tasks are *completed*, without waiting for such workers.
struct Job {
  const ThreadPool::TaskFn* fn = nullptr;
  int64_t num_tasks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> completed{0};
  std::exception_ptr error;  // guarded by State::mutex
};

struct ThreadPool::State {
  std::mutex run_mutex;  // one parallel_for at a time
  std::mutex mutex;
  std::condition_variable wake;
  std::condition_variable done;
  std::vector<std::thread> workers;
  uint64_t generation = 0;
  bool stop = false;
  int active_workers = 0;  // workers invited to the current job
  std::shared_ptr<Job> job;

  void ensure_workers(int count);
  void worker_loop(int worker_index);
  void run_job(Job& job, int thread_index);
};

ThreadPool& ThreadPool::instance() {
  static ThreadPool pool;
  return pool;
}

ThreadPool::ThreadPool() : state_(new State) {
  // Registered once: the pool is a process-wide singleton.
  pthread_atfork(&ThreadPool::before_fork, &ThreadPool::after_fork_in_parent, &ThreadPool::after_fork_in_child);
}

ThreadPool::~ThreadPool() {
  State& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.stop = true;
  }
  s.wake.notify_all();
  for (std::thread& worker : s.workers) worker.join();
  delete state_;
  state_ = nullptr;
}

// Holds both locks across fork(), so the child never sees a job half set up.
void ThreadPool::before_fork() {
  State* s = instance().state_;
  if (s == nullptr) return;
  s->run_mutex.lock();
  s->mutex.lock();
}

void ThreadPool::after_fork_in_parent() {
  State* s = instance().state_;
  if (s == nullptr) return;
  s->mutex.unlock();
  s->run_mutex.unlock();
}

// The workers of the old state do not exist in the child: its std::thread objects must be
// neither joined nor destroyed (joinable threads terminate the process), and its locks and
// condition variables may hold the parent's waiters. Leak it and start afresh.
void ThreadPool::after_fork_in_child() {
  ThreadPool& pool = instance();
  pool.stop_sharing_openmp();
  if (pool.state_ == nullptr) return;
  pool.state_ = new State;
}

namespace {

struct FoundRuntime {
  void* gomp_parallel = nullptr;
  std::string name;
};

#if defined(__linux__)
// dl_iterate_phdr callback: the first loaded object named like an OpenMP runtime that
// exports GOMP_parallel. RTLD_NOLOAD only takes a reference to an already loaded object.
int find_openmp_runtime(dl_phdr_info* info, size_t, void* data) {
  const std::string name = info->dlpi_name ? info->dlpi_name : "";
  if (name.find("libgomp") == std::string::npos && name.find("libiomp") == std::string::npos) return 0;
  void* handle = dlopen(name.c_str(), RTLD_LAZY | RTLD_NOLOAD);
  if (handle == nullptr) return 0;
  void* symbol = dlsym(handle, "GOMP_parallel");
  if (symbol == nullptr) {
    dlclose(handle);
    return 0;
  }
  auto* found = static_cast<FoundRuntime*>(data);
  found->gomp_parallel = symbol;
  found->name = name.substr(name.find_last_of('/') + 1);
  return 1;
}
#endif

}  // namespace

std::string ThreadPool::share_loaded_openmp() {
  FoundRuntime found;
#if defined(__linux__)
  dl_iterate_phdr(&find_openmp_runtime, &found);
#endif
  if (found.gomp_parallel == nullptr) return "";
  gomp_parallel_ = reinterpret_cast<GompParallelFn>(found.gomp_parallel);
  return found.name;
}

void ThreadPool::stop_sharing_openmp() { gomp_parallel_ = nullptr; }

void ThreadPool::State::ensure_workers(int count) {
  while (static_cast<int>(workers.size()) < count) {
    const int index = static_cast<int>(workers.size());
    workers.emplace_back([this, index] { worker_loop(index); });
  }
}

void ThreadPool::State::run_job(Job& j, int thread_index) {
  for (;;) {
    const int64_t task = j.next.fetch_add(1, std::memory_order_relaxed);
    if (task >= j.num_tasks) return;
    try {
      (*j.fn)(task, thread_index);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex);
      if (!j.error) j.error = std::current_exception();
    }
    if (j.completed.fetch_add(1, std::memory_order_acq_rel) + 1 == j.num_tasks) {
      std::lock_guard<std::mutex> lock(mutex);
      done.notify_all();
    }
  }
}

void ThreadPool::State::worker_loop(int worker_index) {
  uint64_t seen = 0;
  for (;;) {
    std::shared_ptr<Job> current;
    {
      std::unique_lock<std::mutex> lock(mutex);
      wake.wait(lock, [&] { return stop || generation != seen; });
      if (stop) return;
      seen = generation;
      if (worker_index >= active_workers || !job) continue;
      current = job;
    }
    run_job(*current, worker_index + 1);
  }
}

void ThreadPool::parallel_for(int64_t num_tasks, int num_threads, const TaskFn& fn) {
  if (num_tasks <= 0) return;
  const int64_t threads = std::min<int64_t>(std::max(num_threads, 1), num_tasks);
  if (threads == 1) {
    for (int64_t task = 0; task < num_tasks; ++task) fn(task, 0);
    return;
  }
  if (gomp_parallel_ != nullptr) {
    parallel_for_on_openmp(num_tasks, static_cast<int>(threads), fn);
    return;
  }
  State& s = *state_;
  std::lock_guard<std::mutex> run_lock(s.run_mutex);
  const int helpers = static_cast<int>(threads - 1);
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->num_tasks = num_tasks;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.ensure_workers(helpers);
    s.job = job;
    s.active_workers = helpers;
    ++s.generation;
  }
  s.wake.notify_all();
  s.run_job(*job, 0);
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(s.mutex);
    s.done.wait(lock, [&] { return job->completed.load(std::memory_order_acquire) == num_tasks; });
    s.job.reset();
    error = job->error;
  }
  if (error) std::rethrow_exception(error);
}

// Every member of the OpenMP team pulls tasks from the job's counter; GOMP_parallel returns
// after the team's closing barrier, so every task has completed by then.
void ThreadPool::parallel_for_on_openmp(int64_t num_tasks, int num_threads, const TaskFn& fn) {
  State& s = *state_;
  std::lock_guard<std::mutex> run_lock(s.run_mutex);
  struct Region {
    State* state;
    Job job;
    std::atomic<int> next_thread{0};
  } region;
  region.state = &s;
  region.job.fn = &fn;
  region.job.num_tasks = num_tasks;
  gomp_parallel_(
      [](void* data) {
        auto* r = static_cast<Region*>(data);
        r->state->run_job(r->job, r->next_thread.fetch_add(1, std::memory_order_relaxed));
      },
      &region, static_cast<unsigned>(num_threads), 0);
  if (region.job.error) std::rethrow_exception(region.job.error);
}

std::string set_thread_source(const std::string& source) {
  VPAGE_CHECK(source == "own" || source == "openmp",
              "set_thread_source: expected 'own' or 'openmp', got '" << source << "'");
  ThreadPool& pool = ThreadPool::instance();
  if (source == "openmp") return pool.share_loaded_openmp();
  pool.stop_sharing_openmp();
  return "";
}

}  // namespace vpage::cpu
