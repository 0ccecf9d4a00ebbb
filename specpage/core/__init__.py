"""The core: requests, the scheduler, the shared pool and what crosses to
the models. Pure Python; nothing here imports torch.

A step crosses the boundary twice: the core turns its schedule into a
plain-value `StepBatch` (core/step.py), an executor turns that into a
plain-value `StepResult`, and `EngineCore.apply` (core/engine_core.py)
applies it, through the ledger (core/ledger.py), the only writer of a
sequence's counters and of the pool's commits and rollbacks.
"""
