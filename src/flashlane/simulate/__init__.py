"""Serving in simulated time: the engine's real scheduler and cache manager driven by a fitted
step-cost model (``analyze.step_cost``) instead of the model. Imports ``engine`` (scheduler, cache)
and ``analyze``; nothing imports it but ``cli``."""
