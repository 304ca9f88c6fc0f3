"""Base parts every room uses: errors, type and range checks, frozen settings (``config``,
``storage_config``), KV layout facts, statistics and metric rows, worker threads, backend
names. Imports nothing else of the library.
"""
