"""The CPU layer ops of vpage.ops against the torch expressions they replace (the code the
other devices run), per call, on one machine in one run.

    python bench/bench_layer_ops.py                          # tokens 1,16,256, bfloat16 and float32
    python bench/bench_layer_ops.py --tokens 64 --dtypes bfloat16 --threads 2 --repeat 15
    python bench/bench_layer_ops.py --ops gelu_tanh_and_mul,rotary_partial --json out.json

Ops (shapes of the families that use them; --d sets the MLP width):
silu_and_mul       [tokens, 2 d] -> [tokens, d]                          F.silu(gate) * up
gelu_tanh_and_mul  [tokens, 2 d] -> [tokens, d] (Gemma)                  F.gelu(gate, approximate="tanh") * up
rms_norm           [tokens, 4096]                                        F.rms_norm(x.float()).to(dtype) * w
rms_norm_heads     32 q heads of 128 in a fused QKV row, in place (Qwen3) the same on a [tokens, 32, 128] view
rotary_full        32 + 8 heads of 128, in place                         rotate-half on the heads
rotary_partial     24 + 8 heads of 128, rotary_dim 96 (Phi-4-mini)      rotate-half on [..., :96]

Each op is timed `--repeat` times (a batch of calls each, sized to ~20 ms); the table gives the
median time per call in microseconds and the spread (min-max over the repeats) of vpage's
kernel and of the torch expression, and torch / vpage. Compare ratios: the machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from vpage import _core, ops

EPS = 1e-6


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def table(max_position: int, rotary_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = torch.arange(max_position).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def torch_rotary(x, positions, cos_sin, num_heads, head_size, rotary_dim):
    half = rotary_dim // 2
    heads = x[:, : num_heads * head_size].view(x.shape[0], num_heads, head_size)[..., :rotary_dim]
    t = cos_sin[positions][:, None, :]
    cos, sin = t[..., :half], t[..., half:]
    x1, x2 = heads[..., :half].float(), heads[..., half:].float()
    heads.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def cases(name: str, tokens: int, dtype: torch.dtype, d: int):
    """(vpage call, torch call) on fresh random inputs of the op's shapes."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(shape, generator=gen).to(dtype)

    if name in ("silu_and_mul", "gelu_tanh_and_mul"):
        x, out = rand(tokens, 2 * d), torch.empty(tokens, d, dtype=dtype)
        if name == "silu_and_mul":
            return (lambda: ops.silu_and_mul(out, x)), (lambda: torch.mul(F.silu(x[:, :d]), x[:, d:], out=out))
        return (lambda: ops.gelu_tanh_and_mul(out, x)), (
            lambda: torch.mul(F.gelu(x[:, :d], approximate="tanh"), x[:, d:], out=out))
    if name == "rms_norm":
        x, w, out = rand(tokens, 4096), rand(4096), torch.empty(tokens, 4096, dtype=dtype)
        return (lambda: ops.rms_norm(out, x, w, EPS)), (
            lambda: out.copy_(F.rms_norm(x.float(), (4096,), eps=EPS).to(dtype) * w))
    if name == "rms_norm_heads":
        heads, head_size = 32, 128
        qkv, w = rand(tokens, (heads + 16) * head_size), rand(head_size)

        def torch_heads():
            h = qkv[:, : heads * head_size].view(tokens, heads, head_size)
            h.copy_(F.rms_norm(h.float(), (head_size,), eps=EPS).to(dtype) * w)
        return (lambda: ops.rms_norm_heads_(qkv, w, EPS, heads, head_size)), torch_heads
    if name in ("rotary_full", "rotary_partial"):
        heads, head_size, rotary_dim = (40, 128, 128) if name == "rotary_full" else (32, 128, 96)
        qkv = rand(tokens, (heads + 8) * head_size)
        positions = torch.randint(0, 4096, (tokens,), generator=gen)
        cos_sin = table(4096, rotary_dim)
        return (lambda: ops.rotary_embedding(qkv, positions, cos_sin, heads, head_size, rotary_dim=rotary_dim)), (
            lambda: torch_rotary(qkv, positions, cos_sin, heads, head_size, rotary_dim))
    raise ValueError(f"unknown op {name}")


def time_per_call(fn, repeat: int) -> list[float]:
    """Seconds per call, one number per repeat (each a batch of calls of ~20 ms)."""
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < 0.02:
        fn()
        calls += 1
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default="silu_and_mul,gelu_tanh_and_mul,rms_norm,rms_norm_heads,rotary_full,"
                        "rotary_partial")
    parser.add_argument("--tokens", default="1,16,256", help="comma-separated token counts")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--d", type=int, default=8192, help="MLP width of the gated activations")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops.set_num_threads(args.threads)
    print(f"# {cpu_name()}, {os.cpu_count()} logical CPUs, vpage ISA {_core.cpu_isa()}, {args.threads} threads, "
          f"torch {torch.__version__}, median of {args.repeat} (spread min-max), us per call")
    print("| op | dtype | tokens | vpage us | torch us | torch / vpage |")
    print("|---|---|---:|---:|---:|---:|")
    rows = []
    for name in args.ops.split(","):
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            for tokens in map(int, args.tokens.split(",")):
                ours, theirs = cases(name, tokens, dtype, args.d)
                a, b = time_per_call(ours, args.repeat), time_per_call(theirs, args.repeat)
                ma, mb = statistics.median(a) * 1e6, statistics.median(b) * 1e6
                print(f"| {name} | {dtype_name} | {tokens} | {ma:.1f} ({min(a) * 1e6:.1f}-{max(a) * 1e6:.1f}) | "
                      f"{mb:.1f} ({min(b) * 1e6:.1f}-{max(b) * 1e6:.1f}) | {mb / ma:.2f} |", flush=True)
                rows.append(dict(op=name, dtype=dtype_name, tokens=tokens, vpage_us=ma, torch_us=mb,
                                 vpage_samples_us=[s * 1e6 for s in a], torch_samples_us=[s * 1e6 for s in b]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cpu=cpu_name(), isa=_core.cpu_isa(), threads=args.threads, torch=torch.__version__,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
