"""Multi-turn chat workloads: traces, the LRU oracle, per-round reports (no Ray needed)."""

from apps.multiturn.oracle import OracleRequest, lru_hit_tokens
from apps.multiturn.trace import Lengths, Trace, TraceConfig

__all__ = ["Lengths", "OracleRequest", "Trace", "TraceConfig", "lru_hit_tokens"]
