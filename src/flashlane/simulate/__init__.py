"""Serving in simulated time: the engine's real scheduler and cache manager driven by a step-cost
model (``analyze.step_cost`` fitted to this machine, or ``analyze.gpu_step_cost`` for named GPUs)
instead of the model, behind an in-memory server that the bench's own replay talks to on a
virtual-time event loop. Imports ``engine`` (scheduler, cache), ``analyze`` and ``bench``; nothing
imports it but ``cli``."""
