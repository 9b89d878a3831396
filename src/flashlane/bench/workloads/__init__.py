"""Workloads: every workload is a source of session trees in the AgentX trace model."""
