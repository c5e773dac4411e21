"""``hispec serve`` (the OpenAI-compatible server) and ``hispec loadtest`` (N concurrent clients).

Only the standard library and hispec are imported here: fastapi, uvicorn and httpx (the
``server`` extra) are imported when a command runs, so ``hispec --help`` works without them.
"""
from __future__ import annotations

import argparse
import sys

SERVE_EPILOG = """\
endpoints: POST /v1/completions, POST /v1/chat/completions (stream: true = server-sent events),
GET /v1/models, GET /health, GET /metrics (Prometheus text).

example:
  hispec serve --model default --port 8000 --api-key secret
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Authorization: Bearer secret' \\
    -H 'Content-Type: application/json' \\
    -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'
"""


def register(subparsers) -> None:
    from ..config import DEFAULT_SUFFIX_SCOPES
    from ..options import (add_model_options, add_parallel_options, add_prefill_option, add_spec_options,
                           add_strategy_option, add_suffix_option)

    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                              description="An OpenAI-compatible HTTP server: every client's requests join one "
                                          "continuous batch, decoded with the chosen --strategy.",
                              epilog=SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("server")
    add_strategy_option(g)
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 = any free port)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 requests (default: no key)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients send (default: the model's name; the --model value is also accepted)")
    g.add_argument("--max-batch-size", type=int, default=16, help="sequences decoded together (default: 16)")
    g.add_argument("--kv-blocks", type=int, default=None, metavar="N",
                   help="KV-cache blocks of 16 tokens (default: enough for a full batch of 1024-token sequences)")
    add_prefill_option(g)
    add_suffix_option(g)
    g.add_argument("--suffix-cache-scopes", type=int, default=DEFAULT_SUFFIX_SCOPES, metavar="N",
                   help="clients whose outputs the suffix cache keeps, least recently used out: a scope is the "
                        "API key (hashed) and the request's 'user'; without --api-key, the 'user' alone, and "
                        f"requests without one share a scope (default: {DEFAULT_SUFFIX_SCOPES})")
    g.add_argument("--prefix-cache-per-key", action="store_true",
                   help="share cached prompt blocks only among requests of one API key (multi-tenant servers; "
                        "requests can also set vLLM's 'cache_salt')")
    g.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="waiting requests allowed before answering 429 (default: 256)")
    g.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                   help="on SIGTERM, seconds in-flight requests get to finish before they are cancelled (default: 10)")
    g.add_argument("--no-adaptive", action="store_true", help="always speculate (no per-step cost model)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--no-access-log", action="store_true", help="do not log each HTTP request")
    r = p.add_argument_group("replicas (Ray Serve; needs pip install 'hispec[ray]')")
    r.add_argument("--ray", action="store_true",
                   help="serve through Ray Serve: one engine per replica behind the same routes")
    r.add_argument("--replicas", type=int, default=1, metavar="N", help="replicas to start (default: 1)")
    r.add_argument("--max-replicas", type=int, default=None, metavar="M",
                   help="autoscale between --replicas and M on ongoing requests (default: fixed)")
    r.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join a running Ray cluster (default: start a local one)")
    add_model_options(p)
    add_parallel_options(p)
    add_spec_options(p)
    p.set_defaults(func=cmd_serve)

    from .loadtest import register_loadtest
    register_loadtest(subparsers)


def _check_args(args) -> None:
    from ..options import UsageError, check_engine_args

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535, got {args.port}")
    check_engine_args(args)  # --max-batch-size, --prefill-chunk, --kv-blocks, --threads, ...
    if args.max_queue < 1:
        raise UsageError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.shutdown_timeout < 0:
        raise UsageError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key is empty")


def _listen(host: str, port: int):
    import socket

    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = info[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        from ..options import UsageError
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def cmd_serve(args) -> int:
    import signal

    from ..options import UsageError

    _check_args(args)
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise UsageError(f"hispec serve needs the server extra ({e.name} is missing): "
                         "pip install 'hispec[server]'") from None
    if args.ray:
        from ..distributed import ray_serve
        return ray_serve.run(args)
    if args.replicas != 1 or args.max_replicas or args.ray_address:
        raise UsageError("--replicas, --max-replicas and --ray-address need --ray")
    from .app import create_app
    from .state import start_server_state

    state = start_server_state(args)  # the engine thread computes; this one serves HTTP
    app = create_app(state)
    sock = _listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    e = state.engine.engine
    print(f"hispec: serving {state.served_name} ({args.strategy}, batch {args.max_batch_size}, "
          f"{e.blocks.num_blocks} KV blocks of {e.block_size}) on http://{shown}:{port}/v1", file=sys.stderr,
          flush=True)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=not args.no_access_log,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5, lifespan="on")
    server = _make_server(uvicorn, config, state.engine, args.shutdown_timeout)
    # uvicorn re-raises the signal that stopped it once it is done; with these handlers in place
    # that is a no-op, so a graceful stop ends with status 0
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sock.close()
    if not server.started:
        print("hispec: error: the server did not start", file=sys.stderr)
        return 1
    print("hispec: server stopped", file=sys.stderr, flush=True)
    return 0


def _make_server(uvicorn, config, bridge, grace: float):
    import threading

    class Server(uvicorn.Server):
        """uvicorn's server, which on the first SIGTERM/SIGINT also stops taking requests and,
        after ``grace`` seconds, cancels those still in flight (each stream ends properly)."""

        def handle_exit(self, sig, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:
                bridge.stop_accepting()
                timer = threading.Timer(grace, bridge.abort_all)
                timer.daemon = True
                timer.start()

    return Server(config)
