"""vpage on Ray Serve: an OpenAI-compatible app whose engine replicas Ray Serve places, scales
and health-checks, with prefix-aware routing between them.

    from vpage.entrypoints.ray_serve import build_app
    serve.run(build_app(EngineArgs(model=...), num_replicas=4))         # or autoscaling_config={...}

or ``vpage serve --ray-serve [-dp N | --ray-serve-autoscaling JSON]``. Two deployments:
``VpageEngine`` (each replica a whole engine with its own KV cache; requests routed by
:class:`~vpage.entrypoints.ray_serve.router.VpagePrefixRouter`) and ``VpageIngress`` (vpage's
FastAPI app, one replica by default, forwarding requests through the engine deployment's handle).
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from typing import Any, Optional

from vpage.engine.arg_utils import EngineArgs
from vpage.entrypoints.ray_serve.engine import VpageEngine
from vpage.entrypoints.ray_serve.ingress import VpageIngress

ROUTER = "vpage.entrypoints.ray_serve.router.VpagePrefixRouter"


def build_app(args: EngineArgs, options: Optional[Any] = None, num_replicas: int = 1,
              autoscaling_config: Optional[dict] = None) -> Any:
    """The bound Serve application: ``num_replicas`` engine replicas, or as many as Ray Serve's
    ``autoscaling_config`` (``min_replicas``, ``max_replicas``, ``target_ongoing_requests``,
    ...) asks for; each replica reserves ``args.num_threads`` (default 1) CPUs."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from vpage.entrypoints.openai.launcher import ServerOptions

    if args.enable_lora:
        raise ValueError("LoRA adapters are not served under Ray Serve yet: run `vpage serve --enable-lora`")
    options = options or ServerOptions(model_name=args.model or "smollm2")
    engine_args = dataclasses.replace(args, data_parallel_size=1, data_parallel_rank=None)
    scaling: dict[str, Any] = ({"autoscaling_config": autoscaling_config} if autoscaling_config
                               else {"num_replicas": num_replicas})
    engine = serve.deployment(VpageEngine, name="VpageEngine", **scaling,
                              ray_actor_options={"num_cpus": args.num_threads or 1},
                              max_ongoing_requests=4 * args.max_num_seqs, health_check_period_s=10.0,
                              request_router_config=RequestRouterConfig(
                                  request_router_class=ROUTER,
                                  request_router_kwargs={"block_size": args.block_size}))
    ingress = serve.deployment(serve.ingress()(VpageIngress), name="VpageIngress", num_replicas=1,
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000)
    return ingress.bind(engine.bind(engine_args), engine_args, options)


def run(args: EngineArgs, options: Any, autoscaling_config: Optional[dict] = None) -> int:
    """``vpage serve --ray-serve``: deploys the app on the Ray cluster this process joins (a
    local one otherwise), its HTTP proxy on ``options.host:options.port``, until SIGINT or
    SIGTERM; then removes it (and a local Ray instance) and returns 0."""
    import ray
    from ray import serve

    ray.init(ignore_reinit_error=True)
    try:
        serve.start(http_options={"host": options.host, "port": options.port})
        serve.run(build_app(args, options, args.data_parallel_size, autoscaling_config), name="vpage",
                  route_prefix="/")
        replicas = "autoscaled" if autoscaling_config else f"{args.data_parallel_size} engine replicas"
        print(f"vpage: serving {options.model_name} on http://{options.host}:{options.port}/v1 "
              f"(Ray Serve, {replicas})", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0
