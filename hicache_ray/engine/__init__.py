"""The engine: models (``model/``), the request and its checks, sampling, the request table
and batch plans, one rank's runtime and step thread, a deployment's spec and a rank composed
from it. May import ``base``, ``keys``, ``storage`` and ``cache``.
"""
