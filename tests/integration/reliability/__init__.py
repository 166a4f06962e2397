"""Reliability harness for issue 8: load with probes beside it, storms, faults, figures.

Used by tests/integration/test_reliability_*.py (inside the session cluster of conftest.py) and by
benchmarks/{overload,soak,faults}.py (which start their own cluster with `serve_cluster`).
Figures are returned, never asserted here: tests assert correctness (every request ends, nothing
leaks, nothing hangs past a generous bound); benchmarks print and record the timings.
Modules: `cluster` (unit view, actors, processes, a cluster of one's own), `load` (load, probes,
figures), `storm` (disconnect storms), `faults` (kills under load, recovery).

Must not import torch.
"""
