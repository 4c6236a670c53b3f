"""Routing capture and replay inside the megatron learner: one home for what needs the
model's routers (the pure routing math and statistics are `moe_rl.routing`'s).

- `taps`: a tap on every `TopKRouter`: capture the top-k ids and their log-probabilities,
  replay recorded ids (R2, R3), measure the router shift against an old record;
  `RoutingPlan` says what a pass does, `RouterTaps.run(plan)` does it;
- `state`: what the taps keep per micro-batch and per pass (host reads once per pass);
- `tokens`: routing data between a batch's rows and the routers' token slots (packed or
  padded, sequence-parallel shards);
- `checks`: replay is exact or the pass fails (`ReplayError`);
- `compare`: sampler-learner top-k disagreement per layer.
"""

from moe_rl.learner.routing.checks import ReplayError
from moe_rl.learner.routing.compare import sampler_disagreement
from moe_rl.learner.routing.taps import RouterTaps, RoutingPlan

__all__ = ["ReplayError", "RouterTaps", "RoutingPlan", "sampler_disagreement"]
