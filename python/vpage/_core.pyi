# Type stubs of vpage._core.

# CPU kernels (bind_cpu_kernels.cpp). Pointers are tensor.data_ptr() ints; dtype codes:
# 0 float32, 1 float16, 2 bfloat16. Use vpage.ops, which checks the tensors first.
def cpu_reshape_and_cache(key: int, value: int, key_cache: int, value_cache: int, slot_mapping: int,
                          num_tokens: int, key_stride: int, value_stride: int, num_blocks: int,
                          num_kv_heads: int, head_size: int, block_size: int, dtype: int,
                          num_threads: int) -> None: ...
def cpu_paged_attention(out: int, query: int, key_cache: int, value_cache: int, block_tables: int,
                        context_lens: int, query_start_loc: int, num_seqs: int, num_query_tokens: int,
                        num_heads: int, max_blocks_per_seq: int, max_context_len: int,
                        query_stride: int, scale: float, num_blocks: int, num_kv_heads: int,
                        head_size: int, block_size: int, dtype: int, num_threads: int) -> None: ...
def cpu_copy_blocks(key_caches: list[int], value_caches: list[int], block_mapping: int,
                    num_pairs: int, num_blocks: int, num_kv_heads: int, head_size: int,
                    block_size: int, dtype: int, num_threads: int) -> None: ...
def cpu_swap_blocks(src: int, dst: int, block_bytes: int, block_mapping: int, num_pairs: int,
                    src_num_blocks: int, dst_num_blocks: int, num_threads: int) -> None: ...
def cpu_isa() -> str: ...
def set_cpu_isa(isa: str) -> None: ...
