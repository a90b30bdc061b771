# Type stubs of vpage._core.

from enum import IntEnum
from typing import Optional

import numpy as np
import numpy.typing as npt

class CheckError(ValueError):
    """A broken precondition of a core or CPU kernel call (the message says which)."""

class Device(IntEnum):
    GPU = 0
    CPU = 1

class AllocStatus(IntEnum):
    OK = 0
    LATER = 1
    NEVER = 2

class SequenceStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6

class PreemptionMode(IntEnum):
    AUTO = 0
    RECOMPUTE = 1
    SWAP = 2

def is_finished(status: SequenceStatus) -> bool: ...
def status_name(status: SequenceStatus) -> str: ...

class StopConditions:
    max_tokens: int
    min_tokens: int
    eos_token_ids: list[int]
    stop_token_ids: list[int]
    ignore_eos: bool
    def __init__(self, max_tokens: int = 16, min_tokens: int = 0, eos_token_ids: list[int] = ...,
                 stop_token_ids: list[int] = ..., ignore_eos: bool = False) -> None: ...

class BlockManagerConfig:
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    watermark: float
    enable_prefix_caching: bool
    collide_prefix_hashes_for_testing: bool
    sliding_window: int
    enable_kv_cache_events: bool
    def __init__(self, block_size: int = 16, num_gpu_blocks: int = 0, num_cpu_blocks: int = 0,
                 watermark: float = 0.01, enable_prefix_caching: bool = True,
                 collide_prefix_hashes_for_testing: bool = False, sliding_window: int = 0,
                 enable_kv_cache_events: bool = False) -> None: ...

class KvCacheEventKind(IntEnum):
    STORED = 0
    REMOVED = 1
    ALL_CLEARED = 2

class KvCacheEvent:
    kind: KvCacheEventKind
    block_hash: bytes  # 16 bytes, big-endian
    parent_block_hash: Optional[bytes]  # STORED: None for a first block
    lora_id: int
    token_ids: list[int]  # STORED: the block's tokens

class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool
    preemption_mode: PreemptionMode
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    speculative_disable_by_batch_size: int
    external_drafts: bool
    max_loras: int
    def __init__(self, max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
                 max_model_len: int = 2048, enable_chunked_prefill: bool = True,
                 preemption_mode: PreemptionMode = PreemptionMode.AUTO, num_speculative_tokens: int = 0,
                 prompt_lookup_min: int = 5, prompt_lookup_max: int = 5,
                 speculative_disable_by_batch_size: int = 0, external_drafts: bool = False,
                 max_loras: int = 0) -> None: ...

class SequenceSnapshot:
    """A copy of one sequence's state; stays readable after its request ends."""
    seq_id: int
    status: SequenceStatus
    tokens: list[int]
    prompt_len: int
    num_computed_tokens: int
    block_table: list[int]
    block_device: Device
    stop_token: int
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...

class SequenceGroupSnapshot:
    """A copy of one request's state (its sequences included)."""
    request_id: str
    arrival_time: float
    num_unfinished: int
    num_preemptions: int
    num_cached_prompt_tokens: int
    seqs: list[SequenceSnapshot]
    @property
    def num_seqs(self) -> int: ...
    def seq(self, index: int) -> SequenceSnapshot: ...

class PrefixCacheStats:
    queries: int
    hits: int
    evictions: int
    collisions: int

class BlockUsage:
    num_gpu_blocks: int
    free_gpu_blocks: int
    num_cpu_blocks: int
    free_cpu_blocks: int
    prefix_cache: PrefixCacheStats

class SchedulerStats:
    num_steps: int
    num_preempted_recompute: int
    num_preempted_swap: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_cached_prompt_tokens: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int

FIRST_BLOCK: int  # `parent` of a sequence's first block
NO_CONTENT: int  # content id of a block that is not in the prefix cache

class BlockPool:
    def __init__(self, device: Device, num_blocks: int, enable_caching: bool = False,
                 block_size: int = 16) -> None: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free(self) -> int: ...
    @property
    def num_used(self) -> int: ...
    def allocate(self) -> int: ...
    def incref(self, block: int) -> None: ...
    def decref(self, block: int) -> None: ...
    def refcount(self, block: int) -> int: ...
    def lookup(self, hash: tuple[int, int], tokens: list[int], parent: int = ..., salt: str = "",
               count: bool = True) -> int: ...
    def acquire_cached(self, block: int) -> None: ...
    def register_block(self, block: int, hash: tuple[int, int], tokens: list[int], parent: int = ...,
                       salt: str = "") -> int: ...
    def content_id(self, block: int) -> int: ...
    @property
    def cache_stats(self) -> PrefixCacheStats: ...

class SchedulePlan:
    step_id: int
    max_blocks: int
    max_context_len: int
    max_query_len: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_draft_tokens: int
    num_preempted_recompute: int
    num_preempted_swap: int
    ignored: list[tuple[str, str]]
    @property
    def num_seqs(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def empty(self) -> bool: ...
    @property
    def seq_ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def query_start_loc(self) -> npt.NDArray[np.int32]: ...
    @property
    def context_lens(self) -> npt.NDArray[np.int32]: ...
    @property
    def lora_ids(self) -> npt.NDArray[np.int32]: ...
    @property
    def block_tables(self) -> npt.NDArray[np.int32]: ...
    @property
    def input_ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def positions(self) -> npt.NDArray[np.int64]: ...
    @property
    def slot_mapping(self) -> npt.NDArray[np.int64]: ...
    @property
    def sample_seq_ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def sample_token_indices(self) -> npt.NDArray[np.int64]: ...
    @property
    def sample_num_drafts(self) -> npt.NDArray[np.int32]: ...
    @property
    def blocks_to_swap_out(self) -> npt.NDArray[np.int64]: ...
    @property
    def blocks_to_swap_in(self) -> npt.NDArray[np.int64]: ...
    @property
    def blocks_to_copy(self) -> npt.NDArray[np.int64]: ...

class CommitResult:
    @property
    def statuses(self) -> npt.NDArray[np.int32]: ...
    @property
    def stop_token_ids(self) -> npt.NDArray[np.int32]: ...
    finished_request_ids: list[str]

class Scheduler:
    def __init__(self, config: SchedulerConfig, block_config: BlockManagerConfig) -> None: ...
    def add_sequence_group(self, request_id: str, prompt: list[int], num_seqs: int, stop: StopConditions,
                           arrival_time: float, cache_salt: str = "", speculate: bool = True,
                           lora_id: int = 0) -> list[int]: ...
    def abort(self, request_id: str) -> bool: ...
    def schedule(self) -> SchedulePlan: ...
    def commit(self, seq_ids: npt.ArrayLike, token_ids: npt.ArrayLike) -> CommitResult: ...
    def fill_drafts(self, tokens: npt.ArrayLike) -> None: ...
    def observe_step_time(self, seconds: float) -> None: ...
    def fork_sequence(self, parent: int) -> int: ...
    def finish_sequence(self, seq_id: int, status: SequenceStatus) -> bool: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_swapped(self) -> int: ...
    def has_unfinished(self) -> bool: ...
    def num_kv_tokens(self) -> int: ...
    def find_group(self, request_id: str) -> Optional[SequenceGroupSnapshot]: ...
    def find_sequence(self, seq_id: int) -> Optional[SequenceSnapshot]: ...
    @property
    def config(self) -> SchedulerConfig: ...
    @property
    def block_config(self) -> BlockManagerConfig: ...
    @property
    def stats(self) -> SchedulerStats: ...
    def usage(self) -> BlockUsage: ...
    def take_kv_events(self) -> list[KvCacheEvent]: ...
    def reset_prefix_cache(self) -> bool: ...
    def check_invariants(self) -> None: ...

# The raw CPU kernel entry points (_cpu_*, integer pointers) are private to vpage.ops, and
# _ShmAllReduce (the shared-memory all-reduce) to vpage.distributed.shm_comm.
def quant_matmul_isa() -> str: ...
QUANT_INTEGER_PATH_ROWS: int  # quant_matmul rounds x to 8 bits up to this many rows (Q4_0/Q4_1/Q8_0)
def cpu_isa() -> str: ...
def set_cpu_isa(isa: str) -> None: ...
def set_thread_source(source: str) -> str: ...
