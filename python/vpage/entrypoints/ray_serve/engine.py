"""The engine deployment of the Ray Serve app: each replica a whole vpage engine (an engine-core
process driven by an :class:`EngineCoreClient`), streaming a request's DELTA outputs to the
ingress that called it. Ray Serve places, scales and health-checks the replicas."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional, Union

from vpage.engine.arg_utils import EngineArgs
from vpage.engine.core_client import EngineCoreClient, EngineDeadError, RequestFailed
from vpage.engine.core_messages import CoreReady, RequestError
from vpage.lora.request import LoRARequest
from vpage.outputs import RequestOutput
from vpage.sampling_params import SamplingParams

HEALTH_STALL_S = 600.0  # an engine that has not reported this long is unhealthy


class VpageEngine:
    """The body of one engine replica (wrapped by ``serve.deployment`` in ``app.py``)."""

    async def __init__(self, args: EngineArgs):
        self.client = EngineCoreClient(args)
        await self.client.start()

    def info(self) -> CoreReady:
        return self.client.info

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       cache_salt: Optional[str] = None,
                       lora_request: Optional[LoRARequest] = None) -> AsyncIterator[Union[RequestOutput, RequestError]]:
        """The request's DELTA outputs; a refused or failed request ends with its RequestError
        (an exception with a status does not survive Ray's pickling). Cancelled by the caller
        (the client went away), the request is aborted."""
        stream = self.client.add_request(request_id, prompt_token_ids, params, cache_salt, lora_request)
        try:
            while (out := await stream.next()) is not None:
                yield out
        except RequestFailed as exc:
            yield RequestError(request_id, exc.status, str(exc))
        except EngineDeadError as exc:
            yield RequestError(request_id, 503, f"the engine is not available: {exc}")
        finally:
            if not stream.finished:
                self.client.abort([request_id])

    def num_unfinished(self) -> int:
        return self.client.num_unfinished()

    def record_routing_stats(self) -> dict:
        """What the router reads of this replica (Ray Serve calls it periodically)."""
        return {"num_unfinished": self.client.num_unfinished()}

    def check_health(self) -> None:
        """Ray Serve's health check: raising marks the replica unhealthy (Serve replaces it)."""
        reason = self.client.health(HEALTH_STALL_S)
        if reason is not None:
            raise RuntimeError(reason)

    async def __del__(self) -> None:
        await asyncio.shield(self.client.shutdown())
