"""The prefill policies by name: the table every name-taking caller reads (the router's
``--policy``, ``RouterConfig.policy``, the simulator), and :func:`place` by name.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.placement import (
    DecodeWorkerState,
    Placement,
    PlacementParams,
    PlacementRequest,
    PrefillPolicy,
    PrefillWorkerState,
    cache_aware,
    least_load,
    random_choice,
    round_robin,
)
from router.placement import place as place_with
from router.policies.home import prefix_home
from router.policies.radix import approx_radix

#: Every prefill policy, by the name the configuration and the command lines use.
POLICIES: dict[str, PrefillPolicy] = {
    "cache_aware": cache_aware,
    "round_robin": round_robin,
    "least_load": least_load,
    "random": random_choice,
    "prefix_home": prefix_home,
    "approx_radix": approx_radix,
}

DEFAULT_POLICY = "prefix_home"
"""The default policy of the live router (``RouterConfig.policy``, ``k3serve serve --policy``)
and of ``k3serve simulate``: the one the simulator's comparison of the policies found best."""


def place(req: PlacementRequest, prefill: Sequence[PrefillWorkerState],
          decode: Sequence[DecodeWorkerState] = (), policy: str = "cache_aware",
          params: PlacementParams = PlacementParams()) -> Placement:  # noqa: B008
    """:func:`router.placement.place` with the policy named ``policy``.

    Raises:
        KeyError: unknown policy.
        NoWorkerAvailable: as :func:`router.placement.place`.
    """
    return place_with(req, prefill, decode, POLICIES[policy], params, policy)
