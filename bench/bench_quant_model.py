"""One decode step of the default model (SmolLM2-135M, Q4_1 GGUF) with its weights kept
quantized vs dequantized to float32, in the same run: forward over `batch` sequences of
`context` cached tokens plus compute_logits, timed round-robin (bench_attention.interleaved).
Prints the CPU model and instruction set, ms per step, decode tokens/s, weight bytes.

    python bench/bench_quant_model.py [--batch 1,16,64,256] [--context 128] [--repeats 5]
"""

from __future__ import annotations

import argparse

import torch

from bench_attention import interleaved, ints, machine_description
from bench_quant_matmul import parse_timing_args
from vpage import _core, ops
from vpage.model_executor import ForwardBatch, load_model


def decode_batch(batch, context, block_size):
    blocks = -(-(context + 1) // block_size)
    tables = torch.arange(batch * blocks, dtype=torch.int32).reshape(batch, blocks)
    slots = tables[:, context // block_size].long() * block_size + context % block_size
    return ForwardBatch(
        input_ids=torch.randint(0, 49152, (batch,), generator=torch.Generator().manual_seed(0)),
        positions=torch.full((batch,), context, dtype=torch.int64), slot_mapping=slots,
        block_tables=tables, context_lens=torch.full((batch,), context + 1, dtype=torch.int32),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32), max_context_len=context + 1, max_query_len=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=ints, default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parse_timing_args(parser)
    models = {q: load_model(None, dtype="float32", device="cpu", quantization=q) for q in ("auto", "none")}
    print(f"CPU: {machine_description()}; vpage ISA: {_core.quant_matmul_isa()}; threads: {ops.get_num_threads()}; "
          f"{args.clock_name}")
    for q, m in models.items():
        size = sum(p.numel() * p.element_size() for p in m.model.parameters())
        print(f"weights ({'quantized' if q == 'auto' else 'float32'}): {size / 2**20:.0f} MiB")
    print("| batch | quantized ms/step | float32 ms/step | quantized tok/s | float32 tok/s | speed-up |")
    print("|---:|---:|---:|---:|---:|---:|")
    block_size = 16
    for batch in args.batch:
        step = decode_batch(batch, args.context, block_size)
        fns = []
        for q in ("auto", "none"):
            loaded = models[q]
            cfg = loaded.config
            shape = (batch * step.block_tables.shape[1], cfg.num_kv_heads, cfg.head_size, block_size, cfg.dtype)
            caches = [(torch.randn(ops.key_cache_shape(*shape)), torch.randn(ops.value_cache_shape(*shape)))
                      for _ in range(cfg.num_layers)]
            fns.append(lambda net=loaded.model, caches=caches: net.compute_logits(net(step, caches)))
        (tq, _, _), (tf, _, _) = interleaved(fns, args.repeats, args.clock)
        print(f"| {batch} | {tq * 1e3:.1f} | {tf * 1e3:.1f} | {batch / tq:.0f} | {batch / tf:.0f} | {tf / tq:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
