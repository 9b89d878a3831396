"""`flashlane eval`: accuracy of an engine configuration against an fp32 reference run of the same
model (perplexity, top-1 agreement, KL, greedy agreement), beside its speed and memory.

Named ``evaluate`` rather than ``eval`` so no import of it reads like the builtin."""
