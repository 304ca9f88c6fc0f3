"""SGLang 0.5.23 on a CPU-only torch: one module replaced where it cannot load.

SGLang's memory-pool modules import torchvision at module level through its multimodal
configs; PyPI's torchvision wheels are CUDA builds that do not load beside the CPU torch.
``cpu_stubs/torchvision`` stands in for it (any use raises). transformers is asked first
whether torchvision is installed, so it caches "no" and never reaches the stand-in. Where a
real torchvision is installed, nothing is replaced. The SGLang test environment
(``tests/integrations``) and ``bench micro``'s tree comparison load SGLang this way.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

__all__ = ["STUBS", "allow_sglang_on_cpu"]

STUBS = Path(__file__).parent / "cpu_stubs"


def allow_sglang_on_cpu() -> None:
    """Make ``import sglang.srt.mem_cache...`` work without torchvision (idempotent)."""
    if str(STUBS) in sys.path or importlib.util.find_spec("torchvision") is not None:
        return
    import transformers.utils.import_utils as import_utils

    import_utils.is_torchvision_available()  # cache "absent" before the stand-in is importable
    sys.path.insert(0, str(STUBS))
