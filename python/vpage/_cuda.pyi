"""Type stubs of vpage._cuda. Pointers and streams are ints (tensor.data_ptr(),
torch.cuda.current_stream().cuda_stream); dtype codes: 0 float32, 1 float16, 2 bfloat16."""

partition_size: int

def is_available() -> bool: ...
def device_count() -> int: ...
def synchronize(stream: int) -> None: ...
def paged_attention_workspace_bytes(num_seqs: int, num_query_tokens: int, num_heads: int,
                                    max_context_len: int, prefill: bool, num_blocks: int,
                                    num_kv_heads: int, head_size: int, block_size: int,
                                    dtype: int, version: int = 0, sliding_window: int = 0) -> int: ...
def paged_attention(out: int, query: int, key_cache: int, value_cache: int, block_tables: int,
                    context_lens: int, query_start_loc: int, num_seqs: int,
                    num_query_tokens: int, num_heads: int, query_stride: int,
                    max_blocks_per_seq: int, max_context_len: int, scale: float,
                    num_blocks: int, num_kv_heads: int, head_size: int, block_size: int,
                    dtype: int, workspace: int, workspace_bytes: int, version: int,
                    stream: int, sliding_window: int = 0, logits_soft_cap: float = 0.0) -> None: ...
def reshape_and_cache(key: int, value: int, key_cache: int, value_cache: int,
                      slot_mapping: int, num_tokens: int, key_stride: int, value_stride: int,
                      num_blocks: int, num_kv_heads: int, head_size: int, block_size: int,
                      dtype: int, stream: int) -> None: ...
def copy_blocks(key_caches: int, value_caches: int, num_layers: int, block_mapping: int,
                num_pairs: int, num_blocks: int, num_kv_heads: int, head_size: int,
                block_size: int, dtype: int, stream: int) -> None: ...
def swap_blocks(src: int, dst: int, block_bytes: int, block_mapping: int, num_pairs: int,
                stream: int) -> None: ...
def apply_token_bitmask(logits: int, num_rows: int, vocab: int, row_stride: int, bitmask: int,
                        bitmask_stride: int, stream: int) -> None: ...
