"""The engine in a process of its own, the server's :class:`EngineClient` in front of it (vLLM
V1's split of the API server and the engine core).

::

    server process (HTTP, streaming)                 engine process
    --------------------------------                 --------------
    EngineProcessClient (an EngineLoop               _EngineCore (an EngineLoop whose
      without an engine thread)                        engine thread sends what it posts)
    add_requests / abort / call  -- ("cmd", id, fn) -->  main thread -> command queue
    OutputStream queues    <-- ("dispatch", deltas) ---  engine thread, after each step
    futures                <-- ("result" | "error") --   ... after each command
    /kv listeners          <-- ("kv", snapshot) ------   ... while some listener is open
    /health                <-- ("dead", reason, exc) --  an engine fault

Why: in one process the event loop's work for every streamed token (the SSE event, the socket
write, the wake-ups: 0.4-0.5 ms of CPU a token on a 2-core Zen 3) needs the GIL, so it either
waits for the engine thread's Python between two forwards or holds the GIL while the engine
thread wants it: served decode ran at 0.92-0.98x the same engine offline. With the engine in
its own process that work runs beside the engine's own Python, on the core the forward leaves
idle between two steps (docs/perf.md, "the served path in two processes"). Commands go over
one pipe (blocking), everything else comes back over another, read without blocking the event
loop (:class:`_EventReader`); outputs cross as deltas (:class:`OutputDeltas`).

Commands are the callables :class:`EngineLoop` builds (``functools.partial`` of module-level
functions, ``operator.methodcaller``): they pickle. A ``call(fn)`` whose ``fn`` does not pickle
(a lambda) raises :class:`EngineProcessError` before anything is sent. What comes back pickles
too: :class:`~pagedkv.engine.outputs.RequestOutput` s, stats, snapshots, pagedkv's exceptions.
An engine process that exits (killed, crashed) fails every open stream with an
:class:`EngineDeadError` and /health answers 503 with its exit code; the server keeps running.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import struct
import threading
import time
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
        """One step's :class:`RequestOutput` s -> their wire form (picklable tuples, one per
        output, in order); forgets a request once its finished output is encoded."""
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
        # id -> [prompt, prompt ids, prompt logprobs, {index: [text, ids, logprobs]}]
        self._requests: dict[str, list] = {}

    def decode(self, wire: list[tuple]) -> list[RequestOutput]:
        """:meth:`OutputDeltas.encode`'s tuples -> the engine's RequestOutputs, in order;
        forgets a request once its finished output is decoded."""
        outputs = []
        for output in wire:
            rid, prompt, prompt_ids, prompt_logprobs, finished = output[:5]
            cached, metrics, embedding, completions = output[5:]
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


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling both ways (pagedkv's exceptions do), else an
    :class:`EngineProcessError` naming it: an exception class whose ``__init__`` takes other
    arguments than its ``args`` would fail in the server's unpickling and leave a caller
    waiting."""
    try:
        pickle.loads(pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:
        return EngineProcessError(f"{type(exc).__name__}: {exc}")
    return exc


class _EngineCore(EngineLoop):
    """The engine process's loop: :class:`EngineLoop`'s engine thread, whose posts (outputs,
    command results, KV snapshots, the engine's fault) go over ``conn`` instead of to an event
    loop. Only the engine thread sends on ``conn``; the process's main thread only receives
    (on another pipe)."""

    def __init__(self, engine: Any, conn: Connection) -> None:
        super().__init__(engine)
        self._conn = conn
        self._emit_lock = threading.Lock()  # the main thread answers unreadable commands
        self._wire = OutputDeltas()

    def start_core(self) -> None:
        self.start(None)  # type: ignore[arg-type]  # nothing is posted to an event loop

    def _run(self) -> None:
        try:
            super()._run()
        except BaseException as exc:  # the thread must not end unseen: the server would wait
            logger.exception("the engine thread failed outside a step")
            self._die(f"the engine thread failed: {type(exc).__name__}: {exc}", exc)

    def _die(self, reason: str, exc: BaseException) -> None:
        self.error_reason = reason
        self.error = exc
        self._stopping = True
        self._emit(("dead", reason, _portable(EngineDeadError(f"the engine stopped: {reason}"))))

    def _post(self, fn: Any, *args: Any) -> None:
        if fn is _set_result:
            message: tuple = ("result", *args)
        elif fn is _set_exception:
            message = ("error", args[0], _portable(args[1]))
        elif fn == self._dispatch:
            outputs, step_time = args
            message = ("dispatch", self._wire.encode(outputs), step_time)
        elif fn == self._publish_kv:
            message = ("kv", *args)
        elif fn == self._fail_all:
            message = ("dead", self.error_reason or "the engine stopped", _portable(*args))
        else:  # pragma: no cover - every post of EngineLoop is named above
            raise EngineProcessError(f"unknown post {fn!r}")
        self._emit(message)

    def _emit(self, message: tuple) -> None:
        try:
            payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            if message[0] == "result":  # the caller gets why, the engine goes on
                payload = pickle.dumps(("error", message[1], EngineProcessError(
                    f"the engine's answer does not pickle: {type(exc).__name__}: {exc}"
                )))  # fmt: skip
            else:  # a step's outputs or a snapshot: nothing after it could be trusted
                raise
        try:
            with self._emit_lock:
                self._conn.send_bytes(payload)
        except OSError:  # the server went away: nothing to tell
            self._stopping = True

    def queue_command(self, fn: Any, cmd_id: int | None) -> None:
        """A command from the server, for the engine thread (between two steps)."""
        self._commands.put(_Command(fn, cmd_id))  # type: ignore[arg-type]
        self._wake.set()


def _engine_process_main(
    commands: Connection, events: Connection, config: Any, setup: Callable[[], Any] | None
) -> None:
    """The engine process: run ``setup`` (the server's logging), build the engine, say ready
    (with its input processor), step it in a thread, and read the server's commands until told
    to stop or the server is gone (its end of the pipe closed)."""
    from pagedkv.engine.llm_engine import LLMEngine

    # The server stops it: Ctrl-C, or a SIGTERM to the whole process group (systemd's
    # default), reaches both, and the server drains first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if setup is not None:
        setup()
    try:
        engine = LLMEngine(config)
    except BaseException as exc:
        events.send(("failed", f"{type(exc).__name__}: {exc}"))
        raise
    core = _EngineCore(engine, events)
    events.send(("ready", engine.input_processor))
    core.start_core()
    try:
        while True:
            try:
                kind, *rest = pickle.loads(commands.recv_bytes())
            except (EOFError, OSError):
                break  # the server exited
            if kind == "cmd":
                cmd_id, fn_bytes = rest
                try:
                    fn = pickle.loads(fn_bytes)
                except Exception as exc:
                    if cmd_id is not None:
                        core._emit(("error", cmd_id, EngineProcessError(
                            f"the engine process cannot read the command: "
                            f"{type(exc).__name__}: {exc}"
                        )))  # fmt: skip
                    continue
                core.queue_command(fn, cmd_id)
            elif kind == "kv_listeners":
                core._num_kv_listeners, wanted = rest
                core._kv_wanted = core._kv_wanted or wanted
                core._wake.set()
            elif kind == "stop":
                break
    finally:
        core.stop()
        engine.shutdown()
        # The engine thread may still be sending if its join timed out: let it finish (the
        # server reads until this process exits), but never wait on it for long.
        locked = core._emit_lock.acquire(timeout=5)
        events.close()
        if locked:
            core._emit_lock.release()


class _EventReader:
    """Reads the engine process's messages on an event loop without ever blocking it: the read
    end is non-blocking (uvloop makes the file descriptor it watches non-blocking anyway), the
    bytes are framed here as multiprocessing's ``Connection.send_bytes`` writes them (a 4-byte
    big-endian length, or -1 and an 8-byte one), and only whole messages are unpickled."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self._buffer = bytearray()
        self.closed = False

    def read(self) -> list[bytes]:
        """The whole messages that arrived; sets :attr:`closed` at the end of the stream."""
        while True:
            try:
                chunk = os.read(self.fd, 1 << 20)
            except BlockingIOError:
                break
            except OSError:
                self.closed = True
                break
            if not chunk:
                self.closed = True
                break
            self._buffer += chunk
        messages = []
        buffer = self._buffer
        start = 0
        while len(buffer) - start >= 4:
            (size,) = struct.unpack_from("!i", buffer, start)
            header = 4
            if size == -1:
                if len(buffer) - start < 12:
                    break
                (size,) = struct.unpack_from("!Q", buffer, start + 4)
                header = 12
            if len(buffer) - start < header + size:
                break
            messages.append(bytes(buffer[start + header : start + header + size]))
            start += header + size
        if start:
            del buffer[:start]
        return messages


def _exit_description(code: int | None) -> str:
    """``exited (exit code N)``, or ``was killed by signal N (SIGNAME)`` for a negative code
    (multiprocessing's way of saying a signal ended the process)."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown"
        return f"was killed by signal {-code} ({name})"
    return f"exited (exit code {code})"


def _close_quietly(*conns: Connection) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):
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
        self._commands_out: Connection | None = None  # blocking: commands are small
        self._events_in: Connection | None = None
        self._reader: _EventReader | None = None
        self._processor: InputProcessor | None = None
        self._futures: dict[int, asyncio.Future] = {}
        self._outputs = OutputAssembler()
        self._next_id = 0
        self._send_lock = threading.Lock()  # abort() may come from another thread

    # ---- lifetime ---------------------------------------------------------------------------

    def launch(self) -> None:
        """Start the engine process and wait until its engine is built (the model loaded).

        Raises:
            EngineProcessError: it failed or exited first, or it was launched already.
        """
        if self._process is not None:
            raise EngineProcessError("the engine process was launched already")
        context = multiprocessing.get_context("spawn")
        commands_in, commands_out = context.Pipe(duplex=False)
        events_in, events_out = context.Pipe(duplex=False)
        # Not a daemon: a daemon may not start children, and tensor-parallel workers are the
        # engine's children. It exits when the server's ends of the pipes close, which the
        # exit hook below does at the latest when this process exits: registered after
        # multiprocessing's own (made when this module imported it), it runs before
        # multiprocessing joins its children at exit.
        process = context.Process(
            target=_engine_process_main,
            args=(commands_in, events_out, self._config, self._setup),
            name="pagedkv-engine",
        )
        process.start()
        _close_quietly(commands_in, events_out)
        atexit.register(_close_quietly, commands_out, events_in)
        try:
            message = events_in.recv()
        except (EOFError, OSError):
            message = None
        except BaseException:  # Ctrl-C while the model loads: the child ignores SIGINT
            _close_quietly(commands_out, events_in)
            process.kill()
            process.join(5)
            raise
        if message is None or message[0] != "ready":
            _close_quietly(commands_out, events_in)
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join(5)
            if message is None:
                raise EngineProcessError(
                    f"the engine process exited (code {process.exitcode}) before its engine "
                    "was built"
                )
            raise EngineProcessError(f"the engine process could not build the engine: {message[1]}")
        self._processor = message[1]
        self._process, self._commands_out, self._events_in = process, commands_out, events_in

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver the engine process's messages on ``loop`` (:meth:`launch` first)."""
        if self._events_in is None:
            raise EngineProcessError("launch() the engine process before start()")
        self._loop = loop
        self._reader = _EventReader(self._events_in.fileno())
        loop.add_reader(self._reader.fd, self._on_readable)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Ask the engine process to stop after its current step; kill it if it has not
        within ``timeout`` seconds. Commands still waiting get an :class:`EngineDeadError`.
        What the engine sends meanwhile is read and dropped, so that a large message in
        flight (a KV snapshot) never blocks its exit."""
        self._stopping = True
        if self._input is not None:
            self._input.close()
        process = self._process
        if process is None or self._commands_out is None:
            return
        with contextlib.suppress(OSError, ValueError, EngineDeadError):
            self._send_message(("stop",))
        reader = self._reader
        self._remove_reader()
        deadline = time.monotonic() + timeout
        while process.is_alive() and time.monotonic() < deadline:
            process.join(0.05)
            if reader is not None and not reader.closed:
                reader.read()
        if process.is_alive():
            logger.warning("the engine process did not stop in %.0f s; killing it", timeout)
            process.kill()
            process.join(5)
        _close_quietly(self._commands_out, self._events_in)
        self._commands_out = self._events_in = None
        self._fail_futures()

    def _remove_reader(self) -> None:
        reader, self._reader = self._reader, None
        if self._loop is not None and reader is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(reader.fd)

    @property
    def is_alive(self) -> bool:
        return (
            self._process is not None
            and self._process.is_alive()
            and self._reader is not None
            and self.error is None
            and not self._stopping
        )

    def _stopped_reason(self) -> str:
        if self._loop is None:
            return "it has not started"
        if self._process is not None and not self._process.is_alive() and not self._stopping:
            return f"the engine process {_exit_description(self._process.exitcode)}"
        return "it was stopped"

    # ---- the engine's side, as EngineLoop reaches it ----------------------------------------

    def _input_thread(self) -> InputThread:
        if self._input is None:
            if self._processor is None:
                raise EngineProcessError("the engine process has not been launched")
            self._input = InputThread(self._processor.copy())
        return self._input

    def _send_message(self, message: tuple) -> None:
        conn = self._commands_out
        if conn is None:
            raise EngineDeadError(f"the engine is not running: {self.status_reason}")
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            conn.send_bytes(payload)

    def _send(self, command: _Command) -> None:
        try:
            fn_bytes = pickle.dumps(command.fn, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise EngineProcessError(
                f"a command for the engine process does not pickle ({type(exc).__name__}: "
                f"{exc}); give call() a module-level function or operator.methodcaller"
            ) from None
        cmd_id = None
        if command.future is not None:
            cmd_id = self._next_id
            self._next_id += 1
            self._futures[cmd_id] = command.future
        try:
            self._send_message(("cmd", cmd_id, fn_bytes))
        except (OSError, ValueError, EngineDeadError):
            if cmd_id is None:
                return  # an abort after the engine stopped: nothing left to free
            self._futures.pop(cmd_id, None)
            raise EngineDeadError(f"the engine is not running: {self.status_reason}") from None

    def listen_kv_states(self) -> KVStateListener:
        listener = super().listen_kv_states()
        try:
            self._send_message(("kv_listeners", self._num_kv_listeners, True))
        except (OSError, ValueError) as exc:  # the engine process went away just now
            super()._drop_kv_listener(listener.queue)
            raise EngineDeadError(f"the engine is not running: {exc}") from None
        return listener

    def _drop_kv_listener(self, queue: asyncio.Queue) -> None:
        super()._drop_kv_listener(queue)
        with contextlib.suppress(EngineDeadError, OSError, ValueError):
            self._send_message(("kv_listeners", self._num_kv_listeners, False))

    # ---- messages from the engine process (on the event loop) -------------------------------

    def _on_readable(self) -> None:
        reader = self._reader
        if reader is None:
            return
        for payload in reader.read():
            try:
                self._handle(pickle.loads(payload))
            except Exception:  # a class not importable here, say: drop it, say why, go on
                logger.exception("a message from the engine process could not be handled")
        if reader.closed:
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
            logger.error("engine fault in the engine process: %s", message[1])
            self._fail_everything(message[2])

    def _engine_gone(self) -> None:
        """The engine process's end of the pipe closed without being asked to: it exited (or
        is exiting: it is killed if it has not within a few seconds)."""
        self._remove_reader()
        process = self._process
        code = None
        if process is not None:
            process.join(1)
            if process.is_alive():
                process.kill()
                process.join(5)
            code = process.exitcode
        if self.error is None and not self._stopping:
            self.error_reason = f"the engine process {_exit_description(code)}"
            self.error = EngineDeadError(f"the engine stopped: {self.error_reason}")
            logger.error("%s; the server stops taking requests", self.error_reason)
        self._fail_everything(self.error or EngineDeadError("the engine stopped"))

    def _fail_futures(self) -> None:
        futures, self._futures = self._futures, {}
        reason = self.status_reason or "the engine stopped"
        for future in futures.values():
            _set_exception(future, EngineDeadError(f"the engine is not running: {reason}"))

    def _fail_everything(self, exc: BaseException) -> None:
        self._outputs = OutputAssembler()  # no request's outputs come any more
        self._fail_futures()
        self._fail_all(exc)
