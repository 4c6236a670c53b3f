"""Routing math, engine-free (pure torch): the router-shift weight (RSPO, `shift`), the
routing statistics a step logs (`stats`), the routing record and replay ids a pass keeps
(`record`), and the TensorBoard heat map (`heatmap`, imports matplotlib; not loaded here).

Capture and replay need the model's routers, so they live in the learner
(`moe_rl.learner.routing`); this package holds what they compute with and what they hand on.
"""

from moe_rl.routing.shift import router_shift, router_shift_from_partial, router_shift_partial
from moe_rl.routing.stats import (
    gamma_stats,
    per_layer,
    routing_stats,
    topk_disagreement,
    topk_set_changed,
)

__all__ = [
    "gamma_stats",
    "per_layer",
    "router_shift",
    "router_shift_from_partial",
    "router_shift_partial",
    "routing_stats",
    "topk_disagreement",
    "topk_set_changed",
]
