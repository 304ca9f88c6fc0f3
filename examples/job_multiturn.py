"""The multi-turn benchmark as a Ray job, on the cluster the job is submitted to.

    ray start --head --dashboard-host 127.0.0.1          # a cluster (here: one node)
    ray job submit --address http://127.0.0.1:8265 -- \\
        python examples/job_multiturn.py --quick --modes l1_l2,l1_l2_l3

Arguments are those of ``hicache-ray bench multiturn`` (see the README); the report is
printed (and written with ``--json PATH``, a path on the node that runs the job).
"""

from __future__ import annotations

import sys

import ray

from apps.cli import main

if __name__ == "__main__":
    ray.init()  # inside a job: the cluster the job runs on
    sys.exit(main(["bench", "multiturn", *sys.argv[1:]]))
