"""Multi-turn chat workloads: traces (``trace``), the LRU oracle (``oracle``), exact
references (``exact``), options (``options``, light: the CLI's ``--help`` reads them),
per-round reports (``report``) and the driver of deployments (``driver``)."""
