"""Benchmark harness: speaks only HTTP to an OpenAI-compatible server (never imports the engine)."""
