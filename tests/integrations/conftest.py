"""The SGLang test environment on CPU: the real ``sglang==0.5.23`` (installed by ``make``
with ``--no-deps`` under the CPU torch) and one replaced module, ``torchvision``.

SGLang's memory-pool modules import torchvision at module level through its multimodal
configs; PyPI's torchvision wheels are CUDA builds that do not load beside the CPU torch.
``cpu_stubs/torchvision`` stands in for it (any use raises). transformers is asked first
whether torchvision is installed, so it caches "no" and never reaches the stand-in. The
storage interface, the backend factory, the host pools and the key scheme are SGLang's own.
"""

from __future__ import annotations

import sys
from pathlib import Path

import transformers.utils.import_utils as _import_utils

_import_utils.is_torchvision_available()  # cache "absent" before the stand-in is importable
_STUBS = str(Path(__file__).parent / "cpu_stubs")
if _STUBS not in sys.path:
    sys.path.insert(0, _STUBS)
