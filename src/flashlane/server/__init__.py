"""OpenAI-compatible HTTP server (FastAPI): `create_app(engine, ...)` in app.py."""
