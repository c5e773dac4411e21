"""Replicas on Ray Serve: one hispec engine per replica behind the same OpenAI-compatible routes.

    hispec serve --ray --replicas 2 [--max-replicas 4] [--threads 1] [...every `hispec serve` option]

Each replica is a Ray actor that loads the model and builds exactly the app ``hispec serve``
runs (``hispec.server.app.create_app``: completions, chat completions, streaming, models,
health, metrics), handed to Ray Serve as the replica's ASGI app. Ray Serve's proxy routes each
request to the less loaded of two sampled replicas (its power-of-two-choices router, on queue
lengths). A replica takes at most ``--max-batch-size`` requests, the batch its engine runs at
once, so a burst spreads over the replicas instead of queueing inside one engine while another
idles (with twice that, a burst of 8 on two replicas of batch 4 all went to one); beyond that,
requests wait at the proxy for the first free replica. Ray Serve scales between ``--replicas``
and ``--max-replicas`` on ongoing requests, and checks each replica's health (``check_health``:
the engine thread is alive) every few seconds. A replica that dies is replaced by Ray; its
in-flight requests end with an error from the proxy (a 500 response, or a stream cut short),
the other replicas' requests are untouched.

Needs the ``ray`` extra: ``pip install 'hispec[ray]'`` (``ray[serve]``).
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading

APP_NAME = "hispec"


class HispecReplica:
    """One replica: a model, an engine thread, the OpenAI-compatible FastAPI app."""

    def __init__(self, args: argparse.Namespace) -> None:
        from ..server.app import create_app
        from ..server.state import start_server_state

        self.hispec_args = args
        self.hispec_state = start_server_state(args, progress=False)  # as hispec serve
        self.hispec_app = create_app(self.hispec_state)

    def __serve_build_asgi_app__(self):
        return self.hispec_app

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising marks the replica unhealthy (it is replaced)."""
        bridge = self.hispec_state.engine
        if bridge.started and not bridge.alive:
            raise RuntimeError(f"the engine thread stopped: {bridge.error or 'unknown error'}")


def deployment_options(args) -> dict:
    """Ray Serve options from the command line: replicas or autoscaling, CPUs/GPUs per replica, health."""
    per_replica = {"num_cpus": args.threads or 1}
    if str(args.device).startswith("cuda"):
        per_replica["num_gpus"] = getattr(args, "tensor_parallel_size", 1)
    opts = {"name": "HispecReplica", "ray_actor_options": per_replica,
            "max_ongoing_requests": args.max_batch_size,
            "health_check_period_s": 5, "health_check_timeout_s": 60,
            "graceful_shutdown_timeout_s": args.shutdown_timeout}
    if args.max_replicas and args.max_replicas > args.replicas:
        opts["autoscaling_config"] = {"min_replicas": args.replicas, "initial_replicas": args.replicas,
                                      "max_replicas": args.max_replicas,
                                      "target_ongoing_requests": max(1, args.max_batch_size // 2)}
    else:
        opts["num_replicas"] = args.replicas
    return opts


def build_app(args):
    """The Ray Serve application (``serve.run(build_app(args))``)."""
    from ray import serve

    replica = serve.ingress()(HispecReplica)
    return serve.deployment(replica, **deployment_options(args)).bind(_picklable(args))


def _picklable(args) -> argparse.Namespace:
    return argparse.Namespace(**{k: v for k, v in vars(args).items() if not callable(v)})


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run(args) -> int:
    """``hispec serve --ray``: a local Ray instance (or ``--ray-address``), the deployment, until SIGTERM/SIGINT."""
    from ..options import UsageError

    try:
        import ray
        from ray import serve
    except ImportError:
        raise UsageError("hispec serve --ray needs Ray Serve: pip install 'hispec[ray]'") from None
    if args.replicas < 1:
        raise UsageError(f"--replicas must be >= 1, got {args.replicas}")
    if args.max_replicas is not None and args.max_replicas < args.replicas:
        raise UsageError(f"--max-replicas ({args.max_replicas}) is below --replicas ({args.replicas})")
    port = args.port or _free_port(args.host)
    cpus = max(os.cpu_count() or 1, (args.max_replicas or args.replicas) * (args.threads or 1))
    init = {"address": args.ray_address} if args.ray_address else {"num_cpus": cpus}
    ray.init(include_dashboard=False, logging_level="warning", **init)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve.start(http_options={"host": args.host, "port": port})
        serve.run(build_app(args), name=APP_NAME, route_prefix="/", blocking=False)
        shown = f"[{args.host}]" if ":" in args.host else args.host
        print(f"hispec: serving on http://{shown}:{port}/v1 (Ray Serve, {args.replicas} replica(s)"
              + (f", autoscaling to {args.max_replicas}" if args.max_replicas else "") + ")",
              file=sys.stderr, flush=True)
        stop.wait()
        print("hispec: stopping the Ray Serve deployment", file=sys.stderr, flush=True)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    print("hispec: server stopped", file=sys.stderr, flush=True)
    return 0
