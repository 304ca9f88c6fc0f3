"""One rank's cache: the radix tree (``tree/``), the L1 and L2 pools and transfers
(``memory/``), the L3 controller and its threads (``controller/``), HiCache and a request's
hold on it, the tree's events. May import ``base``, ``keys`` and ``storage``; never the
engine, serving or integrations.
"""
