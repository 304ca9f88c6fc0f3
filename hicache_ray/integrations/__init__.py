"""Engines that use hicache-ray's L3, one folder per engine (``sglang/``, ``vllm/``); each
loads its engine only in the module that needs it. May import ``base``, ``keys``,
``storage``, ``cache`` and the engine's public parts (``spec``, ``model``), never its runtime.
"""
