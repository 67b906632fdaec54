"""Warming the prefix cache (POST /v1/warm): one prefill-only job through the same pool as a completion.

The job carries the same prefix-affinity key as a completion of the same prompt, so the router
sends a later request that starts the same way to the worker that now holds its K/V (and the
host store has it for the other workers). Nothing reaches the client before the worker is done,
so a job whose worker is lost simply runs again elsewhere (the pool does that).
"""
from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING

from gateway.completion import check_fits, check_token_ids
from gateway.errors import error_from_worker
from gateway.router import prefix_key
from gateway.workers import Job
from shared.protocol import Error, Finished
from shared.sampling import SamplingParams

if TYPE_CHECKING:
    from gateway.state import GatewayState

# A warm job generates nothing; one greedy token keeps it valid wherever prompt + max_tokens is checked.
WARM_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


async def prefill(state: GatewayState, ids: list[int], param: str, cache_namespace: bytes = b"",
                  tenant: str = "") -> Finished:
    """Prefill `ids` on a worker; its Finished says how much of the prompt was reused and is now cached."""
    await state.pool.wait_ready(state.config.gateway.queue_timeout)  # n_ctx is known from here on
    check_token_ids(state, [ids])
    check_fits(state, ids, WARM_PARAMS.max_tokens, param)
    sink: asyncio.Queue = asyncio.Queue()
    job = Job(uuid.uuid4().hex, 0, ids, WARM_PARAMS, sink, prefix_key(ids, cache_namespace), warm=True,
              cache_namespace=cache_namespace, tenant=tenant)
    state.pool.submit([job])
    try:
        while True:
            _, message = await sink.get()
            if isinstance(message, Finished):
                return message
            if isinstance(message, Error):
                raise error_from_worker(message.error, message.message, message.param, message.code)
            # TokenChunk (a worker may still sample its one token) or Restarted: wait for the end.
    finally:
        state.pool.release(job)  # a no-op once finished; aborts the prefill if the client left
