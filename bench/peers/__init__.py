"""Blink beside other serving systems (vLLM first) on the same requests, in steady state, under CPU co-tenants.

- ``systems``: Blink's modes and peers started from a command line (``Peer``, ``PEER_KINDS``), observed the
  same way: health, the waiting and running gauges of ``/metrics``, version and settings from the log;
- ``load``: one offered rate as a Poisson stream sent by several pinned client processes: warm-up, window, tail;
- ``constraint``: a constrained load's ``response_format`` (``--response-format``) and the check of its answers;
- ``measure``: a rate's record (counts, latency percentiles, sustained throughput, the queue) and the
  plateau's test;
- ``study``: systems, co-tenant levels and rates in turn, the plateau's bisection, the time budget;
- ``report``: merging results files, plateaus, the BENCHMARKS table, the plots;
- ``cli``: ``python -m bench.peers``.
"""
