"""The benchmarks of ``hicache-ray bench``: each measures a figure beside the ceiling it is
measured against in the same run, and writes both to JSON."""
