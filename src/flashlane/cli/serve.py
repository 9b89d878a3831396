"""`flashlane serve --model M`: the OpenAI-compatible HTTP server (vLLM's flag spelling)."""

from __future__ import annotations

import logging

from .engine_flags import add_engine_flags, engine_kwargs


def add_parser(sub):
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("--model", required=True, help="preset, checkpoint folder or .gguf file")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as 'model' (default: the --model value)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    p.add_argument("--max-queue", type=int, default=None,
                   help="sequences allowed to wait beyond the running capacity; more get 429 (default: no bound)")
    p.add_argument("--max-body-bytes", type=int, default=None, help="largest request body (413 above)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may drain on shutdown before they are aborted")
    add_engine_flags(p)
    return p


def run(args) -> int:
    import uvicorn

    from ..engine.async_engine import AsyncEngine
    from ..server.app import DEFAULT_MAX_BODY_BYTES, create_app

    if args.max_queue is not None and args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    engine = AsyncEngine(args.model, **engine_kwargs(args))
    app = create_app(engine, served_model_name=args.served_model_name or args.model, api_key=args.api_key,
                     max_queue=args.max_queue, max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES)
    print(f"flashlane: serving {engine.engine.model_name} as {args.served_model_name or args.model!r} "
          f"on http://{args.host}:{args.port}\nflashlane: {engine.engine.describe_cache()}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower(),
                timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
    return 0
