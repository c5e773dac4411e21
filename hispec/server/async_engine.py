"""The bridge between asyncio request handlers and the engine, which is not thread-safe.

One background thread owns the ``Engine``: it takes new requests and aborts from a
thread-safe command queue, runs ``step()`` while anything is unfinished, and hands each
request's committed text to that request's ``asyncio.Queue`` with
``loop.call_soon_threadsafe``, once per event loop per step for all its requests (each call wakes
the loop). With no work it blocks on the command queue (no busy wait).
Handlers never touch the engine: they call ``submit`` and ``abort``, which only enqueue.
The only reads from other threads are the queue limit and the metrics gauges, which take
``len()`` of the engine's queues and free-block list (atomic in CPython) at the moment asked.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from ..config import SamplingParams
from ..engine.engine import Engine
from ..kernels.threads import set_threads
from ..sampling.logprobs import TokenLogprob
from .metrics import Metrics

log = logging.getLogger("hispec.server")


def openai_finish_reason(reason: str | None) -> str | None:
    """The engine's reasons (eos, stop, length, context) in OpenAI's words (stop, length);
    'abort' (cancelled) and 'error' pass through."""
    return {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}.get(reason, reason)


class QueueFullError(RuntimeError):
    """More requests are waiting than the server's queue allows."""

    retry_after = 1  # seconds, for the 429's Retry-After header


class EngineStoppedError(RuntimeError):
    """The server is shutting down and takes no new requests."""


def _post(loop: asyncio.AbstractEventLoop, items: list) -> None:
    """``(queue, delta)`` items put into their asyncio queues by ``loop``'s thread, in order."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass


def _put_all(items: list) -> None:
    for q, delta in items:
        q.put_nowait(delta)


@dataclass
class Delta:
    """Newly committed text of one request; the last one has ``finished`` set."""

    text: str
    num_tokens: int  # tokens committed in this step
    finished: bool = False
    finish_reason: str | None = None  # OpenAI's: stop, length; or abort (cancelled), error
    stats: dict | None = None  # DecodeStats.to_dict() plus timings, on the last delta
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per committed token, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first delta, when asked
    cached_tokens: int = 0  # on the last delta: prompt tokens found in the prefix cache

    def merge(self, more: "Delta") -> "Delta":
        """This delta followed by ``more``, as one."""
        logprobs = None if self.logprobs is None and more.logprobs is None else \
            (self.logprobs or []) + (more.logprobs or [])
        return Delta(self.text + more.text, self.num_tokens + more.num_tokens, more.finished, more.finish_reason,
                     more.stats, more.error, logprobs, self.prompt_logprobs or more.prompt_logprobs,
                     more.cached_tokens)


class RequestStream:
    """The event-loop side of one request: ``await get()`` the next delta."""

    def __init__(self, request_id: str, prompt_tokens: int, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.loop = loop
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.completion_tokens = 0
        self.cached_tokens = 0  # of prompt_tokens, found in the prefix cache (known at the end)
        self.finished = False
        self.finish_reason: str | None = None
        self.stats: dict | None = None
        self.error: str | None = None
        self.arrival = time.perf_counter()

    async def get(self) -> Delta:
        """The next delta, merged with any others already waiting (one chunk for several steps)."""
        delta = await self.queue.get()
        while not delta.finished and not self.queue.empty():
            delta = delta.merge(self.queue.get_nowait())
        self.completion_tokens += delta.num_tokens
        if delta.finished:
            self.finished = True
            self.finish_reason = delta.finish_reason
            self.stats = delta.stats
            self.error = delta.error
            self.cached_tokens = delta.cached_tokens
        return delta


@dataclass
class _Live:
    """Engine-thread bookkeeping for one request."""

    stream: RequestStream
    num_tokens: int = 0
    first_token: float | None = None  # seconds after arrival
    stats: object = None  # the live DecodeStats of the sequence
    sent_prompt_logprobs: bool = False
    scheduled: float | None = None  # perf_counter when the engine first ran it


class AsyncEngine:
    def __init__(self, engine: Engine, *, max_queue: int = 256, metrics: Metrics | None = None,
                 idle_timeout: float = 0.5, threads: int | None = None) -> None:
        self.engine = engine
        self.threads = threads  # the engine thread's parallel regions (None: libgomp's default)
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self.idle_timeout = idle_timeout
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pending = 0  # submitted, not yet taken by the engine thread
        self._accepting = True
        self._thread: threading.Thread | None = None
        self._computing = threading.Event()  # set once the engine thread has taken its threads
        self._steps = 0
        self._outbox: list | None = None  # during a step: its deltas, handed over together (_flush)
        self.error: BaseException | None = None

    # ---- the event-loop side ---------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self.metrics.refresh = self._publish
            self._thread = threading.Thread(target=self._run, name="hispec-engine", daemon=True)
            self._thread.start()
            self._computing.wait(10)

    def submit(self, prompt_ids: list[int], params: SamplingParams, draft_scope: str | None = None,
               cache_scope: str = "") -> RequestStream:
        """Queue a request (call from the event loop); raises ``QueueFullError`` or ``EngineStoppedError``.
        ``draft_scope``, ``cache_scope``: as ``Engine.add_request``'s."""
        with self._lock:
            if not self._accepting or self._thread is None or not self._thread.is_alive():
                raise EngineStoppedError("the server is shutting down")
            waiting = self._num_waiting()
            if waiting >= self.max_queue:
                raise QueueFullError(f"{waiting} requests are waiting for a batch slot; the server's queue holds "
                                     f"{self.max_queue} (--max-queue)")
            self._pending += 1
        stream = RequestStream(f"cmpl-{next(self._ids)}", len(prompt_ids), asyncio.get_running_loop())
        self.metrics.add_prompt(len(prompt_ids))
        self._commands.put(("add", stream, list(prompt_ids), params, draft_scope, cache_scope))
        return stream

    def abort(self, request_id: str) -> None:
        """Cancel a request (a no-op once it has finished); its KV blocks are freed."""
        self._commands.put(("abort", request_id))

    def stop_accepting(self) -> None:
        # no lock: this runs in a signal handler, possibly while the same thread holds the lock
        self._accepting = False

    def abort_all(self) -> None:
        self._commands.put(("abort_all",))

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything in flight and end the thread."""
        self.stop_accepting()
        self._commands.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        set_threads(self.threads)  # the thread that computes (kernels/threads.py)
        torch.get_num_threads()  # PyTorch's per-thread setup done now: a later default no longer reaches it
        self._computing.set()
        try:
            while True:
                added, stop = self._take_commands(block=not self.engine.has_unfinished())
                if stop:
                    break
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as e:  # a bug: fail every request rather than hang them
            log.exception("the engine thread died")
            self.error = e
            self._fail_all(f"internal error: {e}")
        finally:
            with self._lock:
                self._accepting = False
            self._abort_all("abort")

    def _take_commands(self, block: bool) -> tuple[int, bool]:
        added = 0
        try:
            cmd = self._commands.get(timeout=self.idle_timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return 0, False
        while True:
            kind = cmd[0]
            if kind == "add":
                added += 1
                self._add(*cmd[1:])
            elif kind == "abort":
                self._abort(cmd[1], "abort")
            elif kind == "abort_all":
                self._abort_all("abort")
            elif kind == "stop":
                return 0, True
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return added, False

    def _add(self, stream: RequestStream, prompt_ids: list[int], params: SamplingParams,
             draft_scope: str | None, cache_scope: str) -> None:
        try:
            self.engine.add_request(prompt_ids, params, stream.request_id, draft_scope, cache_scope)
        except Exception as e:  # validated before, so unexpected: answer it as an error
            self._send(stream, Delta("", 0, True, "error", error=str(e)))
            self.metrics.finish("error", None, 0, time.perf_counter() - stream.arrival, None)
            return
        finally:
            with self._lock:
                self._pending -= 1  # after the engine counts it: a gauge may count it twice, never zero times
        self._live[stream.request_id] = _Live(stream)

    def _abort(self, request_id: str, reason: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        self.engine.abort(request_id)
        self._end(live, reason, error=None)

    def _abort_all(self, reason: str) -> None:
        for request_id in list(self._live):
            try:
                self._abort(request_id, reason)
            except Exception:
                log.exception("aborting %s failed", request_id)

    def _fail_all(self, message: str) -> None:
        for request_id, live in list(self._live.items()):
            self._live.pop(request_id, None)
            try:
                self.engine.abort(request_id)
            except Exception:
                pass
            self._end(live, "error", error=message)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            # the engine's state is unknown after a failed step: end every request in it
            log.exception("engine step failed")
            self._fail_all(f"internal error in the engine: {e}")
            return
        self._steps += 1
        self._outbox = []
        try:
            self._deliver(outputs)
        finally:
            self._flush()

    def _deliver(self, outputs: list) -> None:
        """A step's outputs to their requests' streams (and the metrics)."""
        now = time.perf_counter()
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            live.stats = out.stats
            if live.scheduled is None:
                live.scheduled = out.scheduled_at
            n = len(out.new_token_ids)
            if n:
                live.num_tokens += n
                self.metrics.add_generated(n)
                if live.first_token is None:
                    live.first_token = now - live.stream.arrival
                    self.metrics.observe_ttft(live.first_token)
            prompt_logprobs = None
            if out.prompt_logprobs is not None and not live.sent_prompt_logprobs:
                prompt_logprobs, live.sent_prompt_logprobs = out.prompt_logprobs, True
            if out.finished:
                self._live.pop(out.request_id, None)
                error = None if out.error is None else f"{type(out.error).__name__}: {out.error}"
                self._end(live, openai_finish_reason(out.finish_reason), error, out.text_delta, n,
                          out.new_logprobs, prompt_logprobs, out.num_cached_tokens)
            elif out.text_delta or n or prompt_logprobs:
                self._send(live.stream, Delta(out.text_delta, n, logprobs=out.new_logprobs,
                                              prompt_logprobs=prompt_logprobs))

    def _end(self, live: _Live, reason: str, error: str | None, text: str = "", num_tokens: int = 0,
             logprobs: list | None = None, prompt_logprobs: list | None = None, cached_tokens: int = 0) -> None:
        seconds = time.perf_counter() - live.stream.arrival
        stats = live.stats.to_dict() if live.stats is not None else None
        if stats is not None:
            stats["new_tokens"] = live.num_tokens
            stats["time_to_first_token"] = None if live.first_token is None else round(live.first_token, 6)
            stats["seconds"] = round(seconds, 6)
        queue = None if live.scheduled is None else max(0.0, live.scheduled - live.stream.arrival)
        self.metrics.finish(reason, stats, live.num_tokens, seconds, live.first_token,
                            prompt_tokens=live.stream.prompt_tokens, queue=queue)
        self._send(live.stream, Delta(text, num_tokens, True, reason, stats, error, logprobs, prompt_logprobs,
                                      cached_tokens))

    def _send(self, stream: RequestStream, delta: Delta) -> None:
        """Hand ``delta`` to the request's stream: at the step's end with the step's others
        (``_flush``), or now outside a step."""
        if self._outbox is not None:
            self._outbox.append((stream, delta))
        else:
            _post(stream.loop, [(stream.queue, delta)])

    def _flush(self) -> None:
        """The step's deltas, one ``call_soon_threadsafe`` per event loop (a server has one): the
        mixed load at concurrency 16 woke the loop ~15 times a step, once per request."""
        by_loop: dict = {}
        for stream, delta in self._outbox or ():
            by_loop.setdefault(stream.loop, []).append((stream.queue, delta))
        self._outbox = None
        for loop, items in by_loop.items():
            _post(loop, items)

    # ---- reads from any thread ------------------------------------------------------------------
    def _num_waiting(self) -> int:
        """Requests that wait for a batch slot now (call under ``_lock``): those the engine holds
        back, or those that will find every slot taken once the engine thread picks them up."""
        e = self.engine
        running, waiting = e.num_running, e.num_waiting
        return max(waiting, running + waiting + self._pending - e.max_batch_size)

    def _publish(self) -> None:
        """The engine's gauges as they are now, for ``/metrics`` (called when it is scraped)."""
        e = self.engine
        with self._lock:
            waiting = e.num_waiting + self._pending
        self.metrics.set_engine({"kv_blocks_total": e.blocks.num_blocks, "kv_blocks_in_use": e.blocks.num_used_blocks,
                                 "kv_blocks_free": e.blocks.num_free_blocks, "waiting": waiting,
                                 "kv_blocks_cached": e.blocks.num_cached_blocks,
                                 "prefix_cache_queries": e.blocks.prefix.queries,
                                 "prefix_cache_hits": e.blocks.prefix.hits,
                                 "running": e.num_running, "preemptions": e.scheduler.num_preemptions,
                                 "steps": self._steps})
