// vpage._core: enums, configs, stop conditions, read-only views of sequences and groups.
#include <pybind11/stl.h>

#include "bindings.h"
#include "block_manager.h"
#include "block_pool.h"
#include "vpage/scheduler.h"
#include "vpage/sequence.h"

namespace py = pybind11;

namespace vpage::bindings {
namespace {

// BlockContent over a Python token list, which must hold exactly one block.
BlockContent content(const BlockPool& pool, const std::vector<TokenId>& tokens, uint64_t parent,
                     const std::string& salt) {
  if (static_cast<int64_t>(tokens.size()) != pool.block_size()) {
    throw py::value_error("a block holds " + std::to_string(pool.block_size()) + " tokens, got " +
                          std::to_string(tokens.size()));
  }
  BlockContent c;
  c.tokens = tokens.data();
  c.parent = parent;
  c.salt = &salt;
  return c;
}


}  // namespace

void bind_types(py::module_& m) {
  py::enum_<Device>(m, "Device", "Pool a block lives in.")
      .value("GPU", Device::kGpu)
      .value("CPU", Device::kCpu);
  py::enum_<AllocStatus>(m, "AllocStatus", "Answer of can_allocate / can_swap_in.")
      .value("OK", AllocStatus::kOk)
      .value("LATER", AllocStatus::kLater)
      .value("NEVER", AllocStatus::kNever);
  py::enum_<SequenceStatus>(m, "SequenceStatus", "Lifecycle of a sequence; FINISHED_* say why it ended.")
      .value("WAITING", SequenceStatus::kWaiting)
      .value("RUNNING", SequenceStatus::kRunning)
      .value("SWAPPED", SequenceStatus::kSwapped)
      .value("FINISHED_STOPPED", SequenceStatus::kFinishedStopped)
      .value("FINISHED_LENGTH", SequenceStatus::kFinishedLength)
      .value("FINISHED_ABORTED", SequenceStatus::kFinishedAborted)
      .value("FINISHED_IGNORED", SequenceStatus::kFinishedIgnored);
  m.def("is_finished", &is_finished, py::arg("status"), "True for the FINISHED_* statuses.");
  m.def("status_name", &status_name, py::arg("status"),
        "vLLM's finish reason ('stop', 'length', 'abort', 'ignored') or the state name.");
  py::enum_<PreemptionMode>(m, "PreemptionMode", "How running groups are preempted when blocks run out.")
      .value("AUTO", PreemptionMode::kAuto)
      .value("RECOMPUTE", PreemptionMode::kRecompute)
      .value("SWAP", PreemptionMode::kSwap);

  py::class_<StopConditions>(m, "StopConditions", "When the C++ side finishes a sequence by itself.")
      .def(py::init([](int32_t max_tokens, int32_t min_tokens, std::vector<TokenId> eos_token_ids,
                       std::vector<TokenId> stop_token_ids, bool ignore_eos) {
             StopConditions s;
             s.max_tokens = max_tokens;
             s.min_tokens = min_tokens;
             s.eos_token_ids = std::move(eos_token_ids);
             s.stop_token_ids = std::move(stop_token_ids);
             s.ignore_eos = ignore_eos;
             return s;
           }),
           py::arg("max_tokens") = 16, py::arg("min_tokens") = 0,
           py::arg("eos_token_ids") = std::vector<TokenId>{},
           py::arg("stop_token_ids") = std::vector<TokenId>{}, py::arg("ignore_eos") = false)
      .def_readwrite("max_tokens", &StopConditions::max_tokens)
      .def_readwrite("min_tokens", &StopConditions::min_tokens)
      .def_readwrite("eos_token_ids", &StopConditions::eos_token_ids)
      .def_readwrite("stop_token_ids", &StopConditions::stop_token_ids)
      .def_readwrite("ignore_eos", &StopConditions::ignore_eos);

  py::class_<BlockManagerConfig>(m, "BlockManagerConfig", "Sizes of the KV pools and the admission watermark.")
      .def(py::init([](int32_t block_size, int32_t num_gpu_blocks, int32_t num_cpu_blocks,
                       double watermark, bool enable_prefix_caching, bool collide_prefix_hashes_for_testing,
                       int32_t sliding_window, bool enable_kv_cache_events, bool enable_kv_offload,
                       int32_t num_disk_blocks, uint64_t prefix_hash_key0, uint64_t prefix_hash_key1) {
             return BlockManagerConfig{block_size, num_gpu_blocks, num_cpu_blocks, watermark,
                                       enable_prefix_caching, collide_prefix_hashes_for_testing, sliding_window,
                                       enable_kv_cache_events, enable_kv_offload, num_disk_blocks,
                                       prefix_hash_key0, prefix_hash_key1};
           }),
           py::arg("block_size") = 16, py::arg("num_gpu_blocks") = 0, py::arg("num_cpu_blocks") = 0,
           py::arg("watermark") = 0.01, py::arg("enable_prefix_caching") = true,
           py::arg("collide_prefix_hashes_for_testing") = false, py::arg("sliding_window") = 0,
           py::arg("enable_kv_cache_events") = false, py::arg("enable_kv_offload") = false,
           py::arg("num_disk_blocks") = 0, py::arg("prefix_hash_key0") = 0, py::arg("prefix_hash_key1") = 0)
      .def_readwrite("block_size", &BlockManagerConfig::block_size)
      .def_readwrite("num_gpu_blocks", &BlockManagerConfig::num_gpu_blocks)
      .def_readwrite("num_cpu_blocks", &BlockManagerConfig::num_cpu_blocks)
      .def_readwrite("watermark", &BlockManagerConfig::watermark)
      .def_readwrite("enable_prefix_caching", &BlockManagerConfig::enable_prefix_caching)
      .def_readwrite("collide_prefix_hashes_for_testing", &BlockManagerConfig::collide_prefix_hashes_for_testing)
      .def_readwrite("sliding_window", &BlockManagerConfig::sliding_window,
                     "window W of every attention layer (0: none); blocks before it are freed")
      .def_readwrite("enable_kv_cache_events", &BlockManagerConfig::enable_kv_cache_events,
                     "record the GPU prefix cache's KvCacheEvents (Scheduler.take_kv_events)")
      .def_readwrite("enable_kv_offload", &BlockManagerConfig::enable_kv_offload,
                     "the CPU pool keeps the GPU prefix cache's evicted blocks; hits are swapped back in")
      .def_readwrite("num_disk_blocks", &BlockManagerConfig::num_disk_blocks,
                     "blocks of the disk tier below the CPU pool (0: none)")
      .def_readwrite("prefix_hash_key0", &BlockManagerConfig::prefix_hash_key0)
      .def_readwrite("prefix_hash_key1", &BlockManagerConfig::prefix_hash_key1,
                     "key of the block hashes (both 0: drawn per process)");

  py::class_<KvBlockSave>(m, "KvBlockSave", "A CPU block to write to the disk tier.")
      .def_readonly("cpu_block", &KvBlockSave::cpu_block)
      .def_property_readonly("key", [](const KvBlockSave& s) { return hash_bytes(s.hash_hi, s.hash_lo); },
                             "16 bytes: the block's chained hash, its file's name")
      .def_readonly("first", &KvBlockSave::first, "a sequence's first block (salt is its cache salt)")
      .def_property_readonly("salt", [](const KvBlockSave& s) { return py::bytes(s.salt); })
      .def_readonly("tokens", &KvBlockSave::tokens);
  py::class_<KvBlockLoad>(m, "KvBlockLoad", "A block to read from the disk tier into a CPU block.")
      .def_property_readonly("key", [](const KvBlockLoad& l) { return hash_bytes(l.hash_hi, l.hash_lo); })
      .def_readonly("cpu_block", &KvBlockLoad::cpu_block);

  py::enum_<KvCacheEvent::Kind>(m, "KvCacheEventKind")
      .value("STORED", KvCacheEvent::Kind::kStored)
      .value("REMOVED", KvCacheEvent::Kind::kRemoved)
      .value("ALL_CLEARED", KvCacheEvent::Kind::kAllCleared);
  py::class_<KvCacheEvent>(m, "KvCacheEvent",
                           "A block that entered (STORED) or left (REMOVED) the GPU prefix cache, or the "
                           "whole cache emptied (ALL_CLEARED, by reset_prefix_cache).")
      .def_readonly("kind", &KvCacheEvent::kind)
      .def_property_readonly("block_hash", [](const KvCacheEvent& e) { return hash_bytes(e.hash_hi, e.hash_lo); },
                             "16 bytes, big-endian: the block's chained content hash")
      .def_property_readonly(
          "parent_block_hash",
          [](const KvCacheEvent& e) -> py::object {
            return e.has_parent ? py::object(hash_bytes(e.parent_hi, e.parent_lo)) : py::none();
          },
          "STORED: the previous block's hash, None for a first block")
      .def_readonly("lora_id", &KvCacheEvent::lora_id)
      .def_readonly("token_ids", &KvCacheEvent::token_ids, "STORED: the block's tokens");

  py::class_<SchedulerConfig>(m, "SchedulerConfig", "Budgets and policies of the scheduler.")
      .def(py::init([](int32_t max_num_batched_tokens, int32_t max_num_seqs, int32_t max_model_len,
                       bool enable_chunked_prefill, PreemptionMode preemption_mode, int32_t num_speculative_tokens,
                       int32_t prompt_lookup_min, int32_t prompt_lookup_max,
                       int32_t speculative_disable_by_batch_size, bool external_drafts, int32_t max_loras) {
             return SchedulerConfig{max_num_batched_tokens, max_num_seqs, max_model_len,
                                    enable_chunked_prefill, preemption_mode, num_speculative_tokens,
                                    prompt_lookup_min, prompt_lookup_max, speculative_disable_by_batch_size,
                                    external_drafts, max_loras};
           }),
           py::arg("max_num_batched_tokens") = 2048, py::arg("max_num_seqs") = 256,
           py::arg("max_model_len") = 2048, py::arg("enable_chunked_prefill") = true,
           py::arg("preemption_mode") = PreemptionMode::kAuto, py::arg("num_speculative_tokens") = 0,
           py::arg("prompt_lookup_min") = 5, py::arg("prompt_lookup_max") = 5,
           py::arg("speculative_disable_by_batch_size") = 0, py::arg("external_drafts") = false,
           py::arg("max_loras") = 0)
      .def_readwrite("max_num_batched_tokens", &SchedulerConfig::max_num_batched_tokens)
      .def_readwrite("max_num_seqs", &SchedulerConfig::max_num_seqs)
      .def_readwrite("max_model_len", &SchedulerConfig::max_model_len)
      .def_readwrite("enable_chunked_prefill", &SchedulerConfig::enable_chunked_prefill)
      .def_readwrite("preemption_mode", &SchedulerConfig::preemption_mode)
      .def_readwrite("num_speculative_tokens", &SchedulerConfig::num_speculative_tokens,
                     "n-gram draft tokens per decoding sequence at most (0: no speculation)")
      .def_readwrite("prompt_lookup_min", &SchedulerConfig::prompt_lookup_min)
      .def_readwrite("prompt_lookup_max", &SchedulerConfig::prompt_lookup_max)
      .def_readwrite("speculative_disable_by_batch_size", &SchedulerConfig::speculative_disable_by_batch_size,
                     "no drafts in a step that starts with more running sequences (0: no limit)")
      .def_readwrite("external_drafts", &SchedulerConfig::external_drafts,
                     "drafts come from the caller (fill_drafts), not from n-gram lookup")
      .def_readwrite("max_loras", &SchedulerConfig::max_loras,
                     "distinct LoRA adapters among running requests at most (0: no limit)");

  py::class_<SequenceSnapshot>(m, "SequenceSnapshot",
      "A copy of one sequence's state, taken by Scheduler.find_sequence/find_group; it stays "
      "readable (and unchanged) after the request finishes or is aborted.")
      .def_readonly("seq_id", &SequenceSnapshot::seq_id)
      .def_readonly("status", &SequenceSnapshot::status)
      .def_readonly("tokens", &SequenceSnapshot::tokens)
      .def_readonly("prompt_len", &SequenceSnapshot::prompt_len)
      .def_property_readonly("num_tokens", [](const SequenceSnapshot& s) { return s.tokens.size(); })
      .def_property_readonly("num_output_tokens",
                             [](const SequenceSnapshot& s) { return static_cast<int32_t>(s.tokens.size()) - s.prompt_len; })
      .def_readonly("num_computed_tokens", &SequenceSnapshot::num_computed_tokens)
      .def_readonly("block_table", &SequenceSnapshot::block_table)
      .def_readonly("block_device", &SequenceSnapshot::block_device)
      .def_readonly("stop_token", &SequenceSnapshot::stop_token);

  py::class_<SequenceGroupSnapshot>(m, "SequenceGroupSnapshot",
      "A copy of one request's state (sequences included); readable after the request ends.")
      .def_readonly("request_id", &SequenceGroupSnapshot::request_id)
      .def_readonly("arrival_time", &SequenceGroupSnapshot::arrival_time)
      .def_property_readonly("num_seqs", [](const SequenceGroupSnapshot& g) { return g.seqs.size(); })
      .def_readonly("num_unfinished", &SequenceGroupSnapshot::num_unfinished)
      .def_readonly("num_preemptions", &SequenceGroupSnapshot::num_preemptions)
      .def_readonly("num_cached_prompt_tokens", &SequenceGroupSnapshot::num_cached_prompt_tokens)
      .def_readonly("seqs", &SequenceGroupSnapshot::seqs)
      .def("seq", [](const SequenceGroupSnapshot& g, size_t index) { return g.seqs.at(index); }, py::arg("index"));

  py::class_<PrefixCacheStats>(m, "PrefixCacheStats", "Prefix-cache counters.")
      .def_readonly("queries", &PrefixCacheStats::queries)
      .def_readonly("hits", &PrefixCacheStats::hits)
      .def_readonly("evictions", &PrefixCacheStats::evictions)
      .def_readonly("collisions", &PrefixCacheStats::collisions);
  py::class_<BlockUsage>(m, "BlockUsage", "Occupancy of both pools.")
      .def_readonly("num_gpu_blocks", &BlockUsage::num_gpu_blocks)
      .def_readonly("free_gpu_blocks", &BlockUsage::free_gpu_blocks)
      .def_readonly("num_cpu_blocks", &BlockUsage::num_cpu_blocks)
      .def_readonly("free_cpu_blocks", &BlockUsage::free_cpu_blocks)
      .def_readonly("prefix_cache", &BlockUsage::prefix_cache)
      .def_readonly("cpu_prefix_cache", &BlockUsage::cpu_prefix_cache, "the CPU tier's lookups (enable_kv_offload)")
      .def_readonly("disk_prefix_cache", &BlockUsage::disk_prefix_cache, "the disk tier's lookups")
      .def_readonly("num_disk_blocks", &BlockUsage::num_disk_blocks)
      .def_readonly("used_disk_blocks", &BlockUsage::used_disk_blocks);
  py::class_<SchedulerStats>(m, "SchedulerStats", "Running totals of the scheduler.")
      .def_readonly("num_steps", &SchedulerStats::num_steps)
      .def_readonly("num_preempted_recompute", &SchedulerStats::num_preempted_recompute)
      .def_readonly("num_preempted_swap", &SchedulerStats::num_preempted_swap)
      .def_readonly("num_prefill_tokens", &SchedulerStats::num_prefill_tokens)
      .def_readonly("num_decode_tokens", &SchedulerStats::num_decode_tokens)
      .def_readonly("num_cached_prompt_tokens", &SchedulerStats::num_cached_prompt_tokens)
      .def_readonly("num_drafts", &SchedulerStats::num_drafts)
      .def_readonly("num_draft_tokens", &SchedulerStats::num_draft_tokens)
      .def_readonly("num_accepted_tokens", &SchedulerStats::num_accepted_tokens);

  py::class_<BlockPool>(m, "BlockPool", "One pool of KV blocks with refcounts and an O(1) LRU free queue.")
      .def(py::init<Device, int32_t, bool, int32_t>(), py::arg("device"), py::arg("num_blocks"),
           py::arg("enable_caching") = false, py::arg("block_size") = 16)
      .def_property_readonly("num_blocks", &BlockPool::num_blocks)
      .def_property_readonly("num_free", &BlockPool::num_free)
      .def_property_readonly("num_used", &BlockPool::num_used)
      .def("allocate", &BlockPool::allocate, "Takes the least recently freed block (refcount 1).")
      .def("incref", &BlockPool::incref, py::arg("block"))
      .def("decref", &BlockPool::decref, py::arg("block"), "Drops a reference; raises on a double free.")
      .def("refcount", &BlockPool::refcount, py::arg("block"))
      .def("lookup",
           [](BlockPool& p, std::pair<uint64_t, uint64_t> hash, const std::vector<TokenId>& tokens, uint64_t parent,
              const std::string& salt, bool count) {
             return p.lookup(BlockHash{hash.first, hash.second}, content(p, tokens, parent, salt), count);
           },
           py::arg("hash"), py::arg("tokens"), py::arg("parent") = kFirstBlock, py::arg("salt") = "",
           py::arg("count") = true,
           "Cached block indexed by `hash` (lo, hi) whose recorded content (tokens, parent content "
           "id, salt) is equal, or -1.")
      .def("acquire_cached", &BlockPool::acquire_cached, py::arg("block"))
      .def("register_block",
           [](BlockPool& p, BlockId block, std::pair<uint64_t, uint64_t> hash, const std::vector<TokenId>& tokens,
              uint64_t parent, const std::string& salt) {
             return p.register_block(block, BlockHash{hash.first, hash.second}, content(p, tokens, parent, salt));
           },
           py::arg("block"), py::arg("hash"), py::arg("tokens"), py::arg("parent") = kFirstBlock,
           py::arg("salt") = "",
           "Offers a full block to the cache; returns the content id of the entry holding that content.")
      .def("content_id", &BlockPool::content_id, py::arg("block"))
      .def_property_readonly("cache_stats", &BlockPool::cache_stats);
  m.attr("FIRST_BLOCK") = kFirstBlock;
  m.attr("NO_CONTENT") = kNoContent;
}

}  // namespace vpage::bindings
