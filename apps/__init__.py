"""Applications on top of the library and the Ray layer: the ``hicache-ray`` CLI, the demo,
the benchmarks and their Ray drivers, and the generation of docs/ tables.

Nothing below this package imports it (``make lint`` checks the layers).
"""
