"""`attnstore serve [--settings PATH] [--host H] [--port P]` and `attnstore bench ...`."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import gc
import importlib
import importlib.util
import logging
import os
import signal
import sys

from aiohttp import web

from .http.limits import check_bind
from .settings import Settings, SettingsError, load_settings


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # aiohttp's own access log would print one more line per request; ours is the [AttentionStore] line.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is installed (it roughly halves the event loop's share of a proxied request)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def freeze_startup_objects() -> None:
    """What start-up made (the models, tokenizers, kernels, the engine) lives as long as the process: it
    leaves the cyclic collector's view (gc.freeze), so a full collection walks only what serving made
    since. A full collection holds the GIL from start to end, and over start-up's objects it stopped the
    step's Python and the event loop, every stream at once, for the better part of a second
    (docs/benchmarks.md, "Streams soak"). Runs once local serving has started (the engine built)."""
    gc.collect()
    gc.freeze()


# How long (in spins, ~100,000 a millisecond) a GNU OpenMP thread that waits busy-waits before it sleeps.
OPENMP_SPIN_COUNT = "20000"


def wait_briefly_in_openmp() -> None:
    """Unless the operator chose (OMP_WAIT_POLICY, GOMP_SPINCOUNT), the step's OpenMP threads spin for
    ~0.2 ms before they sleep, not GNU OpenMP's default ~3 ms. Every parallel region of a step ends in a
    barrier: where another process keeps a core busy, a thread spinning there burns the time slice the
    thread it waits for needs, and the scheduler counts both as CPU hogs: a step then waits on the
    scheduler at every region, not on its work (docs/benchmarks.md, "Streams soak"). Spinning this
    long still bridges the gaps between a step's regions on an idle machine, where sleeping at once
    slows the step (docs/engine.md, "Batched steps"). Must run before torch is imported: GNU OpenMP
    reads it once."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)


def serving_app(settings: Settings) -> web.Application:
    """The app `serve` runs. torch loads only when the local runner is enabled, and then only once the
    server listens (`LocalStart`): an upstream-only proxy (or a bad settings file) starts in a blink."""
    from .http.app import build_full_app

    return build_full_app(settings)


def serve(args: argparse.Namespace) -> int:
    """0 once stopped by a signal; 1 when local serving could not start (the log's `cannot start` line
    says why); 2 for bad settings or a refused bind."""
    try:
        settings, _ = load_settings(args.settings)
    except SettingsError as exc:
        print(f"attnstore: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.proxy.log_level)
    host = args.host or settings.proxy.host
    port = settings.proxy.port if args.port is None else args.port
    refusal = check_bind(host, settings.proxy.api_keys, settings.proxy.allow_unauthenticated_public_bind)
    if refusal is not None:
        print(f"attnstore: {refusal}", file=sys.stderr)
        return 2
    wait_briefly_in_openmp()
    try:
        app = serving_app(settings)
    except SettingsError as exc:  # found at start: the L2 folder cannot be made
        print(f"attnstore: {exc}", file=sys.stderr)
        return 2
    from .turns.local_start import LOCAL_START

    start = app[LOCAL_START]
    start.on_ready = freeze_startup_objects
    # A start that failed stops the server as a signal would (run_app's handler), then exits 1.
    start.on_failure = lambda: signal.raise_signal(signal.SIGTERM)
    starting = " (local serving starts now: /healthz says starting until it is ready)"

    def listening(_: str) -> None:  # run_app's announcement, once the socket is bound
        logging.getLogger("attnstore").info(
            "serving on http://%s:%d%s", host, port, starting if settings.local_runner.enabled else ""
        )

    # handler_cancellation: a client that disconnects cancels its handler, which closes the upstream call.
    try:
        web.run_app(
            app,
            host=host,
            port=port,
            loop=new_event_loop(),
            handler_cancellation=True,
            access_log=None,
            print=listening,
            shutdown_timeout=10,
        )
    except OSError as exc:  # the bind: the port is taken, or the address is not this host's
        print(f"attnstore: cannot listen: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if start.state == "starting":
        exit_while_starting()
    return 1 if start.failure is not None else 0


def exit_while_starting() -> None:
    """Stopped before local serving was up: its build (a model converting in transformers, the kernels
    compiling, vLLM starting) cannot be interrupted, and the interpreter's shutdown would wait for it,
    then break it half-way (transformers' pool refuses new work once shutdown begins) and abort. Exit
    now instead: what the build writes lands whole or not at all (a conversion renames its folder into
    place; the kernels' build lock is released by the OS). The exit handlers run first: they stop any
    vLLM server already started."""
    logging.getLogger("attnstore").info("stopped while local serving was starting")
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# The benchmark is an optional extra: its code and the third-party packages only it uses.
BENCH_MODULES = ("bench", "tqdm", "matplotlib")
BENCH_INSTALL = "pip install -e .[bench]"


def bench(argv: list[str]) -> int:
    missing = [name for name in BENCH_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"attnstore: the benchmark is not installed (missing {', '.join(missing)}); "
            f"install it with: {BENCH_INSTALL}",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module("bench.multiturn")
    return int(module.main(argv) or 0)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnstore", description="AttentionStore caching proxy")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve the OpenAI-compatible proxy")
    s.add_argument(
        "--settings", default=None, help="settings file (default: $ATTNSTORE_SETTINGS or ./settings.json)"
    )
    s.add_argument("--host", default=None, help="listen address (default: proxy.host)")
    s.add_argument("--port", type=int, default=None, help="listen port (default: proxy.port)")
    sub.add_parser("bench", help="the multi-turn benchmark; arguments go to bench.multiturn", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        return bench(argv[1:])
    args = parser().parse_args(argv)
    return serve(args)
