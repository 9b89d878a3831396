"""`flashlane tune`: Bayesian optimisation (Optuna) of serving knobs against an SLO. One trial =
start a server (flashlane, or any command template) with the trial's knobs, benchmark it over
HTTP with the bench, stop it. Like bench, it never imports the engine, models or server."""
