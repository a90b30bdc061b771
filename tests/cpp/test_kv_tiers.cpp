// The tiers of the prefix cache (CPU pool, disk): what the scheduler's plans move is checked by
// a simulated KV store. Each slot holds the hash of the token prefix whose K/V it would hold;
// the plan's moves are applied in the worker's order (disk deletes and saves, swap-out, disk
// loads, swap-in, copies), the forward writes its rows, and every row then reads exactly its
// own prefix at every position of its context.
#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "check.h"
#include "scheduler_fixtures.h"
#include "vpage/scheduler.h"

using namespace vpage;
using namespace vpage_test;

namespace {

using Key = std::pair<uint64_t, uint64_t>;

// What K/V at position p stands for: all tokens up to p (and the salt they were computed under).
uint64_t prefix_value(const std::vector<TokenId>& tokens, size_t p, const std::string& salt) {
  uint64_t h = 1469598103934665603ULL;
  for (char c : salt) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ULL;
  for (size_t i = 0; i <= p; ++i) h = (h ^ static_cast<uint64_t>(tokens[i])) * 1099511628211ULL;
  return h;
}

struct DiskFile {
  bool first = false;
  std::string salt;
  std::vector<TokenId> tokens;
  std::vector<uint64_t> slots;
};

struct Sim {
  static constexpr int kBs = 4;
  std::vector<uint64_t> gpu, cpu;
  std::map<Key, DiskFile>* disk;
  std::map<std::string, std::string> salts;  // request -> salt
  std::map<SeqId, std::string> seq_request;
  int loads = 0;
  int load_delay = 0;  // steps a disk read takes after the one that starts it
  int steps = 0;
  std::vector<std::pair<KvBlockLoad, int>> reading;  // in flight, with the step they finish in
  std::string watch;  // a request whose admission to note
  int watch_cached = 0;

  Sim(const BlockManagerConfig& c, std::map<Key, DiskFile>* d)
      : gpu(static_cast<size_t>(c.num_gpu_blocks) * kBs, 0), cpu(static_cast<size_t>(c.num_cpu_blocks) * kBs, 0),
        disk(d) {}

  static void copy_block(const std::vector<uint64_t>& from, int32_t a, std::vector<uint64_t>& to, int32_t b) {
    for (int i = 0; i < kBs; ++i) to[static_cast<size_t>(b) * kBs + i] = from[static_cast<size_t>(a) * kBs + i];
  }

  void add(Scheduler& s, const std::string& id, const std::vector<TokenId>& prompt, const std::string& salt = "",
           int max_tokens = 1) {
    for (SeqId seq : s.add_sequence_group(id, prompt, 1, stop(max_tokens), 0.0, salt)) seq_request[seq] = id;
    salts[id] = salt;
  }

  // One step; `fail` loads of it are reported failed (as a worker finding corrupt files).
  void step(Scheduler& s, bool fail_loads = false) {
    auto plan = s.schedule();
    if (const auto g = s.find_group(watch)) watch_cached = std::max(watch_cached, g->num_cached_prompt_tokens);
    for (const auto& k : plan->kv_deletes) EXPECT(disk->erase(k) == 1);
    for (const KvBlockSave& save : plan->kv_saves) {
      DiskFile f{save.first, save.salt, save.tokens, std::vector<uint64_t>(kBs)};
      copy_block(cpu, save.cpu_block, f.slots, 0);
      (*disk)[Key{save.hash_hi, save.hash_lo}] = f;
    }
    for (const BlockPair& p : plan->blocks_to_swap_out) copy_block(gpu, p.first, cpu, p.second);
    // Disk reads finish `load_delay` steps after they start (the worker reads on a thread).
    for (const KvBlockLoad& load : plan->kv_loads) reading.emplace_back(load, steps + load_delay);
    std::vector<KvBlockLoad> done, failed;
    for (auto it = reading.begin(); it != reading.end();) {
      if (it->second > steps) {
        ++it;
        continue;
      }
      const KvBlockLoad& load = it->first;
      ++loads;
      const auto file = disk->find(Key{load.hash_hi, load.hash_lo});
      EXPECT(file != disk->end());
      if (fail_loads) {
        failed.push_back(load);
      } else {
        copy_block(file->second.slots, 0, cpu, load.cpu_block);
        done.push_back(load);
      }
      it = reading.erase(it);
    }
    for (const BlockPair& p : plan->blocks_to_swap_in) copy_block(cpu, p.first, gpu, p.second);
    for (const BlockPair& p : plan->blocks_to_copy) copy_block(gpu, p.first, gpu, p.second);
    // The forward writes each row's new tokens, then reads its whole context.
    for (int32_t r = 0; r < plan->num_seqs(); ++r) {
      const auto seq = s.find_sequence(plan->seq_ids[r]);
      EXPECT(seq.has_value());
      const std::string& salt = salts[seq_request[plan->seq_ids[r]]];
      const int32_t* table = plan->block_tables.data() + static_cast<size_t>(r) * plan->max_blocks;
      for (int32_t t = plan->query_start_loc[r]; t < plan->query_start_loc[r + 1]; ++t) {
        gpu[plan->slot_mapping[t]] = prefix_value(seq->tokens, plan->positions[t], salt);
      }
      for (int32_t p = 0; p < plan->context_lens[r]; ++p) {
        const uint64_t got = gpu[static_cast<size_t>(table[p / kBs]) * kBs + p % kBs];
        EXPECT(got == prefix_value(seq->tokens, p, salt));
      }
    }
    std::vector<SeqId> ids = plan->sample_seq_ids;
    std::vector<TokenId> next(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) next[i] = 1000 + static_cast<TokenId>(ids[i]);
    s.commit(ids.data(), next.data(), static_cast<int64_t>(ids.size()));
    if (!done.empty() || !failed.empty()) s.complete_kv_loads(done, failed);
    s.check_invariants();
    ++steps;
  }

  // Steps until nothing is left (bounded); returns the cached prompt tokens of `id`'s admission.
  int run(Scheduler& s, const std::string& id, bool fail_loads = false) {
    watch = id;
    watch_cached = 0;
    for (int i = 0; i < 200 && s.has_unfinished(); ++i) step(s, fail_loads);
    EXPECT(!s.has_unfinished());
    return watch_cached;
  }
};

BlockManagerConfig tiers(int gpu, int cpu, int disk = 0) {
  BlockManagerConfig c = pools(gpu, cpu, true);
  c.enable_kv_offload = true;
  c.num_disk_blocks = disk;
  c.prefix_hash_key0 = 11;
  c.prefix_hash_key1 = 22;
  return c;
}

// Prompt `i` of 13 tokens (3 full blocks and one token); distinct per i.
std::vector<TokenId> prompt(int i) { return tokens(13, 100 * i + 1); }

// Runs prompts 0..n-1 one at a time, then prompt 0 again; returns its cached tokens.
int evict_and_return(Scheduler& s, Sim& sim, int n, const std::string& salt_again = "") {
  for (int i = 0; i < n; ++i) {
    sim.add(s, "p" + std::to_string(i), prompt(i));
    sim.run(s, "p" + std::to_string(i));
  }
  sim.add(s, "again", prompt(0), salt_again);
  return sim.run(s, "again");
}

// The files an engine with a disk tier leaves after prompts 0..7.
std::map<Key, DiskFile> files_of_an_earlier_engine() {
  std::map<Key, DiskFile> disk;
  const BlockManagerConfig on = tiers(8, 4, 64);
  Scheduler s(SchedulerConfig{}, on);
  Sim sim(on, &disk);
  evict_and_return(s, sim, 8);
  return disk;
}

// Indexes `disk` as a restarted engine does; returns the keys pushed out of its tier.
size_t index_files(Scheduler& s, const std::map<Key, DiskFile>& disk) {
  size_t gone = 0;
  for (const auto& [key, f] : disk) gone += s.add_disk_block(key.first, key.second, f.first, f.salt, f.tokens).size();
  return gone;
}

}  // namespace

TEST_CASE("cpu tier: blocks evicted from the GPU come back from the CPU with their K/V") {
  std::map<Key, DiskFile> disk;
  const BlockManagerConfig off = pools(8, 16, true);
  Scheduler plain(SchedulerConfig{}, off);
  Sim plain_sim(off, &disk);
  EXPECT(evict_and_return(plain, plain_sim, 5) == 0);  // 8 GPU blocks hold 2 of 5 prompts

  const BlockManagerConfig on = tiers(8, 16);
  Scheduler s(SchedulerConfig{}, on);
  Sim sim(on, &disk);
  EXPECT(evict_and_return(s, sim, 5) == 12);
  const BlockUsage u = s.usage();
  EXPECT(u.cpu_prefix_cache.hits == 3 && u.cpu_prefix_cache.queries >= 3);
  EXPECT(disk.empty());
}

TEST_CASE("cpu tier: another salt never takes the offloaded blocks") {
  std::map<Key, DiskFile> disk;
  const BlockManagerConfig on = tiers(8, 16);
  Scheduler s(SchedulerConfig{}, on);
  Sim sim(on, &disk);
  EXPECT(evict_and_return(s, sim, 5, "tenant") == 0);
  EXPECT(s.usage().cpu_prefix_cache.hits == 0);
}

TEST_CASE("swapped-out sequences share the CPU pool with offloaded blocks, with and without a disk") {
  for (int disk_blocks : {0, 32}) {
    std::map<Key, DiskFile> disk;
    const BlockManagerConfig on = tiers(16, 16, disk_blocks);
    SchedulerConfig sc;
    sc.preemption_mode = PreemptionMode::kSwap;
    Scheduler s(sc, on);
    Sim sim(on, &disk);
    for (int round = 0; round < 4; ++round) {
      for (int i = 0; i < 4; ++i) sim.add(s, "r" + std::to_string(round) + "-" + std::to_string(i), prompt((round + i) % 5), "", 9);
      sim.run(s, "r0-0");
    }
    EXPECT(s.stats().num_preempted_swap > 0);
    const BlockUsage u = s.usage();
    EXPECT(u.prefix_cache.hits + u.cpu_prefix_cache.hits > 0);
    EXPECT(disk_blocks == 0 || (sim.loads > 0 && u.disk_prefix_cache.hits > 0));
    EXPECT(disk_blocks == 0 ? disk.empty() : !disk.empty());
  }
}

TEST_CASE("disk tier: blocks evicted from the CPU are read back a step ahead of admission") {
  std::map<Key, DiskFile> disk;
  const BlockManagerConfig on = tiers(8, 4, 64);
  Scheduler s(SchedulerConfig{}, on);
  Sim sim(on, &disk);
  EXPECT(evict_and_return(s, sim, 8) == 12);
  EXPECT(sim.loads > 0 && s.usage().disk_prefix_cache.hits > 0);
  EXPECT(static_cast<int>(disk.size()) == s.usage().used_disk_blocks);
}

TEST_CASE("disk tier: a new engine with the same key finds the files; failed loads are recomputed") {
  std::map<Key, DiskFile> disk = files_of_an_earlier_engine();
  EXPECT(disk.size() >= 3);
  for (bool fail : {false, true}) {
    const BlockManagerConfig on = tiers(8, 4, 64);
    Scheduler s(SchedulerConfig{}, on);
    EXPECT(index_files(s, disk) == 0);
    const size_t files = disk.size();
    Sim sim(on, &disk);
    sim.add(s, "a", prompt(1));
    // b, admitted while a's blocks load, never takes them (the loads may fail: then the simulated
    // blocks hold stale K/V); b computes the prompt, and a then finds it on the device if not loaded.
    sim.add(s, "b", prompt(1));
    EXPECT(sim.run(s, "a", fail) == 12);
    EXPECT(sim.loads == 3);
    // Failed loads lose their records and files; loaded blocks stay on disk too.
    EXPECT(disk.size() == (fail ? files - 3 : files));
    EXPECT(s.usage().used_disk_blocks == static_cast<int>(disk.size()));
  }
  // A disk tier smaller than the files found keeps the latest and names the rest for deletion.
  BlockManagerConfig small = tiers(8, 4, 2);
  Scheduler s(SchedulerConfig{}, small);
  EXPECT(index_files(s, disk) == disk.size() - 2 && s.usage().used_disk_blocks == 2);
}

TEST_CASE("disk tier: a request waits for reads that take several steps, while others run") {
  std::map<Key, DiskFile> disk = files_of_an_earlier_engine();
  const BlockManagerConfig on = tiers(16, 4, 64);
  Scheduler s(SchedulerConfig{}, on);
  index_files(s, disk);
  Sim sim(on, &disk);
  sim.load_delay = 3;
  sim.add(s, "a", prompt(1));
  sim.add(s, "other", prompt(9), "", 4);  // no file: runs while a's blocks are read
  EXPECT(sim.run(s, "a") == 12);
  EXPECT(sim.loads == 3);
}

TEST_CASE("reset_prefix_cache empties every tier; the files go with the next plan") {
  std::map<Key, DiskFile> disk;
  const BlockManagerConfig on = tiers(8, 4, 64);
  Scheduler s(SchedulerConfig{}, on);
  Sim sim(on, &disk);
  evict_and_return(s, sim, 8);
  EXPECT(!disk.empty());
  EXPECT(s.reset_prefix_cache());
  EXPECT(s.usage().used_disk_blocks == 0);
  sim.add(s, "after", prompt(0));
  EXPECT(sim.run(s, "after") == 0);
  EXPECT(static_cast<int>(disk.size()) == s.usage().used_disk_blocks);
}

TEST_MAIN()
