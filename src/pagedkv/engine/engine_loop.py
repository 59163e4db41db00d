"""The engine stepping in its own thread, its outputs fanned out to per-request asyncio queues.

::

    event loop (HTTP handlers)                       engine thread
    ---------------------------                      -------------
    add_requests() -- command queue --------------->  run commands between steps
    abort()       --- (thread-safe, wakes thread) ->  engine.step()  (torch releases the GIL)
    call(fn)                                              |
    OutputStream  <-- loop.call_soon_threadsafe(...) --  list[RequestOutput], step end time

The engine is not thread-safe, so only the engine thread touches it: everything the event loop
wants done (add, abort, stats, reset the prefix cache) goes through the command queue and runs
between two steps. The thread sleeps on an event while there is nothing to do.

While a /kv page listens (:meth:`EngineLoop.listen_kv_states`), the engine thread also takes a
snapshot of the KV cache between two steps (``engine.kv_snapshot()``, plain data) a few times a
second and hands it to the listeners; with no listener it takes none. Its share of the engine
thread's time is kept under 1%: the next snapshot waits at least 100 times as long as the last
one took (:data:`KV_SNAPSHOT_MAX_SHARE`).

A step that raises is a request's fault unless shown otherwise: the engine has already finished
the step's requests with finish_reason "error" (the next step reports them; their clients get a
500) and the loop keeps serving. It stops, and /health answers 503 with the reason, only for an
engine fault, told apart by :func:`engine_fault`:

- the exception's class says so: ``MemoryError``, torch's ``OutOfMemoryError``, ``SystemError``,
  or pagedkv's ``CacheStateError`` (the KV cache's own structures disagree: nothing after it can
  be trusted);
- or the engine fails its probe: ``engine.check_health()`` runs the model on a one-token request
  alone; if a step with no client request in it fails too, the model itself is broken;
- or ``MAX_CONSECUTIVE_FAILED_STEPS`` steps in a row failed (a fault outside the model that every
  step hits, e.g. in the scheduler).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import operator
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pagedkv.engine.cpu_runtime import release_openmp_threads
from pagedkv.engine.input_processor import InputProcessor, InputThread
from pagedkv.engine.protocol import EngineRequest
from pagedkv.errors import PagedKVError

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = [
    "EngineDeadError",
    "EngineLoop",
    "EngineRequest",
    "KVStateListener",
    "OutputStream",
    "engine_fault",
]

#: Steps in a row that may fail (each failing only its own requests) before the loop gives up.
MAX_CONSECUTIVE_FAILED_STEPS = 32

#: Exception classes (matched by name along the MRO, so torch need not be imported here) that are
#: never a request's fault.
ENGINE_FAULT_CLASSES = frozenset(
    {"MemoryError", "OutOfMemoryError", "SystemError", "CacheStateError"}
)


#: Most snapshots per second sent to /kv pages (a few: a person watches them).
KV_SNAPSHOT_RATE = 4.0
#: Most of the engine thread's time that snapshots may take: after a snapshot that took t
#: seconds, the next one waits at least t / KV_SNAPSHOT_MAX_SHARE.
KV_SNAPSHOT_MAX_SHARE = 0.01


class EngineDeadError(PagedKVError, RuntimeError):
    """The engine thread is not running (stopped, or an engine fault)."""


def engine_fault(engine: Any, exc: BaseException, num_failed_steps: int) -> str | None:
    """Why ``exc`` (raised by ``engine.step()``) is the engine's fault, or ``None`` if it is the
    fault of the step's requests (see the module docstring). Runs in the engine thread."""
    for cls in type(exc).__mro__:
        if cls.__name__ in ENGINE_FAULT_CLASSES:
            return f"{cls.__name__} in an engine step: {exc}"
    check_health = getattr(engine, "check_health", None)
    if check_health is not None:
        try:
            check_health()
        except Exception as probe_exc:
            return (
                f"the model fails even with no client request in the step "
                f"({type(probe_exc).__name__}: {probe_exc}); the step had failed with "
                f"{type(exc).__name__}: {exc}"
            )
    if num_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
        last = f"{type(exc).__name__}: {exc}"
        return f"{num_failed_steps} engine steps in a row failed; the last: {last}"
    return None


@dataclass(slots=True)
class _Command:
    fn: Callable[[Any], Any]
    future: asyncio.Future | None


@dataclass(slots=True)
class OutputStream:
    """The outputs of the engine requests behind one HTTP request (``n`` samples of each of its
    prompts), in the order the engine produced them, as ``(RequestOutput, time)`` pairs; the
    time (``time.monotonic()`` seconds) is when the step that produced the output ended.

    The stream ends when the last request's final output has been read; an exception in the
    queue means the engine failed and is raised by :meth:`get`."""

    request_ids: list[str]
    arrival_time: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_unfinished: int = 0

    def __post_init__(self) -> None:
        self.num_unfinished = len(self.request_ids)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    async def get(self) -> tuple[Any, float]:
        """The next output and its time; raises the engine's exception if it failed."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        if item[0].finished:
            self.num_unfinished -= 1
        return item


class KVStateListener:
    """Snapshots of the KV cache for one listener (:meth:`EngineLoop.listen_kv_states`); use it
    on the event loop only.

    Attributes:
        queue: the newest snapshot not yet read (at most one); ``None`` once the engine stopped.
    """

    def __init__(self, engine_loop: EngineLoop) -> None:
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=1)
        self._engine_loop = engine_loop

    async def get(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next snapshot; ``None`` when the engine stopped.

        Raises:
            TimeoutError: none came within ``timeout`` seconds (nothing changed).
        """
        return await asyncio.wait_for(self.queue.get(), timeout)

    def close(self) -> None:
        """Stop listening (the engine stops taking snapshots when no listener is left)."""
        self._engine_loop._drop_kv_listener(self.queue)


class EngineLoop:
    """Owns an engine and the thread that steps it; the :class:`EngineClient` of one engine.

    Args:
        engine: an object with ``add_request(request_id, prompt, sampling_params, *, priority,
            cache_salt)``, ``step() -> list[RequestOutput]`` (each with ``request_id`` and
            ``finished``), ``abort_request(request_ids)``, ``has_unfinished_requests()``,
            ``get_stats()``, ``reset_prefix_cache()``, an ``input_processor`` and optionally
            ``check_health()`` (pagedkv.engine.llm_engine.LLMEngine, or a fake in tests). A
            ``step()`` that raises must have finished the requests it touched (the next step
            reports them), as LLMEngine's does.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        # Prompts are processed on a thread of their own, with a tokenizer of their own (made
        # on first use: a cluster replica's loop gets token ids and never needs one).
        self._input: InputThread | None = None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, OutputStream] = {}
        #: the engine fault that stopped the loop, and why it is the engine's (None while alive).
        self.error: BaseException | None = None
        self.error_reason: str | None = None
        #: steps that failed (their requests finished with "error") while the loop went on.
        self.num_failed_steps = 0
        # KV snapshot listeners: queues of one (the newest snapshot), owned by the event loop;
        # the engine thread reads only their count.
        self._kv_listeners: set[asyncio.Queue] = set()
        self._num_kv_listeners = 0
        self._kv_dirty = False  # the engine changed since the last snapshot (engine thread)
        self._kv_wanted = False  # a new listener waits for its first snapshot
        self._next_kv_snapshot = 0.0  # time.monotonic() before which no snapshot is taken

    # ---- lifetime ---------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; its outputs are delivered on ``loop``. The calling thread's
        OpenMP threads are freed first (:func:`pagedkv.engine.cpu_runtime.release_openmp_threads`):
        the engine thread's own pool is then the only one, and its barriers keep their spin."""
        self._loop = loop
        release_openmp_threads()
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step (unfinished requests are left as they are)."""
        self._stopping = True
        self._wake.set()
        if self._input is not None:
            self._input.close()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def status_reason(self) -> str:
        """Why the engine is not running ("" while it runs)."""
        if self.is_alive:
            return ""
        if self.error_reason is not None:
            return self.error_reason
        return self._stopped_reason()

    def _stopped_reason(self) -> str:
        """Why the engine is not running when no fault stopped it."""
        return "it has not started" if self._thread is None else "it was stopped"

    @property
    def num_streams(self) -> int:
        """Requests with an open stream (added and neither finished nor aborted)."""
        return len(self._streams)

    # ---- called from the event loop ---------------------------------------------------------

    def _input_thread(self) -> InputThread:
        if self._input is None:
            self._input = InputThread(self.engine.input_processor.copy())
        return self._input

    @property
    def input_processor(self) -> InputProcessor:
        """The input thread's processor (limits, tokenizer rules)."""
        return self._input_thread().processor

    async def process(self, fn: Callable[[InputProcessor], T]) -> T:
        """``fn(input_processor)`` on the input thread (not the engine thread)."""
        return await self._input_thread().run(fn)

    async def get_stats(self) -> Any:
        """The engine's :class:`~pagedkv.engine.llm_engine.EngineStats`, read between steps."""
        return await self.call(operator.methodcaller("get_stats"))

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached block; False while blocks are in use."""
        return bool(await self.call(operator.methodcaller("reset_prefix_cache")))

    async def get_kv_state(self) -> dict[str, Any]:
        """A snapshot of the KV cache (``engine.kv_snapshot()``: plain data), taken between
        two steps."""
        return await self.call(operator.methodcaller("kv_snapshot"))

    def listen_kv_states(self) -> KVStateListener:
        """Start listening to snapshots of the KV cache as the engine runs: one at once, then
        the newest one after the engine changed, at most :data:`KV_SNAPSHOT_RATE` a second (a
        slow reader skips to the newest). The engine takes snapshots only while some listener
        is open; close it when done.

        Raises:
            EngineDeadError: the engine is not running.
        """
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running: {self.status_reason}")
        listener = KVStateListener(self)
        self._kv_listeners.add(listener.queue)
        self._num_kv_listeners = len(self._kv_listeners)
        self._kv_wanted = True
        self._wake.set()
        return listener

    @property
    def num_kv_listeners(self) -> int:
        """Open KV snapshot listeners (/kv pages following the feed)."""
        return self._num_kv_listeners

    def close_kv_listeners(self) -> None:
        """End every KV snapshot listener (their next ``get`` returns None): a server that
        shuts down ends its /kv event streams so that their connections close. Call it on the
        event loop."""
        self._publish_kv(None)

    def _drop_kv_listener(self, queue: asyncio.Queue) -> None:
        self._kv_listeners.discard(queue)
        self._num_kv_listeners = len(self._kv_listeners)

    def _publish_kv(self, snapshot: dict[str, Any] | None) -> None:
        for listener in self._kv_listeners:
            if listener.full():  # a slow reader gets the newest only
                listener.get_nowait()
            listener.put_nowait(snapshot)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread between two steps and return its result
        (or raise its exception)."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running: {self.status_reason}")
        future = asyncio.get_running_loop().create_future()
        self._send(_Command(fn, future))
        return await future

    async def add_requests(self, requests: list[EngineRequest]) -> OutputStream:
        """Add requests to the engine, all or none, in one command; returns their shared stream
        once the engine has accepted them.

        Raises:
            whatever ``engine.add_request`` raises (InvalidRequestError for a prompt that can
            never be served); requests added before the failing one are aborted again.
        """
        stream = OutputStream([r.request_id for r in requests], time.monotonic())
        for request_id in stream.request_ids:
            self._streams[request_id] = stream

        try:
            await self.call(functools.partial(_add_all, requests))
        except BaseException:
            for request_id in stream.request_ids:
                self._streams.pop(request_id, None)
            # Cancelled (the client left) while the command waited: it will still run, so
            # abort right behind it. After a failed add this is a no-op.
            self._send_abort(stream.request_ids)
            raise
        return stream

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort requests that have not finished (their blocks are freed); never blocks, and
        aborting a finished or unknown request is a no-op."""
        request_ids = [rid for rid in request_ids if self._streams.pop(rid, None) is not None]
        if request_ids:
            self._send_abort(request_ids)

    def _send_abort(self, request_ids: list[str]) -> None:
        self._send(_Command(functools.partial(_abort, request_ids), None))

    def _send(self, command: _Command) -> None:
        """Queue ``command`` for the engine thread (run between two steps)."""
        self._commands.put(command)
        self._wake.set()

    def _dispatch(self, outputs: list[Any], step_time: float) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted while the step ran
                continue
            stream.queue.put_nowait((output, step_time))
            if output.finished:
                del self._streams[output.request_id]

    def fail_streams(self, exc: BaseException) -> None:
        """End every open stream with ``exc`` (raised by its :meth:`OutputStream.get`) and
        abort their requests in the engine, which frees their blocks: how a server that shuts
        down fails the requests still running at its deadline (the server turns an
        :class:`EngineDeadError` into a 503, mid-stream an error event then ``[DONE]``). The
        engine keeps running; requests added afterwards are served. Call it on the event loop
        given to :meth:`start`; the aborts run even if :meth:`stop` follows at once."""
        request_ids = list(self._streams)
        self._fail_all(exc)
        if request_ids:
            self._send_abort(request_ids)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream.queue.put_nowait(exc)
        self._streams.clear()
        if not self.is_alive:
            self._publish_kv(None)  # the engine stopped: the listeners end

    # ---- the engine thread ------------------------------------------------------------------

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        # RuntimeError: the event loop is closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, *args)

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            self._kv_dirty = True  # an add or an abort changes the blocks
            try:
                result = command.fn(self.engine)
            except Exception as exc:  # handed back to the caller
                if command.future is not None:
                    self._post(_set_exception, command.future, exc)
                else:
                    logger.exception("engine command failed")
            else:
                if command.future is not None:
                    self._post(_set_result, command.future, result)

    def _kv_snapshot_wait(self) -> float | None:
        """Take a KV snapshot for the listeners if one is due (engine thread, between steps);
        returns the seconds until the next one is due, or None when none will be (no
        listener, or nothing changed)."""
        if not self._num_kv_listeners or not (self._kv_dirty or self._kv_wanted):
            return None
        now = time.monotonic()
        if now < self._next_kv_snapshot and not self._kv_wanted:
            return self._next_kv_snapshot - now
        try:
            snapshot = self.engine.kv_snapshot()
        except Exception:  # the view must never stop the engine
            logger.exception("KV cache snapshot failed; the /kv page gets none")
            self._num_kv_listeners = 0
            return None
        took = time.monotonic() - now
        self._next_kv_snapshot = now + max(1.0 / KV_SNAPSHOT_RATE, took / KV_SNAPSHOT_MAX_SHARE)
        self._kv_dirty = self._kv_wanted = False
        self._post(self._publish_kv, snapshot)
        return None

    def _run(self) -> None:
        engine = self.engine
        consecutive_failures = 0
        while not self._stopping:
            self._wake.clear()
            self._run_commands()
            if self._stopping:
                break
            wait = self._kv_snapshot_wait()
            if not engine.has_unfinished_requests():
                # Idle: a change not yet shown is sent when its time comes.
                self._wake.wait(wait)
                continue
            try:
                outputs = engine.step()
            except Exception as exc:
                consecutive_failures += 1
                reason = engine_fault(engine, exc, consecutive_failures)
                if reason is None:
                    self.num_failed_steps += 1
                    logger.exception("an engine step failed; its requests fail, serving goes on")
                    continue
                logger.exception("engine fault, the server stops taking requests: %s", reason)
                self.error_reason = reason
                self.error = exc
                self._post(self._fail_all, EngineDeadError(f"the engine stopped: {reason}"))
                break
            consecutive_failures = 0
            self._kv_dirty = True
            if outputs:
                self._post(self._dispatch, outputs, time.monotonic())
        # Answer the commands still queued so that no caller waits forever; aborts queued
        # before the stop (fail_streams at a shutdown) still free their requests' blocks.
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command.future is not None:
                self._post(_set_exception, command.future, EngineDeadError("the engine stopped"))
            elif self.error is None:
                try:
                    command.fn(engine)
                except Exception:
                    logger.exception("engine command failed")


def _add_all(requests: list[EngineRequest], engine: Any) -> None:
    """Add every request to ``engine``, or none: those added before one that raises are
    aborted again (a command of :meth:`EngineLoop.add_requests`; module level, so that it
    pickles for an engine in another process)."""
    added: list[str] = []
    try:
        for r in requests:
            engine.add_request(
                r.request_id,
                r.engine_prompt(),
                r.sampling_params,
                priority=r.priority,
                cache_salt=r.cache_salt,
            )
            added.append(r.request_id)
    except BaseException:
        if added:
            engine.abort_request(added)
        raise


def _abort(request_ids: list[str], engine: Any) -> None:
    engine.abort_request(request_ids)


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
