"""`flashlane serve --model M`: the OpenAI-compatible HTTP server (vLLM's flag spelling)."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket

from ..engine.restart_policy import DEFAULT_MAX_RESTARTS, DEFAULT_RESTART_BACKOFF_S, MAX_BACKOFF_S, RESTART_WINDOW_S
from ..server.body_limits import DEFAULT_MAX_SEQS_PER_REQUEST
from .engine_flags import _writable_dir, add_engine_flags, apply_thread_default, engine_kwargs
from .help import HelpFormatter

API_KEY_ENV = "FLASHLANE_API_KEY"  # vLLM reads VLLM_API_KEY the same way


def add_parser(sub):
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="preset, checkpoint folder or .gguf file")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as 'model' (default: the --model value)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on (0: any free port)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on everything but /health; also read from "
                        f"${API_KEY_ENV} (never printed). An empty key is refused (default: no key)")
    p.add_argument("--max-queue", type=int, default=None,
                   help="sequences allowed to wait beyond the running capacity; more get 429 (default: no bound)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest request body, 413 above (default: 32 MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may drain on shutdown; then each is aborted and answered "
                        "503 (a stream: an error event and [DONE])")
    p.add_argument("--max-tokens-default", type=int, default=None, metavar="N",
                   help="tokens to generate when a request sets no max_tokens (chat: nor max_completion_tokens), "
                        "never more than fits the context (default: completions 16, chat the rest of the context)")
    p.add_argument("--max-seqs-per-request", type=int, default=DEFAULT_MAX_SEQS_PER_REQUEST,
                   help="engine sequences (prompts x n) one request may ask for; more get 400 before anything "
                        "is tokenised")
    # connection hygiene (None: ConnectionLimits' defaults, which the help texts state)
    p.add_argument("--timeout-keep-alive", type=float, default=None, metavar="SECONDS",
                   help="close a connection that stays idle this long, fresh or between requests (default: 5)")
    p.add_argument("--header-timeout", type=float, default=None, metavar="SECONDS",
                   help="a request's head (request line and headers) must arrive complete within this, however "
                        "slowly its bytes trickle in; else 408 and the connection is closed (default: 10)")
    p.add_argument("--body-timeout", type=float, default=None, metavar="SECONDS",
                   help="a request's body must arrive complete within this after its head; else 408 and the "
                        "connection is closed (default: 60)")
    p.add_argument("--limit-concurrency", type=int, default=None, metavar="N",
                   help="open connections (or requests in flight) allowed; a request beyond them gets 503 with "
                        "'Connection: close' (default: 1024, fewer if the open-file limit is lower)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the scheduler and the model in their own process (owning the torch threads; "
                        "HTTP, tokenising and streaming stay here, so neither waits on the other's GIL or "
                        "OpenMP pool; without --num-threads it takes the CPUs not busy at start-up but one); if "
                        "that process dies, the requests in it get 503, the death and its cause are logged and "
                        "another process is started (see --engine-restarts). "
                        "--no-engine-process steps the engine on a thread of the server process (default: on)")
    p.add_argument("--engine-restarts", type=int, default=DEFAULT_MAX_RESTARTS, metavar="N",
                   help=f"times a dead engine process is started again within {RESTART_WINDOW_S / 60:g} minutes; "
                        "one more death and it stays dead (/health answers 503 'error'). While it restarts, "
                        "/health answers 503 'restarting' and requests get 503 with Retry-After. 0: never restart")
    p.add_argument("--engine-restart-backoff", type=float, default=DEFAULT_RESTART_BACKOFF_S, metavar="SECONDS",
                   help="wait before the first restart; it doubles with each restart within that window, "
                        f"up to {MAX_BACKOFF_S:g} s")
    p.add_argument("--profile-dir", type=_writable_dir, default=None, metavar="DIR",
                   help="enable POST /start_profile and /stop_profile: a torch.profiler window over live "
                        "traffic, written to DIR as a Chrome/Perfetto trace (default: off, the endpoints answer 404)")
    add_engine_flags(p)
    return p


def run(args) -> int:
    apply_thread_default(args)   # before torch loads
    from ..engine.launch import engine_in_process, engine_in_thread
    from ..server.app import DEFAULT_MAX_BODY_BYTES, create_app
    from ..server.connections import uvicorn_config
    from ..server.shutdown import ShutdownDeadlineServer

    if args.max_queue is not None and args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_tokens_default is not None and args.max_tokens_default < 1:
        raise ValueError(f"--max-tokens-default must be >= 1, got {args.max_tokens_default}")
    api_key = resolve_api_key(args.api_key)
    limits = connection_limits(args)  # bad values fail before the model loads
    # the port is taken before the (slow) model load, so a busy one fails at once, and is
    # listening before the start-up line says so
    sock = bind_socket(args.host, args.port)
    try:
        engine = (engine_in_process(args.model, max_restarts=args.engine_restarts,
                                    restart_backoff=args.engine_restart_backoff, **engine_kwargs(args))
                  if args.engine_process else engine_in_thread(args.model, **engine_kwargs(args)))
        app = create_app(engine, served_model_name=args.served_model_name or args.model, api_key=api_key,
                         max_queue=args.max_queue, max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
                         max_seqs_per_request=args.max_seqs_per_request, profile_dir=args.profile_dir,
                         max_tokens_default=args.max_tokens_default)
        listen(sock, args.host, args.port)
        port = sock.getsockname()[1]
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"flashlane: serving {engine.info.model} as {args.served_model_name or args.model!r} "
              f"on http://{host}:{port}{' (API key required)' if api_key else ''}"
              f"{' (engine in its own process)' if args.engine_process else ''}\n"
              f"flashlane: {engine.info.describe_weights()}\n"
              f"flashlane: {engine.info.describe_cache()}\n"
              f"flashlane: {engine.info.describe_compile()}", flush=True)
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        config = uvicorn_config(app, args.host, port, limits, log_level=level,
                                timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
        server = ShutdownDeadlineServer(config, app.state.ctx)
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down on (as uvicorn.run does)
            pass
    finally:
        sock.close()
    return 0 if server.started else 3  # 3: uvicorn's start-up failure status


def connection_limits(args):
    """ConnectionLimits from the flags; the open-file limit is raised first (as vLLM does), and
    the default connection limit stays below it."""
    from ..server.connections import ConnectionLimits, default_limit_concurrency, raise_open_file_limit

    raise_open_file_limit()
    given = {"timeout_keep_alive": args.timeout_keep_alive, "header_timeout": args.header_timeout,
             "body_timeout": args.body_timeout, "limit_concurrency": args.limit_concurrency}
    kw = {k: v for k, v in given.items() if v is not None}
    kw.setdefault("limit_concurrency", default_limit_concurrency())
    try:
        return ConnectionLimits(**kw)
    except ValueError as e:
        raise ValueError(f"--{str(e).replace('_', '-')}") from None


def resolve_api_key(flag: str | None, environ=None) -> str | None:
    """``--api-key``, else ``$FLASHLANE_API_KEY``, else None (no authentication). An empty key
    is refused rather than read as "no key"; the key itself never appears in a message."""
    environ = os.environ if environ is None else environ
    if flag is not None:
        source, key = "--api-key", flag
    elif API_KEY_ENV in environ:
        source, key = API_KEY_ENV, environ[API_KEY_ENV]
    else:
        return None
    if not key.strip():
        raise ValueError(f"{source} is empty: an empty API key would turn authentication off; give a "
                         f"non-empty key, or leave {source} out to serve without authentication")
    if key != key.strip():
        raise ValueError(f"{source} starts or ends with whitespace, which 'Authorization: Bearer' cannot carry")
    return key


def _port_error(e: OSError, host: str, port: int) -> ValueError:
    if e.errno == errno.EADDRINUSE:
        return ValueError(f"port {port} is in use on {host} (is another server running? choose another --port)")
    return ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}")


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (SO_REUSEADDR, as uvicorn binds), not yet listening."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise _port_error(e, host, port) from None
    return sock


def listen(sock: socket.socket, host: str, port: int) -> None:
    """Start listening (uvicorn listens again with its own backlog); another process that bound
    the same port meanwhile makes this fail."""
    try:
        sock.listen(2048)
    except OSError as e:
        raise _port_error(e, host, port) from None
