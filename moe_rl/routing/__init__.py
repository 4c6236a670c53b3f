"""Routing: router-shift weights (RSPO) and routing statistics (pure torch).

Capture and replay (megatron-core's RouterReplay) live in their own modules here; this
file imports only the pure-tensor math so that `import moe_rl.routing` stays cheap.
The TensorBoard heat map is `moe_rl.routing.heatmap` (imports matplotlib; not loaded here).
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
