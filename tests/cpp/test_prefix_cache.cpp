// Prefix cache exactness (verified hits, forced collisions, salts), the keyed hash, and the
// scheduler's error contract (snapshots outlive requests, a bad commit changes nothing).
#include <string>
#include <vector>

#include "block_pool.h"
#include "check.h"
#include "prefix_hash.h"
#include "scheduler_fixtures.h"
#include "vpage/scheduler.h"

using namespace vpage;
using namespace vpage_test;

namespace {

BlockManagerConfig caching_pools(int gpu, bool collide = false) {
  BlockManagerConfig c = pools(gpu, 8, true);
  c.collide_prefix_hashes_for_testing = collide;
  return c;
}

// Runs request `id` over `prompt` to completion (one token, 7) and returns the prompt tokens
// its admission took from the cache.
int run_one(Scheduler& s, const std::string& id, const std::vector<TokenId>& prompt, const std::string& salt = "") {
  s.add_sequence_group(id, prompt, 1, stop(1), 0.0, salt);
  auto plan = s.schedule();
  const int cached = s.find_group(id)->num_cached_prompt_tokens;
  std::vector<SeqId> ids = plan->sample_seq_ids;
  std::vector<TokenId> t(ids.size(), 7);
  s.commit(ids.data(), t.data(), static_cast<int64_t>(ids.size()));
  s.check_invariants();
  EXPECT(!s.has_unfinished());
  return cached;
}

}  // namespace

TEST_CASE("siphash128 matches the reference vector") {
  // SipHash-2-4-128, key 00 01 .. 0f, empty message: a3817f04ba25a8e6 6df67214c7550293.
  const BlockHash h = siphash128(0x0706050403020100ULL, 0x0f0e0d0c0b0a0908ULL, "", 0);
  EXPECT(h.lo == 0xe6a825ba047f81a3ULL && h.hi == 0x930255c71472f66dULL);
}

TEST_CASE("keyed hash: chained, salted, different per content") {
  PrefixHasher hasher;
  const auto t = tokens(4);
  const BlockHash root = hasher.hash_block(BlockHash{}, BlockHash{}, t.data(), 4);
  EXPECT(root == hasher.hash_block(BlockHash{}, BlockHash{}, t.data(), 4));
  EXPECT(root != hasher.hash_block(root, BlockHash{}, t.data(), 4));
  EXPECT(root != hasher.hash_block(BlockHash{}, hasher.hash_salt("a"), t.data(), 4));
  EXPECT(hasher.hash_salt("") == BlockHash{} && hasher.hash_salt("a") != hasher.hash_salt("b"));
  PrefixHasher colliding(true);
  const auto u = tokens(4, 50);
  EXPECT(colliding.hash_block(BlockHash{}, BlockHash{}, t.data(), 4) ==
         colliding.hash_block(root, BlockHash{}, u.data(), 4));
}

TEST_CASE("pool: a hit is verified against the recorded tokens, parent and salt") {
  BlockPool pool(Device::kGpu, 4, true, 2);
  const TokenId ta[2] = {1, 2}, tb[2] = {1, 3};
  const std::string salt = "s";
  const BlockHash same{5, 5};
  const BlockId a = pool.allocate();
  const uint64_t cid = pool.register_block(a, same, BlockContent{ta, kFirstBlock, nullptr});
  EXPECT(cid != kNoContent && pool.content_id(a) == cid);
  EXPECT(pool.lookup(same, BlockContent{ta, kFirstBlock, nullptr}, true) == a);
  EXPECT(pool.lookup(same, BlockContent{tb, kFirstBlock, nullptr}, true) == -1);   // other tokens
  EXPECT(pool.lookup(same, BlockContent{ta, cid, nullptr}, true) == -1);           // other parent
  EXPECT(pool.lookup(same, BlockContent{ta, kFirstBlock, &salt}, true) == -1);     // other salt
  EXPECT(pool.lookup(same, BlockContent{ta, kNoContent, nullptr}, true) == -1);    // uncached parent
  EXPECT(pool.cache_stats().collisions == 3 && pool.cache_stats().hits == 1);
  // Equal content elsewhere joins the existing entry; other content under the hash is refused.
  const BlockId b = pool.allocate();
  EXPECT(pool.register_block(b, same, BlockContent{ta, kFirstBlock, nullptr}) == cid);
  EXPECT(pool.content_id(b) == kNoContent);
  EXPECT(pool.register_block(b, same, BlockContent{tb, kFirstBlock, nullptr}) == kNoContent);
  EXPECT(pool.cache_stats().collisions == 4);
  // Content ids are never reused: after eviction, a child recorded under `cid` stays unreachable.
  pool.decref(a);
  pool.decref(b);
  for (int i = 0; i < pool.num_blocks(); ++i) pool.allocate();  // all 4 blocks: both evicted
  EXPECT(pool.lookup(same, BlockContent{ta, kFirstBlock, nullptr}, false) == -1);
}

TEST_CASE("prefix cache: forced collisions never share different contents") {
  Scheduler plain(SchedulerConfig{}, caching_pools(32));
  Scheduler colliding(SchedulerConfig{}, caching_pools(32, true));
  // Distinct prompts: nothing is shared, with or without collisions.
  for (int i = 0; i < 4; ++i) {
    EXPECT(run_one(plain, "p" + std::to_string(i), tokens(13, 100 * i + 1)) == 0);
    EXPECT(run_one(colliding, "p" + std::to_string(i), tokens(13, 100 * i + 1)) == 0);
  }
  EXPECT(colliding.usage().prefix_cache.collisions > 0);
  EXPECT(plain.usage().prefix_cache.collisions == 0);
  // The same prompt again: exact hits still happen (all 12 full-block tokens without
  // collisions; under one constant hash only the block that holds the index entry).
  EXPECT(run_one(plain, "again", tokens(13, 301)) == 12);
  const int colliding_hits = run_one(colliding, "again", tokens(13, 1));
  EXPECT(colliding_hits == 4);
}

TEST_CASE("prefix cache: salts never share blocks, equal salts do") {
  Scheduler s(SchedulerConfig{}, caching_pools(32));
  const auto prompt = tokens(9);
  EXPECT(run_one(s, "a", prompt, "tenant-1") == 0);
  EXPECT(run_one(s, "b", prompt, "tenant-2") == 0);
  EXPECT(run_one(s, "c", prompt, "") == 0);
  EXPECT(run_one(s, "d", prompt, "tenant-1") == 8);
  EXPECT(run_one(s, "e", prompt, "") == 8);
  Scheduler colliding(SchedulerConfig{}, caching_pools(32, true));
  EXPECT(run_one(colliding, "a", prompt, "tenant-1") == 0);
  EXPECT(run_one(colliding, "b", prompt, "tenant-2") == 0);
}

TEST_CASE("kv events: one stored event per new entry, chained; removed on eviction; off by default") {
  BlockManagerConfig config = caching_pools(8);
  config.enable_kv_cache_events = true;
  Scheduler s(SchedulerConfig{}, config);
  EXPECT(run_one(s, "a", tokens(13)) == 0);
  const std::vector<KvCacheEvent> stored = s.take_kv_events();
  EXPECT(stored.size() == 3);  // 12 of the 13 prompt tokens fill blocks of 4
  for (size_t i = 0; i < stored.size(); ++i) {
    const KvCacheEvent& e = stored[i];
    EXPECT(e.kind == KvCacheEvent::Kind::kStored && e.lora_id == 0);
    EXPECT(e.token_ids == tokens(4, 1 + 4 * static_cast<int>(i)));
    EXPECT(e.has_parent == (i > 0));
    if (i > 0) EXPECT(e.parent_hi == stored[i - 1].hash_hi && e.parent_lo == stored[i - 1].hash_lo);
    for (size_t j = 0; j < i; ++j) EXPECT(e.hash_hi != stored[j].hash_hi || e.hash_lo != stored[j].hash_lo);
  }
  EXPECT(s.take_kv_events().empty());  // taken: the log is empty
  EXPECT(run_one(s, "b", tokens(13)) == 12);
  EXPECT(s.take_kv_events().empty());  // hits store nothing new
  // 29 other tokens take all 8 blocks: the 3 cached ones are evicted first, then 7 new
  // blocks are stored.
  EXPECT(run_one(s, "c", tokens(29, 1000)) == 0);
  const std::vector<KvCacheEvent> churn = s.take_kv_events();
  EXPECT(churn.size() == 10);
  for (size_t i = 0; i < churn.size(); ++i) {
    EXPECT(churn[i].kind == (i < 3 ? KvCacheEvent::Kind::kRemoved : KvCacheEvent::Kind::kStored));
  }
  for (const KvCacheEvent& e : stored) {
    int removed = 0;
    for (size_t i = 0; i < 3; ++i) removed += churn[i].hash_hi == e.hash_hi && churn[i].hash_lo == e.hash_lo;
    EXPECT(removed == 1);
  }
  EXPECT(churn[3].token_ids == tokens(4, 1000) && !churn[3].has_parent);

  Scheduler quiet(SchedulerConfig{}, caching_pools(8));
  EXPECT(run_one(quiet, "a", tokens(13)) == 0);
  EXPECT(quiet.take_kv_events().empty());
}

TEST_CASE("reset_prefix_cache: refused while blocks are in use, then empties the cache (one event)") {
  BlockManagerConfig config = caching_pools(8);
  config.enable_kv_cache_events = true;
  Scheduler s(SchedulerConfig{}, config);
  EXPECT(run_one(s, "a", tokens(13)) == 0);
  s.add_sequence_group("running", tokens(9, 500), 1, stop(4), 0.0);
  s.schedule();  // holds 3 blocks
  s.take_kv_events();
  EXPECT(!s.reset_prefix_cache());
  EXPECT(s.take_kv_events().empty());
  EXPECT(s.abort("running"));
  EXPECT(s.reset_prefix_cache());
  const std::vector<KvCacheEvent> cleared = s.take_kv_events();
  EXPECT(cleared.size() == 1 && cleared[0].kind == KvCacheEvent::Kind::kAllCleared);
  s.check_invariants();
  EXPECT(run_one(s, "b", tokens(13)) == 0);  // a miss: computed again, then cached again
  EXPECT(run_one(s, "c", tokens(13)) == 12);
  EXPECT(s.usage().free_gpu_blocks == 8);
}

TEST_CASE("a snapshot taken before abort stays readable after it") {
  Scheduler s(SchedulerConfig{}, caching_pools(32));
  s.add_sequence_group("r", tokens(6), 2, stop(4), 0.0);
  s.schedule();
  const SequenceGroupSnapshot snap = s.find_group("r").value();
  const SequenceSnapshot seq = s.find_sequence(snap.seqs[1].seq_id).value();
  EXPECT(s.abort("r"));
  EXPECT(!s.find_group("r") && !s.find_sequence(seq.seq_id));
  EXPECT(snap.request_id == "r" && snap.seqs.size() == 2 && snap.seqs[0].tokens == tokens(6));
  EXPECT(seq.status == SequenceStatus::kRunning && !seq.block_table.empty());
  s.check_invariants();
}

TEST_CASE("a failing commit changes nothing; the step then commits normally") {
  Scheduler s(SchedulerConfig{}, caching_pools(32));
  Scheduler control(SchedulerConfig{}, caching_pools(32));
  for (Scheduler* x : {&s, &control}) {
    x->add_sequence_group("a", tokens(6), 1, stop(3), 0.0);
    x->add_sequence_group("b", tokens(30), 1, stop(3), 1.0);
  }
  auto plan = s.schedule();
  auto control_plan = control.schedule();
  std::vector<SeqId> ids = plan->sample_seq_ids;
  std::vector<TokenId> toks(ids.size(), 9);
  const auto expect_throws_unchanged = [&](std::vector<SeqId> bad_ids, std::vector<TokenId> bad_toks) {
    const int used = used_gpu_blocks(s);
    EXPECT_THROWS(s.commit(bad_ids.data(), bad_toks.data(), static_cast<int64_t>(bad_ids.size())), CheckError);
    EXPECT(used_gpu_blocks(s) == used);
    EXPECT(s.find_group("a")->seqs[0].num_computed_tokens == 0);
    s.check_invariants();
  };
  expect_throws_unchanged({ids[0], 12345}, {9, 9});      // never issued
  expect_throws_unchanged({ids[0], ids[0]}, {9, 9});     // twice
  expect_throws_unchanged({ids[0]}, {-1});               // negative token
  // A sequence that exists but did not sample in this step (nothing scheduled it).
  s.add_sequence_group("late", tokens(3), 1, stop(3), 2.0);
  control.add_sequence_group("late", tokens(3), 1, stop(3), 2.0);
  const SeqId late = s.find_group("late")->seqs[0].seq_id;
  expect_throws_unchanged({ids[0], late}, {9, 9});
  // Now the correct commit; the scheduler then behaves exactly like the control.
  s.commit(ids.data(), toks.data(), static_cast<int64_t>(ids.size()));
  std::vector<SeqId> cids = control_plan->sample_seq_ids;
  control.commit(cids.data(), toks.data(), static_cast<int64_t>(cids.size()));
  for (int i = 0; i < 6; ++i) {
    auto p = s.schedule();
    auto q = control.schedule();
    EXPECT(p->input_ids == q->input_ids && p->slot_mapping == q->slot_mapping);
    std::vector<SeqId> pi = p->sample_seq_ids, qi = q->sample_seq_ids;
    std::vector<TokenId> t(pi.size(), 9);
    s.commit(pi.data(), t.data(), static_cast<int64_t>(pi.size()));
    control.commit(qi.data(), t.data(), static_cast<int64_t>(qi.size()));
    s.check_invariants();
  }
  EXPECT(!s.has_unfinished() && !control.has_unfinished());
}

TEST_MAIN()
