"""Expert load counters: routed tokens per expert per MoE layer.

Every ``k3serve.model.moe.MoE`` keeps ``expert_load [E]`` int64 on the model's device and adds
each forward's top-k choices to it with ``index_add_`` (one tiny kernel, no host sync in the
step; padding tokens are never routed, replicas are not distinguished: a token-choice counts
once per chosen expert). These helpers read them — a host copy, so call them from a metrics
scrape or between steps, never inside the step — reset them, and expose them to Prometheus.

The readout is what ``k3serve experts plan --counts FILE`` takes: ``[L_moe][E]`` lists.
Each rank counts the tokens it routes: every token of the instance when attention runs as one
group, its own attention group's tokens when there are several (``k3serve.parallel.groups``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import nn


def moe_layers(model: nn.Module) -> dict[int, nn.Module]:
    """``{decoder layer index: its MoE}`` of a ``K3ForCausalLM`` (dense layers left out)."""
    from k3serve.model.moe import MoE

    return {
        int(layer.idx): layer.mlp
        for layer in model.model.layers
        if isinstance(layer.mlp, MoE)
    }


def expert_load(model: nn.Module) -> dict[int, np.ndarray]:
    """Routed-token counts since the last reset.

    Returns:
        ``{layer index: [E] int64 array}`` (a host copy; one device sync for all layers).
    """
    layers = moe_layers(model)
    if not layers:
        return {}
    stacked = torch.stack([m.expert_load for m in layers.values()]).cpu().numpy()
    return {i: stacked[j].copy() for j, i in enumerate(layers)}


def expert_load_array(model: nn.Module) -> np.ndarray:
    """``[L_moe, E]`` int64 counts in layer order (``np.zeros((0, 0))`` without MoE layers)."""
    d = expert_load(model)
    return np.stack(list(d.values())) if d else np.zeros((0, 0), dtype=np.int64)


def reset_expert_load(model: nn.Module) -> None:
    """Zero every MoE layer's counters (in place, on device)."""
    for m in moe_layers(model).values():
        m.expert_load.zero_()


class ExpertLoadCollector:
    """A ``prometheus_client`` custom collector:
    ``k3serve:expert_routed_tokens_total{layer, expert}`` (counter).

    Args:
        read: returns ``{layer: [E] counts}`` (e.g. ``lambda: expert_load(model)``); called at
            scrape time only.
        labels: constant labels added to every sample (e.g. ``{"worker": "p0"}``).

    Register with ``registry.register(ExpertLoadCollector(...))``.
    """

    NAME = "k3serve:expert_routed_tokens"

    def __init__(
        self, read: Callable[[], dict[int, np.ndarray]], labels: dict[str, str] | None = None
    ) -> None:
        self.read = read
        self.labels = dict(labels or {})

    def collect(self) -> Iterator[object]:
        from prometheus_client.core import CounterMetricFamily

        names = [*self.labels, "layer", "expert"]
        fam = CounterMetricFamily(
            self.NAME, "Tokens routed to each expert (top-k choices), per MoE layer", labels=names
        )
        consts = list(self.labels.values())
        for layer, counts in self.read().items():
            for e, n in enumerate(counts.tolist()):
                fam.add_metric([*consts, str(layer), str(e)], float(n))
        yield fam


__all__ = [
    "ExpertLoadCollector",
    "expert_load",
    "expert_load_array",
    "moe_layers",
    "reset_expert_load",
]
