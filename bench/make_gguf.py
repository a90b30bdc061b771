"""Random-weight GGUF files of published model shapes, for benchmarks that need real-size
models without downloading any.

    python bench/make_gguf.py SHAPE --type Q4_1|Q8_0|Q4_K|F32 --out DIR [--layers N] [--seed S]

writes ``DIR/SHAPE[-LN]-TYPE.gguf`` and prints its path and size; a file already there with
the same settings (shape table entry, type, layers, seed) is kept. SHAPE is one of ``SHAPES``:
smollm2-360m, smollm2-1.7b, llama-0.6b (arch llama), qwen3-0.6b (arch qwen3), gemma3-1b
(arch gemma3), llama-gemma3-1b (arch llama), qwen3moe-1b-a0.2b (arch qwen3moe: 32 experts, 4
active) and qwen3-a0.2b (arch qwen3: its dense peer with the same active parameters).
``--layers`` shrinks the layer count (tests, quick checks).

What the file holds:
- the tokenizer of vpage's default model (SmolLM2-135M-Instruct): its ``tokenizer.*``
  metadata copied verbatim (chat template included), so vpage and llama.cpp tokenize alike.
  The vocabulary is therefore 49152 whatever the published model's, and token_embd is
  ``[49152, hidden]``. Every shape ties its embeddings, as the published ones do (no output.weight);
- the metadata keys llama.cpp's converter (convert_hf_to_gguf.py) writes for the arch;
- random weights: 2-D weights normal with std 0.02 in ``--type`` (token_embd too), norms
  F32 near 1 (as llama.cpp stores them: Gemma's ``1 + w``); a MoE's merged expert tensors
  (``ffn_gate_exps`` [experts, intermediate, hidden] and so on) in ``--type``, its router
  (``ffn_gate_inp``) F32, as llama-quantize leaves it. Arch llama's Q/K rows are
  permuted per head as the converter permutes them. Q4_K needs rows of a multiple of 256
  values; a tensor whose rows are not (hidden 960 or 1152) is written Q4_1 instead, and the
  script says how many were (llama.cpp falls back to Q5_0 there, which vpage does not read).

Tensors are generated, quantized and written one row chunk at a time, so memory stays small
whatever the model's size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

_SETTINGS_KEY = "make_gguf.settings"  # JSON of what the file was written from
_FORMAT = 1  # bump when the script writes different bytes for the same settings
_CHUNK_VALUES = 1 << 22  # values generated and quantized at a time
_WEIGHT_STD = 0.02
_NORM_STD = 0.02
TYPES = ("Q4_1", "Q8_0", "Q4_K", "F32")


@dataclass(frozen=True)
class Shape:
    """A model's dimensions (its config.json values) and its GGUF architecture."""

    arch: str  # general.architecture
    hidden: int  # hidden_size
    layers: int  # num_hidden_layers
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    head_dim: int
    intermediate: int  # intermediate_size
    context: int  # max_position_embeddings
    rope_theta: float  # the global layers' base for gemma3
    rms_eps: float  # rms_norm_eps
    sliding_window: Optional[int] = None  # gemma3's local layers
    experts: int = 0  # a mixture of experts (qwen3moe): expert_count
    experts_used: int = 0  # num_experts_per_tok
    expert_intermediate: int = 0  # moe_intermediate_size


SHAPES = {
    # HuggingFaceTB/SmolLM2-360M config.json: hidden_size 960, num_hidden_layers 32,
    # num_attention_heads 15, num_key_value_heads 5, intermediate_size 2560,
    # max_position_embeddings 8192, rope_theta 100000, rms_norm_eps 1e-5, tied, vocab 49152.
    "smollm2-360m": Shape("llama", hidden=960, layers=32, heads=15, kv_heads=5, head_dim=64,
                          intermediate=2560, context=8192, rope_theta=100000.0, rms_eps=1e-5),
    # HuggingFaceTB/SmolLM2-1.7B config.json: hidden_size 2048, num_hidden_layers 24,
    # num_attention_heads 32, num_key_value_heads 32, intermediate_size 8192,
    # max_position_embeddings 8192, rope_theta 130000, rms_norm_eps 1e-5, tied, vocab 49152.
    "smollm2-1.7b": Shape("llama", hidden=2048, layers=24, heads=32, kv_heads=32, head_dim=64,
                          intermediate=8192, context=8192, rope_theta=130000.0, rms_eps=1e-5),
    # No published model: Qwen/Qwen3-0.6B's dimensions (below) as a plain Llama, without the
    # q/k norms; ~0.49B parameters with this vocabulary (Qwen3-0.6B: 0.6B with 151936).
    "llama-0.6b": Shape("llama", hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128,
                        intermediate=3072, context=40960, rope_theta=1000000.0, rms_eps=1e-6),
    # Qwen/Qwen3-0.6B config.json: hidden_size 1024, num_hidden_layers 28,
    # num_attention_heads 16, num_key_value_heads 8, head_dim 128, intermediate_size 3072,
    # max_position_embeddings 40960, rope_theta 1000000, rms_norm_eps 1e-6,
    # tie_word_embeddings true, vocab 151936; q_norm/k_norm per head.
    "qwen3-0.6b": Shape("qwen3", hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128,
                        intermediate=3072, context=40960, rope_theta=1000000.0, rms_eps=1e-6),
    # google/gemma-3-1b-pt config.json: hidden_size 1152, num_hidden_layers 26,
    # num_attention_heads 4, num_key_value_heads 1, head_dim 256, intermediate_size 6912,
    # max_position_embeddings 32768, rope_theta 1000000, rope_local_base_freq 10000,
    # sliding_window 512, sliding_window_pattern 6, query_pre_attn_scalar 256,
    # rms_norm_eps 1e-6, tied, vocab 262144. llama.cpp's converter writes neither the local
    # base, the pattern nor the scalar: llama.cpp's gemma3 loader fixes them (10000, every
    # 6th layer global, 1/sqrt(head_dim) for all sizes but 27B).
    "gemma3-1b": Shape("gemma3", hidden=1152, layers=26, heads=4, kv_heads=1, head_dim=256,
                       intermediate=6912, context=32768, rope_theta=1000000.0, rms_eps=1e-6,
                       sliding_window=512),
    # No published model: gemma-3-1b's dimensions (above) as a plain Llama (no window, no
    # post-norms, SiLU MLP): the peer a Gemma 3 1B is compared with at equal parameter count.
    "llama-gemma3-1b": Shape("llama", hidden=1152, layers=26, heads=4, kv_heads=1, head_dim=256,
                             intermediate=6912, context=32768, rope_theta=1000000.0, rms_eps=1e-6),
    # No published model: Qwen/Qwen3-30B-A3B scaled down (its config.json: hidden_size 2048,
    # num_hidden_layers 48, num_attention_heads 32, num_key_value_heads 4, head_dim 128,
    # num_experts 128, num_experts_per_tok 8, moe_intermediate_size 768, intermediate_size
    # 6144, rope_theta 1000000, rms_norm_eps 1e-6, norm_topk_prob true): hidden 1024, 12
    # layers, 32 experts of which 4 active; ~1.03B parameters, ~0.24B active per token.
    "qwen3moe-1b-a0.2b": Shape("qwen3moe", hidden=1024, layers=12, heads=16, kv_heads=8, head_dim=128,
                               intermediate=3072, context=40960, rope_theta=1000000.0, rms_eps=1e-6,
                               experts=32, experts_used=4, expert_intermediate=768),
    # No published model: the dense Qwen3 with qwen3moe-1b-a0.2b's active parameters (its
    # attention, an MLP of 4 x 768).
    "qwen3-a0.2b": Shape("qwen3", hidden=1024, layers=12, heads=16, kv_heads=8, head_dim=128,
                         intermediate=3072, context=40960, rope_theta=1000000.0, rms_eps=1e-6),
}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as the file stores it: numpy shape (rows, columns) or (n,)."""

    name: str
    shape: tuple[int, ...]
    permute_heads: Optional[int] = None  # heads of a Q/K projection llama.cpp permutes

    @property
    def is_norm(self) -> bool:
        return len(self.shape) == 1

    @property
    def is_router(self) -> bool:
        """A MoE router (ffn_gate_inp): F32 in llama.cpp's quantized files."""
        return self.name.endswith("ffn_gate_inp.weight")


def tensor_specs(shape: Shape, layers: int, vocab: int) -> list[TensorSpec]:
    """The file's tensors in llama.cpp's names, in writing order."""
    h, ff = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    llama = shape.arch == "llama"
    specs = [TensorSpec("token_embd.weight", (vocab, h))]
    for i in range(layers):
        b = f"blk.{i}."
        specs += [
            TensorSpec(b + "attn_norm.weight", (h,)),
            TensorSpec(b + "attn_q.weight", (q, h), shape.heads if llama else None),
            TensorSpec(b + "attn_k.weight", (kv, h), shape.kv_heads if llama else None),
            TensorSpec(b + "attn_v.weight", (kv, h)),
        ]
        if not llama:  # qwen3, gemma3: RMSNorm of each head's q and k
            specs += [TensorSpec(b + "attn_q_norm.weight", (shape.head_dim,)),
                      TensorSpec(b + "attn_k_norm.weight", (shape.head_dim,))]
        specs.append(TensorSpec(b + "attn_output.weight", (h, q)))
        if shape.arch == "gemma3":
            specs.append(TensorSpec(b + "post_attention_norm.weight", (h,)))
        specs.append(TensorSpec(b + "ffn_norm.weight", (h,)))  # gemma3's pre_feedforward_layernorm
        if shape.experts:
            e, eff = shape.experts, shape.expert_intermediate
            specs += [
                TensorSpec(b + "ffn_gate_inp.weight", (e, h)),
                TensorSpec(b + "ffn_gate_exps.weight", (e, eff, h)),
                TensorSpec(b + "ffn_up_exps.weight", (e, eff, h)),
                TensorSpec(b + "ffn_down_exps.weight", (e, h, eff)),
            ]
        else:
            specs += [
                TensorSpec(b + "ffn_gate.weight", (ff, h)),
                TensorSpec(b + "ffn_up.weight", (ff, h)),
                TensorSpec(b + "ffn_down.weight", (h, ff)),
            ]
        if shape.arch == "gemma3":
            specs.append(TensorSpec(b + "post_ffw_norm.weight", (h,)))
    specs.append(TensorSpec("output_norm.weight", (h,)))
    return specs


def stored_type(spec: TensorSpec, qtype: str) -> str:
    """The type a tensor is written in: norms and routers F32; Q4_K rows that are not whole
    256-blocks Q4_1."""
    if spec.is_norm or spec.is_router:
        return "F32"
    if qtype == "Q4_K" and spec.shape[-1] % 256:
        return "Q4_1"
    return qtype


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order of a Q/K projection: each head's rows (2, pairs) become (pairs, 2)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """ggml's Q4_K block rows (uint8 ``[rows, cols / 256 * 144]``) of float32 ``w`` ``[rows, cols]``.

    Per 256-value block: f16 d and dmin, twelve bytes packing eight 6-bit sub-block scales and
    mins, 128 bytes of 4-bit values; value = d * scale * q - dmin * min. Each 32-value
    sub-block's scale and min come from its range (ggml refines them by a search; a random
    weight needs no better).
    """
    rows, cols = w.shape
    x = w.reshape(-1, 8, 32)
    low = np.minimum(x.min(axis=-1), 0.0)  # [blocks, 8]; the min is stored negated, >= 0
    scale, mins = (x.max(axis=-1) - low) / 15.0, -low
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = (mins.max(axis=-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.clip(np.rint(scale / d32), 0, 63), 0).astype(np.uint8)
        mn = np.where(dmin32 > 0, np.clip(np.rint(mins / dmin32), 0, 63), 0).astype(np.uint8)
        step = (d32 * sc)[..., None]
        q = np.where(step > 0, np.rint((x + (dmin32 * mn)[..., None]) / step), 0)
    q = np.clip(q, 0, 15).astype(np.uint8)
    scales = np.empty((x.shape[0], 12), np.uint8)
    # bytes 0-3: scale j low 6 bits | scale j+4 bits 4-5; 4-7: the same for the mins;
    # 8-11: scale j+4 low 4 bits | min j+4 low 4 bits << 4.
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    qs = q[:, 0::2] | (q[:, 1::2] << 4)  # [blocks, 4, 32]: sub-blocks 2c (low), 2c+1 (high)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                             scales, qs.reshape(-1, 128)], axis=1)
    return blocks.reshape(rows, cols // 256 * 144)


def encode_rows(w: np.ndarray, qtype: str) -> np.ndarray:
    """float32 rows as the bytes of ``qtype`` (F32: unchanged)."""
    import gguf

    if qtype == "F32":
        return w
    if qtype == "Q4_K":
        return quantize_q4_k(w)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])


def _chunks(spec: TensorSpec, qtype: str, seed: int) -> Iterator[np.ndarray]:
    """The tensor's stored bytes, a few million values at a time."""
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    if spec.is_norm:
        yield (1.0 + _NORM_STD * rng.standard_normal(spec.shape, dtype=np.float32)).astype(np.float32)
        return
    rows, cols = int(np.prod(spec.shape[:-1])), spec.shape[-1]  # expert stacks: their rows in order
    if spec.permute_heads is not None:  # small: generated whole in Hugging Face's order
        w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(_WEIGHT_STD)
        yield encode_rows(permute_qk(w, spec.permute_heads), qtype)
        return
    step = max(1, _CHUNK_VALUES // cols)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        w = rng.standard_normal((n, cols), dtype=np.float32)
        w *= np.float32(_WEIGHT_STD)
        yield encode_rows(w, qtype)


def _nbytes(spec: TensorSpec, qtype: str) -> int:
    import gguf

    if qtype == "F32":
        return 4 * int(np.prod(spec.shape))
    values, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    return int(np.prod(spec.shape[:-1])) * spec.shape[-1] // values * size


def _copy_tokenizer(writer, source: Path) -> int:
    """Copy every ``tokenizer.*`` key of the GGUF file ``source``; returns the vocabulary size."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def _write_metadata(writer, shape: Shape, layers: int, vocab: int) -> None:
    """The keys llama.cpp's converter writes for the arch (TextModel, then LlamaModel,
    Gemma3Model or Qwen3MoeModel; Qwen3Model adds none)."""
    writer.add_block_count(layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    # The converter writes these when config.json lists head_dim: Qwen3's and Gemma 3's do,
    # SmolLM2's do not, and llama-0.6b's would have to (head_dim != hidden / heads).
    if shape.arch != "llama" or shape.head_dim != shape.hidden // shape.heads:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.arch == "llama":
        writer.add_vocab_size(vocab)
        writer.add_rope_dimension_count(shape.head_dim)
    if shape.sliding_window is not None:
        writer.add_sliding_window(shape.sliding_window)
    if shape.experts:  # Qwen3MoeModel: the counts and an expert's intermediate size
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_intermediate)


_FILE_TYPES = {"F32": "ALL_F32", "Q4_1": "MOSTLY_Q4_1", "Q8_0": "MOSTLY_Q8_0", "Q4_K": "MOSTLY_Q4_K_S"}


def _settings(shape_name: str, qtype: str, layers: int, seed: int) -> str:
    return json.dumps({"shape": shape_name, **dataclasses.asdict(SHAPES[shape_name]), "type": qtype,
                       "layers": layers, "seed": seed, "format": _FORMAT}, sort_keys=True)


def _existing_settings(path: Path) -> Optional[str]:
    """The settings string of a file this script wrote, read from the head of the file (it is
    the third key, before the tokenizer's long arrays); None for any other file."""
    import struct

    with open(path, "rb") as f:
        head = f.read(1 << 16)
    try:
        magic, _, _, kv_count = struct.unpack_from("<4sIQQ", head, 0)
        if magic != b"GGUF":
            return None
        pos = 24  # then each key: u64 length, bytes, u32 value type, value
        for _ in range(min(kv_count, 3)):
            (n,) = struct.unpack_from("<Q", head, pos)
            key = head[pos + 8:pos + 8 + n].decode()
            vtype, length = struct.unpack_from("<IQ", head, pos + 8 + n)
            pos += 8 + n + 12
            if vtype != 8:  # the keys up to the settings are all strings
                return None
            if key == _SETTINGS_KEY:
                return head[pos:pos + length].decode()
            pos += length
    except (struct.error, UnicodeDecodeError):
        return None
    return None


def make_gguf(shape_name: str, qtype: str, out: Path, layers: Optional[int] = None, seed: int = 0,
              tokenizer_source: Optional[Path] = None) -> tuple[Path, bool]:
    """Write (or keep) the file; returns (path, whether it was written now).

    ``tokenizer_source``: the GGUF file whose tokenizer is copied (vpage's default model).
    """
    import gguf

    if shape_name not in SHAPES:
        raise ValueError(f"unknown shape {shape_name!r}; known: {sorted(SHAPES)}")
    if qtype not in TYPES:
        raise ValueError(f"unknown type {qtype!r}; known: {TYPES}")
    shape = SHAPES[shape_name]
    layers = shape.layers if layers is None else layers
    if tokenizer_source is None:
        from vpage.model_executor.loader.default_model import default_model_path

        tokenizer_source = default_model_path()
    suffix = "" if layers == shape.layers else f"-L{layers}"
    path = Path(out) / f"{shape_name}{suffix}-{qtype}.gguf"
    settings = _settings(shape_name, qtype, layers, seed)
    if path.is_file() and _existing_settings(path) == settings:
        return path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")  # renamed once complete

    writer = gguf.GGUFWriter(str(partial), arch=shape.arch)
    writer.add_name(f"random {shape_name}")
    writer.add_string(_SETTINGS_KEY, settings)
    vocab = _copy_tokenizer(writer, tokenizer_source)
    _write_metadata(writer, shape, layers, vocab)
    writer.add_file_type(int(gguf.LlamaFileType[_FILE_TYPES[qtype]]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    specs = tensor_specs(shape, layers, vocab)
    for spec in specs:
        t = stored_type(spec, qtype)
        writer.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32), _nbytes(spec, t),
                               raw_dtype=gguf.GGMLQuantizationType[t])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    for spec in specs:  # each tensor's data starts aligned, as GGUFWriter.write_tensor_data does
        t = stored_type(spec, qtype)
        writer.write_padding(fout, fout.tell())
        for chunk in _chunks(spec, t, seed):
            chunk.tofile(fout)
        writer.write_padding(fout, _nbytes(spec, t))
    writer.close()
    os.replace(partial, path)
    return path, True


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--type", default="Q4_1", choices=TYPES,
                        help="type of the 2-D weights (default Q4_1)")
    parser.add_argument("--out", required=True, type=Path, help="folder of the file")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the published model")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be at least 1")
    start = time.perf_counter()
    path, written = make_gguf(args.shape, args.type, args.out, args.layers, args.seed)
    note = f"written in {time.perf_counter() - start:.1f} s" if written else "exists, same settings"
    shape = SHAPES[args.shape]
    fallback = sum(stored_type(s, args.type) != args.type
                   for s in tensor_specs(shape, args.layers or shape.layers, 1) if not (s.is_norm or s.is_router))
    if fallback:
        note += f"; {fallback} tensors Q4_1 (rows not a multiple of 256)"
    size = path.stat().st_size
    print(f"{path}  {size} bytes ({size / 2**20:.1f} MiB, {note})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
