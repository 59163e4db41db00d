"""The engine in a process of its own, the server's :class:`EngineClient` in front of it (vLLM
V1's split of the API server and the engine core).

::

    server process (HTTP, streaming)                 engine process
    --------------------------------                 --------------
    EngineProcessClient (an EngineLoop               _EngineCore (an EngineLoop whose
      without an engine thread)                        engine thread sends what it posts)
    add_requests / abort / call  -- ("cmd", id, fn) -->  reader thread -> command queue
    OutputStream queues    <-- ("dispatch", outputs) --  engine thread, after each step
    futures                <-- ("result" | "error") --   ... after each command
    /kv listeners          <-- ("kv", snapshot) ------   ... while some listener is open
    /health                <-- ("dead", reason, exc) --  an engine fault

Why: in one process the event loop's work for every streamed token (the SSE event, the socket
write, the wake-ups: 0.4-0.5 ms of CPU a token on a 2-core Zen 3) needs the GIL, so it either
waits for the engine thread's Python between two forwards or holds the GIL while the engine
thread wants it: served decode ran at 0.91-0.97x the same engine offline. With the engine in
its own process that work runs beside the engine's own Python, on the core the forward leaves
idle between two steps (docs/perf.md, "the served path in two processes").

Commands are the callables :class:`EngineLoop` builds (``functools.partial`` of module-level
functions, ``operator.methodcaller``): they pickle. A ``call(fn)`` whose ``fn`` does not pickle
(a lambda) raises :class:`EngineProcessError` before anything is sent. What comes back pickles
too: :class:`~pagedkv.engine.outputs.RequestOutput` s, stats, snapshots, pagedkv's exceptions.
An engine process that exits (killed, crashed) fails every open stream with an
:class:`EngineDeadError` and /health answers 503 with its exit code; the server keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import pickle
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from pagedkv.engine.engine_loop import (
    EngineDeadError,
    EngineLoop,
    KVStateListener,
    _Command,
    _set_exception,
    _set_result,
)
from pagedkv.engine.input_processor import InputProcessor, InputThread
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.errors import PagedKVError

logger = logging.getLogger(__name__)

__all__ = ["EngineProcessClient", "EngineProcessError"]

#: Seconds the engine process may take to stop after it was asked to, before it is killed.
STOP_TIMEOUT_S = 30.0


class EngineProcessError(PagedKVError, RuntimeError):
    """The engine process could not be started, or a command for it does not pickle."""


class OutputDeltas:
    """Engine side of the outputs' wire: each :class:`RequestOutput` as what changed since the
    request's last one, so that a step's message does not grow with the context. A
    RequestOutput's cumulative fields are the concatenation of its deltas (the output
    processor's own rule: ``text`` is every ``new_text`` so far, ``token_ids`` every
    ``new_token_ids``, the last ``len(new_token_ids)`` entries of ``logprobs`` are the new
    tokens'); the prompt's token ids and its logprobs are sent once. Pickling the whole object
    took 80-90 us a step each way with a 512-token prompt, growing with every token.

    Wire form of one output: ``(request_id, prompt, prompt_token_ids, prompt_logprobs,
    finished, num_cached_tokens, metrics, embedding, completions)``, the prompt's three fields
    None after the request's first output (prompt_logprobs: after the first that has them);
    a completion ``(index, new_text, new_token_ids, new_logprobs, finish_reason, stop_reason,
    error, cumulative_logprob)``, ``new_logprobs`` None where the output has no logprobs.
    """

    def __init__(self) -> None:
        self._started: set[str] = set()  # requests whose prompt was sent
        self._prompt_logprobs_sent: set[str] = set()

    def encode(self, outputs: list[Any]) -> list[tuple]:
        wire = []
        for o in outputs:
            rid = o.request_id
            first = rid not in self._started
            prompt_logprobs = None
            if o.prompt_logprobs is not None and rid not in self._prompt_logprobs_sent:
                prompt_logprobs = o.prompt_logprobs
                self._prompt_logprobs_sent.add(rid)
            completions = []
            for c in o.outputs:
                new_logprobs = None
                if c.logprobs is not None:
                    num_new = len(c.new_token_ids)
                    new_logprobs = c.logprobs[len(c.logprobs) - num_new :] if num_new else []
                completions.append((
                    c.index, c.new_text, c.new_token_ids, new_logprobs, c.finish_reason,
                    c.stop_reason, c.error, c.cumulative_logprob,
                ))  # fmt: skip
            wire.append((
                rid, o.prompt if first else None, o.prompt_token_ids if first else None,
                prompt_logprobs, o.finished, o.num_cached_tokens, o.metrics, o.embedding,
                completions,
            ))  # fmt: skip
            if o.finished:
                self._started.discard(rid)
                self._prompt_logprobs_sent.discard(rid)
            else:
                self._started.add(rid)
        return wire


class OutputAssembler:
    """Server side of the outputs' wire (:class:`OutputDeltas`): each request's cumulative
    fields kept and extended, so the :class:`RequestOutput` s handed on are those the engine
    made (``token_ids``, ``logprobs`` and ``prompt_token_ids`` lists that grow as the
    engine's do)."""

    def __init__(self) -> None:
        self._requests: dict[
            str, list
        ] = {}  # id -> [prompt, prompt ids, prompt logprobs, {index: [text, ids, logprobs]}]

    def decode(self, wire: list[tuple]) -> list[RequestOutput]:
        outputs = []
        for (
            rid,
            prompt,
            prompt_ids,
            prompt_logprobs,
            finished,
            cached,
            metrics,
            embedding,
            completions,
        ) in wire:
            state = self._requests.get(rid)
            if state is None:
                state = self._requests[rid] = [prompt, prompt_ids or [], None, {}]
            if prompt_logprobs is not None:
                state[2] = prompt_logprobs
            samples = state[3]
            built = []
            for index, new_text, new_ids, new_logprobs, reason, stop, error, cum in completions:
                sample = samples.get(index)
                if sample is None:
                    sample = samples[index] = ["", [], None if new_logprobs is None else []]
                sample[0] += new_text
                sample[1].extend(new_ids)
                if new_logprobs is not None:
                    if sample[2] is None:
                        sample[2] = []
                    sample[2].extend(new_logprobs)
                built.append(CompletionOutput(
                    index=index, text=sample[0], token_ids=sample[1], new_text=new_text,
                    new_token_ids=new_ids, finish_reason=reason, stop_reason=stop, error=error,
                    logprobs=None if new_logprobs is None else sample[2],
                    cumulative_logprob=cum,
                ))  # fmt: skip
            outputs.append(RequestOutput(
                request_id=rid, prompt=state[0], prompt_token_ids=state[1], outputs=built,
                finished=finished, prompt_logprobs=state[2], num_cached_tokens=cached,
                metrics=metrics, embedding=embedding,
            ))  # fmt: skip
            if finished:
                del self._requests[rid]
        return outputs


class _EngineCore(EngineLoop):
    """The engine process's loop: :class:`EngineLoop`'s engine thread, whose posts (outputs,
    command results, KV snapshots, the engine's fault) go over ``conn`` instead of to an event
    loop. Only the engine thread sends on ``conn``; the process's main thread only receives."""

    def __init__(self, engine: Any, conn: Connection) -> None:
        super().__init__(engine)
        self._conn = conn
        self._wire = OutputDeltas()

    def start_core(self) -> None:
        self.start(None)  # type: ignore[arg-type]  # nothing is posted to an event loop

    def _post(self, fn: Any, *args: Any) -> None:
        if fn is _set_result or fn is _set_exception:
            cmd_id, value = args
            message: tuple = ("result" if fn is _set_result else "error", cmd_id, value)
        elif fn == self._dispatch:
            outputs, step_time = args
            message = ("dispatch", self._wire.encode(outputs), step_time)
        elif fn == self._publish_kv:
            message = ("kv", *args)
        elif fn == self._fail_all:
            message = ("dead", self.error_reason or "the engine stopped", *args)
        else:  # pragma: no cover - every post of EngineLoop is named above
            raise AssertionError(f"unknown post {fn!r}")
        try:
            self._conn.send(message)
        except (OSError, ValueError):  # the server went away: nothing to tell
            self._stopping = True
        except Exception as exc:  # a result that does not pickle: the caller gets why
            if message[0] in ("result", "error"):
                self._conn.send(("error", message[1], EngineProcessError(
                    f"the engine's answer does not pickle: {type(exc).__name__}: {exc}"
                )))  # fmt: skip
            else:
                raise


def _engine_process_main(conn: Connection, config: Any, setup: Callable[[], Any] | None) -> None:
    """The engine process: run ``setup`` (the server's logging), build the engine, say ready
    (with its input processor), step it in a thread, and read the server's messages until told
    to stop or the server is gone."""
    from pagedkv.engine.llm_engine import LLMEngine

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops it (Ctrl-C reaches both)
    if setup is not None:
        setup()
    try:
        engine = LLMEngine(config)
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        raise
    core = _EngineCore(engine, conn)
    conn.send(("ready", engine.input_processor))
    core.start_core()
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break  # the server exited
            kind = message[0]
            if kind == "cmd":
                _, cmd_id, fn = message
                core._send(_Command(fn, cmd_id))
            elif kind == "kv_listeners":
                core._num_kv_listeners, wanted = message[1], message[2]
                core._kv_wanted = core._kv_wanted or wanted
                core._wake.set()
            elif kind == "stop":
                break
    finally:
        core.stop()
        engine.shutdown()
        conn.close()


class EngineProcessClient(EngineLoop):
    """The :class:`EngineClient` of an engine in a process of its own (see the module
    docstring): what :class:`EngineLoop` keeps on the event loop (streams, futures, KV
    listeners) is here; the engine thread is in the other process.

    Args:
        config: the engine's :class:`~pagedkv.engine.config.EngineConfig` (pickled to the
            engine process, which builds the engine from it).
        setup: run first in the engine process (it starts with nothing of this one's: the
            server passes its logging set-up); it must pickle (a module-level function, or a
            ``functools.partial`` of one).

    Raises:
        EngineProcessError: from :meth:`launch`, the engine process failed to build the
            engine (its error is in the message) or exited first.
    """

    def __init__(self, config: Any, *, setup: Callable[[], Any] | None = None) -> None:
        super().__init__(None)
        self._config = config
        self._setup = setup
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._processor: InputProcessor | None = None
        self._futures: dict[int, asyncio.Future] = {}
        self._outputs = OutputAssembler()
        self._next_id = 0
        self._send_lock = threading.Lock()  # abort() may come from any thread of the loop's

    # ---- lifetime ---------------------------------------------------------------------------

    def launch(self) -> None:
        """Start the engine process and wait until its engine is built (the model loaded).

        Raises:
            EngineProcessError: it failed or exited first.
        """
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        process = context.Process(
            target=_engine_process_main,
            args=(theirs, self._config, self._setup),
            name="pagedkv-engine",
            daemon=True,
        )
        process.start()
        theirs.close()
        try:
            message = ours.recv()
        except (EOFError, OSError):
            process.join(5)
            raise EngineProcessError(
                f"the engine process exited (code {process.exitcode}) before its engine was built"
            ) from None
        if message[0] != "ready":
            process.join(STOP_TIMEOUT_S)
            raise EngineProcessError(f"the engine process could not build the engine: {message[1]}")
        self._processor = message[1]
        self._process, self._conn = process, ours

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver the engine process's messages on ``loop`` (:meth:`launch` first)."""
        if self._conn is None:
            raise EngineProcessError("launch() the engine process before start()")
        self._loop = loop
        loop.add_reader(self._conn.fileno(), self._on_readable)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Ask the engine process to stop after its current step; kill it if it has not
        within ``timeout`` seconds."""
        self._stopping = True
        if self._input is not None:
            self._input.close()
        conn, process = self._conn, self._process
        if conn is None or process is None:
            return
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(conn.fileno())
        with contextlib.suppress(OSError, ValueError):
            self._send_message(("stop",))
        process.join(timeout)
        if process.is_alive():
            logger.warning("the engine process did not stop in %.0f s; killing it", timeout)
            process.kill()
            process.join(5)
        conn.close()
        self._conn = None

    @property
    def is_alive(self) -> bool:
        return (
            self._process is not None
            and self._process.is_alive()
            and self._conn is not None
            and self._loop is not None
            and self.error is None
            and not self._stopping
        )

    @property
    def status_reason(self) -> str:
        if self.is_alive:
            return ""
        if self.error_reason is not None:
            return self.error_reason
        if self._loop is None:
            return "it has not started"
        return "it was stopped"

    # ---- the engine's side, as EngineLoop reaches it ----------------------------------------

    def _input_thread(self) -> InputThread:
        if self._input is None:
            if self._processor is None:
                raise EngineProcessError("the engine process has not been launched")
            self._input = InputThread(self._processor.copy())
        return self._input

    def _send_message(self, message: tuple) -> None:
        if self._conn is None:
            raise EngineDeadError(f"the engine is not running: {self.status_reason}")
        with self._send_lock:
            self._conn.send(message)

    def _send(self, command: _Command) -> None:
        cmd_id = None
        if command.future is not None:
            cmd_id = self._next_id
            self._next_id += 1
        try:
            payload = pickle.dumps(("cmd", cmd_id, command.fn), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise EngineProcessError(
                f"a command for the engine process does not pickle ({type(exc).__name__}: "
                f"{exc}); give call() a module-level function or operator.methodcaller"
            ) from None
        if self._conn is None:
            if command.future is None:
                return  # an abort after the engine stopped: nothing left to free
            raise EngineDeadError(f"the engine is not running: {self.status_reason}")
        if command.future is not None:
            self._futures[cmd_id] = command.future
        try:
            with self._send_lock:
                self._conn.send_bytes(payload)
        except (OSError, ValueError):
            self._futures.pop(cmd_id, None)
            if command.future is not None:
                raise EngineDeadError("the engine process is gone") from None

    def listen_kv_states(self) -> KVStateListener:
        listener = super().listen_kv_states()
        self._send_message(("kv_listeners", self._num_kv_listeners, True))
        return listener

    def _drop_kv_listener(self, queue: asyncio.Queue) -> None:
        super()._drop_kv_listener(queue)
        with contextlib.suppress(EngineDeadError, OSError, ValueError):
            self._send_message(("kv_listeners", self._num_kv_listeners, False))

    # ---- messages from the engine process (on the event loop) -------------------------------

    def _on_readable(self) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            while conn.poll():
                self._handle(conn.recv())
        except (EOFError, OSError):
            self._engine_gone()

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "dispatch":
            self._dispatch(self._outputs.decode(message[1]), message[2])
        elif kind == "result":
            future = self._futures.pop(message[1], None)
            if future is not None:
                _set_result(future, message[2])
        elif kind == "error":
            future = self._futures.pop(message[1], None)
            if future is not None:
                _set_exception(future, message[2])
        elif kind == "kv":
            self._publish_kv(message[1])
        elif kind == "dead":
            self.error_reason, self.error = message[1], message[2]
            self._fail_everything(message[2])

    def _engine_gone(self) -> None:
        """The engine process exited (or its pipe broke) without being asked to."""
        conn = self._conn
        if self._loop is not None and conn is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(conn.fileno())
        process = self._process
        if process is not None:
            process.join(1)
        code = None if process is None else process.exitcode
        if self.error is None and not self._stopping:
            self.error_reason = f"the engine process exited (exit code {code})"
            self.error = EngineDeadError(f"the engine stopped: {self.error_reason}")
            logger.error("%s; the server stops taking requests", self.error_reason)
        self._fail_everything(self.error or EngineDeadError("the engine stopped"))

    def _fail_everything(self, exc: BaseException) -> None:
        self._outputs = OutputAssembler()  # no request's outputs come any more
        futures, self._futures = self._futures, {}
        for future in futures.values():
            _set_exception(future, EngineDeadError(f"the engine stopped: {self.status_reason}"))
        self._fail_all(exc)
