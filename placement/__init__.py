"""Pure planning of TP x PP bundles and rank order (``plan``); Ray group creation comes with
the Ray-layer issue."""

from placement.plan import StagePlan, order_ranks, plan_stages, rank_bundle

__all__ = ["StagePlan", "order_ranks", "plan_stages", "rank_bundle"]
