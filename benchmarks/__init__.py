"""gpupool's benchmarks: measured figures, printed as tables and JSON; never timed asserts.

- :mod:`benchmarks.replay`: replays the Alibaba GPU trace (FGD, ATC'23) through the real ledger
  with each placement policy and reports how much of the pool it fills; :mod:`benchmarks.trace`
  finds the trace, or makes a synthetic one of the same shape where it is not at hand.
- :mod:`benchmarks.allocator`: allocation and release latency of the ledger as the pool grows.

Both only drive :mod:`gpupool.core`; neither performs I/O beyond reading the trace files (and
writing the synthetic trace to a temporary folder).
"""
