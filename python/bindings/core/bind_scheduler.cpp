// vpage._core: the scheduler and its step plan (flat buffers as numpy views, no copies).
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "vpage/scheduler.h"

namespace py = pybind11;

namespace vpage::bindings {
namespace {

// Numpy view of `data` whose lifetime is tied to `owner` (the Python plan object). Left
// writeable so torch.from_numpy wraps it without a warning; the plan is output only.
template <typename T>
py::array view(const std::vector<T>& data, py::handle owner, std::vector<py::ssize_t> shape) {
  return py::array_t<T>(shape, data.empty() ? nullptr : data.data(), data.empty() ? py::handle() : owner);
}

template <typename T>
py::array flat(const std::vector<T>& data, py::handle owner) {
  return view(data, owner, {static_cast<py::ssize_t>(data.size())});
}

// [n, 2] int64 copy of block pairs (small; the shape ops.copy_blocks / swap_blocks take).
py::array pairs(const std::vector<BlockPair>& p) {
  py::array_t<int64_t> arr({static_cast<py::ssize_t>(p.size()), py::ssize_t{2}});
  auto a = arr.mutable_unchecked<2>();
  for (size_t i = 0; i < p.size(); ++i) {
    a(i, 0) = p[i].first;
    a(i, 1) = p[i].second;
  }
  return std::move(arr);
}

}  // namespace

void bind_scheduler(py::module_& m) {
  using Plan = SchedulePlan;
  py::class_<Plan, std::shared_ptr<Plan>>(m, "SchedulePlan",
      "One engine step: the computing sequences (rows), flat token inputs, sampling rows and "
      "block operations. Arrays are views (no copy) valid as long as the plan object lives.")
      .def_readonly("step_id", &Plan::step_id)
      .def_property_readonly("num_seqs", &Plan::num_seqs)
      .def_property_readonly("num_tokens", &Plan::num_tokens)
      .def_property_readonly("empty", &Plan::empty)
      .def_readonly("max_blocks", &Plan::max_blocks)
      .def_readonly("max_context_len", &Plan::max_context_len)
      .def_readonly("max_query_len", &Plan::max_query_len)
      .def_readonly("num_prefill_tokens", &Plan::num_prefill_tokens)
      .def_readonly("num_decode_tokens", &Plan::num_decode_tokens)
      .def_readonly("num_draft_tokens", &Plan::num_draft_tokens)
      .def_readonly("num_preempted_recompute", &Plan::num_preempted_recompute)
      .def_readonly("num_preempted_swap", &Plan::num_preempted_swap)
      .def_property_readonly("seq_ids", [](py::object self) { return flat(self.cast<const Plan&>().seq_ids, self); },
                             "[num_seqs] int64 sequences computing this step")
      .def_property_readonly("query_start_loc", [](py::object self) { return flat(self.cast<const Plan&>().query_start_loc, self); },
                             "[num_seqs + 1] int32 token offsets of the rows")
      .def_property_readonly("context_lens", [](py::object self) { return flat(self.cast<const Plan&>().context_lens, self); },
                             "[num_seqs] int32 tokens in the cache after this step")
      .def_property_readonly("lora_ids", [](py::object self) { return flat(self.cast<const Plan&>().lora_ids, self); },
                             "[num_seqs] int32 LoRA adapter of each row (0: the base model)")
      .def_property_readonly("block_tables", [](py::object self) {
            const Plan& p = self.cast<const Plan&>();
            return view(p.block_tables, self, {p.num_seqs(), p.max_blocks});
          }, "[num_seqs, max_blocks] int32, padded with 0; -1 before a sliding window")
      .def_property_readonly("input_ids", [](py::object self) { return flat(self.cast<const Plan&>().input_ids, self); },
                             "[num_tokens] int64")
      .def_property_readonly("positions", [](py::object self) { return flat(self.cast<const Plan&>().positions, self); },
                             "[num_tokens] int64")
      .def_property_readonly("slot_mapping", [](py::object self) { return flat(self.cast<const Plan&>().slot_mapping, self); },
                             "[num_tokens] int64 block_id * block_size + offset")
      .def_property_readonly("sample_seq_ids", [](py::object self) { return flat(self.cast<const Plan&>().sample_seq_ids, self); },
                             "[num_samples] int64 sequences that get a token after this step")
      .def_property_readonly("sample_token_indices", [](py::object self) { return flat(self.cast<const Plan&>().sample_token_indices, self); },
                             "[num_samples] int64 token row whose logits each of them samples")
      .def_property_readonly("sample_num_drafts", [](py::object self) { return flat(self.cast<const Plan&>().sample_num_drafts, self); },
                             "[num_samples] int32 draft tokens verified with each sample; they end at its row")
      .def_property_readonly("blocks_to_swap_out", [](const Plan& p) { return pairs(p.blocks_to_swap_out); }, "[n, 2] int64 (gpu, cpu)")
      .def_property_readonly("blocks_to_swap_in", [](const Plan& p) { return pairs(p.blocks_to_swap_in); }, "[n, 2] int64 (cpu, gpu)")
      .def_property_readonly("blocks_to_copy", [](const Plan& p) { return pairs(p.blocks_to_copy); }, "[n, 2] int64 (src, dst)")
      .def_readonly("kv_saves", &Plan::kv_saves, "[KvBlockSave] CPU blocks to write to disk, first of all moves")
      .def_readonly("kv_loads", &Plan::kv_loads, "[KvBlockLoad] files to read into CPU blocks, after swap-out")
      .def_property_readonly("kv_deletes", [](const Plan& p) {
            py::list keys;
            for (const auto& [hi, lo] : p.kv_deletes) keys.append(hash_bytes(hi, lo));
            return keys;
          }, "[16-byte key] files of the disk tier to delete")
      .def_readonly("ignored", &Plan::ignored, "[(request_id, reason)] finished as ignored in this step");

  py::class_<CommitResult>(m, "CommitResult", "What commit() did.")
      .def_property_readonly("statuses", [](const CommitResult& r) {
            return py::array_t<int32_t>(static_cast<py::ssize_t>(r.statuses.size()), r.statuses.data());
          }, "[count] int32 SequenceStatus value of each given sequence after the commit")
      .def_property_readonly("stop_token_ids", [](const CommitResult& r) {
            return py::array_t<int32_t>(static_cast<py::ssize_t>(r.stop_token_ids.size()), r.stop_token_ids.data());
          }, "[count] int32 the stop token id that finished each given sequence now, else -1")
      .def_readonly("finished_request_ids", &CommitResult::finished_request_ids);

  py::class_<Scheduler>(m, "Scheduler",
      "Continuous-batching scheduler over a block manager: FCFS queues, token budget, chunked "
      "prefill, preemption by recompute or swap, prefix caching.")
      .def(py::init<const SchedulerConfig&, const BlockManagerConfig&>(), py::arg("config"),
           py::arg("block_config"))
      .def("add_sequence_group",
           [](Scheduler& s, const std::string& request_id, std::vector<TokenId> prompt, int32_t num_seqs,
              const StopConditions& stop, double arrival_time, const std::string& cache_salt, bool speculate,
              int32_t lora_id) {
             return s.add_sequence_group(request_id, std::move(prompt), num_seqs, stop, arrival_time, cache_salt,
                                         speculate, lora_id);
           },
           py::arg("request_id"), py::arg("prompt"), py::arg("num_seqs"), py::arg("stop"),
           py::arg("arrival_time"), py::arg("cache_salt") = "", py::arg("speculate") = true, py::arg("lora_id") = 0,
           "Adds a request of `num_seqs` sequences over `prompt` (token ids); returns their ids.")
      .def("abort", &Scheduler::abort, py::arg("request_id"),
           "Finishes the request as aborted from any queue; False when unknown.")
      .def("schedule",
           [](Scheduler& s) {
             std::shared_ptr<const SchedulePlan> plan;
             {
               py::gil_scoped_release release;
               plan = s.schedule();
             }
             return std::const_pointer_cast<SchedulePlan>(plan);
           },
           "Plans the next step (valid until the next schedule()).")
      .def("commit",
           [](Scheduler& s, py::array_t<int64_t, py::array::c_style | py::array::forcecast> seq_ids,
              py::array_t<int32_t, py::array::c_style | py::array::forcecast> token_ids) {
             if (seq_ids.ndim() != 1 || token_ids.ndim() != 1 || seq_ids.size() != token_ids.size()) {
               throw py::value_error("commit: seq_ids and token_ids must be 1-D arrays of equal length");
             }
             const int64_t* ids = seq_ids.data();
             const int32_t* toks = token_ids.data();
             const int64_t n = seq_ids.size();
             py::gil_scoped_release release;
             return s.commit(ids, toks, n);
           },
           py::arg("seq_ids"), py::arg("token_ids"),
           "Records the step and appends token_ids[i] to seq_ids[i]; applies EOS/stop/length. A "
           "speculating sequence is given its accepted drafts and the verified token as consecutive entries.")
      .def("fill_drafts",
           [](Scheduler& s, py::array_t<int32_t, py::array::c_style | py::array::forcecast> tokens) {
             if (tokens.ndim() != 1) throw py::value_error("fill_drafts: tokens must be a 1-D array");
             s.fill_drafts(tokens.data(), tokens.size());
           },
           py::arg("tokens"),
           "With external_drafts: the last plan's draft tokens in sample order (into the plan's input_ids too).")
      .def("observe_step_time", &Scheduler::observe_step_time, py::arg("seconds"),
           "Wall time of the step last planned; decode steps teach the draft policy what a row costs.")
      .def("fork_sequence", &Scheduler::fork_sequence, py::arg("parent"),
           "New sequence sharing the parent's tokens and blocks; returns its id.")
      .def("finish_sequence", &Scheduler::finish_sequence, py::arg("seq_id"), py::arg("status"),
           "Finishes one sequence; True when its whole group finished.")
      .def_property_readonly("num_waiting", &Scheduler::num_waiting)
      .def_property_readonly("num_running", &Scheduler::num_running)
      .def_property_readonly("num_swapped", &Scheduler::num_swapped)
      .def("has_unfinished", &Scheduler::has_unfinished)
      .def("num_kv_tokens", &Scheduler::num_kv_tokens,
           "Tokens whose K/V the running sequences hold (identical samples' prompt counted once).")
      .def("find_group", &Scheduler::find_group, py::arg("request_id"),
           "A snapshot (copy) of the unfinished group, or None.")
      .def("find_sequence", &Scheduler::find_sequence, py::arg("seq_id"),
           "A snapshot (copy) of a sequence of an unfinished group, or None.")
      .def_property_readonly("config", &Scheduler::config)
      .def_property_readonly("block_config", &Scheduler::block_config, py::return_value_policy::copy)
      .def_property_readonly("stats", &Scheduler::stats)
      .def("usage", &Scheduler::usage, "Occupancy of both pools and prefix-cache counters.")
      .def("take_kv_events", &Scheduler::take_kv_events,
           "KvCacheEvents of the GPU prefix cache since the last call (enable_kv_cache_events).")
      .def("reset_prefix_cache", &Scheduler::reset_prefix_cache,
           "Empties the GPU prefix cache when nothing holds GPU blocks; False (no change) otherwise.")
      .def("complete_kv_loads", &Scheduler::complete_kv_loads, py::arg("done"), py::arg("failed"),
           "KvBlockLoads of earlier plans that finished: read (done) or unreadable (failed).")
      .def("add_disk_block",
           [](Scheduler& s, const std::string& key, bool first, const std::string& salt, std::vector<TokenId> tokens) {
             const auto [hi, lo] = hash_words(key);
             py::list gone;
             for (const auto& [ghi, glo] : s.add_disk_block(hi, lo, first, salt, tokens)) gone.append(hash_bytes(ghi, glo));
             return gone;
           },
           py::arg("key"), py::arg("first"), py::arg("salt"), py::arg("tokens"),
           "Indexes a block an earlier engine wrote to disk (its header); returns the keys pushed out.")
      .def("check_invariants", &Scheduler::check_invariants,
           "Raises unless queues, statuses, block tables and pools are consistent.");
}

}  // namespace vpage::bindings
