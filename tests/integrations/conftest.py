"""The SGLang test environment on CPU: the real ``sglang==0.5.23`` (installed by ``make``
with ``--no-deps`` under the CPU torch) and one replaced module, ``torchvision``
(:mod:`apps.sglang_cpu`). The storage interface, the backend factory, the host pools and
the key scheme are SGLang's own.
"""

from __future__ import annotations

from apps.sglang_cpu import allow_sglang_on_cpu

allow_sglang_on_cpu()
