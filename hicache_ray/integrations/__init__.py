"""Engines that use hicache-ray's L3 (each module imports its engine; none is loaded here)."""
