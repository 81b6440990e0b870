"""Typed messages: one pydantic model per hop of the request path (torch-free).

Every body that crosses a process boundary — router ↔ workers, prefill kvstore ↔ decode
kvstore, the SSE events of a decode stream, the transfer's completion metadata — is one of
these models. Servers validate incoming bodies with them (FastAPI answers a bad body with a
4xx naming the field), clients parse replies with them (``Model.model_validate(json)``), and
nobody parses these dicts by hand. The request lifecycle that uses them is numbered in
:mod:`k3serve.protocol`; docs/ARCHITECTURE.md maps who sends which.

Hop by hop (``→`` request body, ``←`` answer)::

    router → decode    POST /internal/reserve    ReserveRequest      ← ReserveResponse
    router → prefill   POST /internal/prefill    PrefillRequest      ← PrefillResponse (token #1)
    router → decode    POST /internal/stream     StreamRequest       ← SSE of StreamEvent
    router → decode    POST /internal/channel    ChannelRequest      ← SSE of StreamEvent,
                                                                       each tagged with its
                                                                       request id (one per
                                                                       router process)
    router → decode    POST /internal/attach     AttachRequest       ← AttachResponse (the
                                                                       stream goes on a channel)
    router → decode    POST /internal/resume     ResumeRequest       ← ResumeResponse (migration)
    router → both      POST /internal/abort      AbortRequest        ← AbortResponse
    router → both      GET  /internal/info                           ← WorkerInfo
    router → both      GET  /internal/cache_events                   ← CacheEvents
    router → both      GET  /internal/cache_state                    ← CacheState
    router → both      GET  /internal/requests                       ← RequestsDebug
    anyone → both      GET  /health                                  ← WorkerHealth
    worker → router    POST /internal/register   RegisterRequest     ← RegisterResponse
    P kvstore → D      POST /kv/pair             PairRequest         ← PairResponse | PairError
    P kvstore → D      POST /kv/status (and TE)  StatusMessage       ← StatusAck
    anyone → D kvstore GET  /kv/health                               ← KVHealth
    inside StatusMessage(kind="done"):           TransferMetadata
    any internal error                                               ← ErrorBody

One module per link: :mod:`~k3serve.messages.router_decode`,
:mod:`~k3serve.messages.router_prefill`, :mod:`~k3serve.messages.control` (router ↔ both
roles, worker → router), :mod:`~k3serve.messages.kv` (kvstore ↔ kvstore), on
:mod:`~k3serve.messages.base` (the base model, field types, helpers, error body);
``from k3serve.messages import X`` names any of them. The ``sampling`` field of the requests
is :class:`k3serve.sampling.SamplingParams` itself, the one definition of the sampling fields.

Conventions: token ids are ints ≥ 0; logprobs are floats in nats, and a logprob that is not
finite (−inf for a masked token, NaN) travels as ``null`` (:func:`finite` is the one
sanitizer); ``top_logprobs`` are ``[token_id, logprob]`` pairs, most likely first. Unknown
fields are ignored (a newer peer may send more), missing required ones are a 4xx.
"""

from __future__ import annotations

from k3serve.messages.base import *
from k3serve.messages.control import *
from k3serve.messages.kv import *
from k3serve.messages.router_decode import *
from k3serve.messages.router_prefill import *
