"""TensorParallelExecutor: one model split over ``tensor_parallel_size`` processes.

An :class:`~pagedkv.worker.executor.Executor` (``execute_model``, ``shutdown``), made by
:func:`~pagedkv.worker.executor.create_executor` when ``tensor_parallel_size`` > 1. Rank 0 lives
in the engine's process: the scheduler and the KV-cache manager run there once. Ranks 1 .. N-1 are
worker processes (``multiprocessing`` spawn) that each load the model keeping their shard only
(:mod:`pagedkv.model.parallel`), allocate a KV cache of their share of the KV heads with the same
``num_blocks``, and loop::

    rank 0                                    rank r > 0
    scheduler.schedule()
    broadcast(SchedulerOutput)  ------------> receive it
    InputBatch + forward          <-- all-reduces (2 per layer, embedding) -->  InputBatch + forward
    compute_logits                <-- all-gather of the vocabulary shards -->   compute_logits
    sample                                    (nothing to sample)

The scheduler output is plain data (:mod:`pagedkv.worker.scheduler_output`), pickled as it is: every
rank applies it to its own persistent batch, so block tables are the scheduler's, the same on
every rank, and every rank writes the same slots of its own KV heads. Only rank 0 samples; the
sampled tokens reach every rank, rank 0 included, with the next step's scheduler output (the new
token ids of each request), as in vLLM V1.

Two gloo process groups share one rendezvous (a ``TCPStore`` that rank 0 opens on 127.0.0.1 at a
port the OS picks): *compute* (the model's collectives; gloo on CPU, NCCL when the model is on
CUDA) and *control* (the step broadcast, pickled bytes; always gloo on CPU, with a long timeout,
since idle workers wait there between requests).

Failure and shutdown: a worker reports its error over a pipe and exits; rank 0 sees a dead peer
as a gloo error ("connection closed") in its next collective, or a dead process, and raises
:class:`~pagedkv.errors.WorkerError`; from then on every step raises it (the ranks are no longer in
step, as vLLM's EngineDeadError). Workers ignore SIGINT (rank 0 stops them), poll their parent's
pid and exit when it is gone. Ctrl-C on rank 0 mid-step leaves the workers inside that step's
collectives: rank 0 stops them and every later step raises WorkerError (a next step would wait
for them forever). :meth:`shutdown` (also run by a ``weakref.finalize`` at garbage
collection and at interpreter exit) sends a stop message, then terminates and kills stragglers.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.config import PagedKVConfig
from pagedkv.core.config import KVCacheConfig
from pagedkv.errors import ConfigError, WorkerError
from pagedkv.model.parallel import TensorParallelGroup
from pagedkv.worker.executor import Executor
from pagedkv.worker.model_runner import ModelRunner
from pagedkv.worker.outputs import ModelRunnerOutput
from pagedkv.worker.scheduler_output import SchedulerOutput

#: Seconds rank 0 waits for the workers to load their shards and meet.
DEFAULT_INIT_TIMEOUT = 600.0
#: Seconds a compute collective may wait for a peer (a dead peer is seen sooner: its socket
#: closes).
DEFAULT_COLLECTIVE_TIMEOUT = 300.0
#: Idle workers wait for the next step this long on the control group (one year).
_CONTROL_TIMEOUT = datetime.timedelta(days=365)
#: Seconds to wait for a worker to exit after the stop message, then after SIGTERM.
_STOP_GRACE = 5.0


@dataclass(frozen=True, slots=True)
class _Rendezvous:
    host: str
    port: int
    world_size: int
    collective_timeout: float


class TensorParallelExecutor(Executor):
    """Rank 0 of a tensor-parallel group plus the worker processes of the other ranks.

    Args:
        model_loader: picklable ``model_loader(parallel=TensorParallelGroup)`` returning a
            :class:`~pagedkv.model.loader.LoadedModel` holding that rank's shard (e.g.
            ``functools.partial(load_model, path, dtype=torch.bfloat16)``); every rank calls it.
        kv_cache_config: the engine's KV cache (the same ``num_blocks`` on every rank; each
            rank's tensors hold its share of the KV heads).
        config: the engine's resolved config: ``parallel_config.tensor_parallel_size`` ranks
            (>= 2), the scheduler config and seed of every rank's runner.
        attention_backend: the attention backend's name (every rank makes its own); None =
            torch.
        runtime_setup: picklable callable run first in each worker (threads, malloc).
        host: the rendezvous address (127.0.0.1: one host).
        init_timeout: seconds to wait for every rank to load and meet.
        collective_timeout: seconds a collective waits for a peer.

    Raises:
        WorkerError: a worker failed to load or start (its error in the message), or the ranks
            did not meet within ``init_timeout``. No process is left running then.
    """

    def __init__(
        self,
        model_loader: Callable[..., Any],
        kv_cache_config: KVCacheConfig,
        config: PagedKVConfig,
        *,
        attention_backend: str | None = None,
        runtime_setup: Callable[[], Any] | None = None,
        host: str = "127.0.0.1",
        init_timeout: float = DEFAULT_INIT_TIMEOUT,
        collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT,
    ) -> None:
        world_size = config.parallel_config.tensor_parallel_size
        if world_size < 2:
            raise ConfigError(
                f"tensor parallelism needs tensor_parallel_size >= 2, got {world_size}"
            )
        self.world_size = world_size
        self._failure: WorkerError | None = None
        runner_kwargs = {
            "scheduler_config": config.scheduler_config,
            "seed": config.model_config.seed,
            "attention_backend": attention_backend,
            "kv_cache_dtype": config.cache_config.cache_dtype,
        }
        # Port 0: the OS picks a free port; workers learn it from their arguments.
        self._store = torch.distributed.TCPStore(
            host,
            0,
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=init_timeout),
        )
        rendezvous = _Rendezvous(host, self._store.port, world_size, collective_timeout)
        context = multiprocessing.get_context("spawn")
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._control: list = []  # the control group once it exists (read by the finalizer)
        self._finalizer = weakref.finalize(
            self, _stop_workers, self._procs, self._conns, self._control
        )
        try:
            for rank in range(1, world_size):
                parent_end, child_end = context.Pipe()
                proc = context.Process(
                    target=_worker_main,
                    args=(
                        rank,
                        rendezvous,
                        model_loader,
                        kv_cache_config,
                        runner_kwargs,
                        runtime_setup,
                        child_end,
                        os.getpid(),
                    ),
                    name=f"pagedkv-tp-rank{rank}",
                    daemon=True,
                )
                proc.start()
                child_end.close()
                self._procs.append(proc)
                self._conns.append(parent_end)
            # Rank 0 loads its shard while the workers load theirs.
            parallel = TensorParallelGroup(0, world_size)
            self.loaded_model = model_loader(parallel=parallel)
            model = self.loaded_model.model
            max_model_len = config.scheduler_config.max_model_len
            if max_model_len > model.max_positions:
                model.extend_positions(max_model_len)
            # Only rank 0 samples, so only it proposes drafts (speculative decoding).
            self.runner = ModelRunner(
                model,
                kv_cache_config,
                speculative_config=config.speculative_config,
                **runner_kwargs,
            )
            self._wait_ready(time.monotonic() + init_timeout)
            parallel.group = _new_group("compute", self._store, 0, rendezvous, model)
            self._control.append(_new_group("control", self._store, 0, rendezvous, None))
        except BaseException:
            self._finalizer()
            raise

    # ------------------------------------------------------------------ executor interface

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Broadcast the step to every rank, run rank 0's part, return its sampled tokens.

        Raises:
            WorkerError: a rank died or failed, now or before (the engine cannot go on).
                Any other failure inside the step is turned into it too: the ranks may be out
                of step after it. An interrupt (KeyboardInterrupt) mid-step is raised as it is,
                and every later step raises WorkerError.
        """
        if self._failure is not None:
            raise self._failure
        try:
            _broadcast(self._control[0], ("step", out))
            return self.runner.execute_model(out)
        except Exception as exc:
            self._failure = self._describe_failure(exc)
            self.shutdown()
            raise self._failure from exc
        except BaseException:
            # Interrupted mid-step (Ctrl-C's KeyboardInterrupt between two collectives): the
            # other ranks wait in this step's collectives, so any later step would wait for
            # them forever. The engine cannot go on; the interrupt goes on up.
            self._failure = WorkerError(
                "tensor-parallel step interrupted on rank 0; the ranks are out of step, the "
                "engine stops"
            )
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop every worker (stop message, then SIGTERM, then SIGKILL); idempotent."""
        self._finalizer()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1 .. N-1."""
        return [p.pid for p in self._procs]

    # ------------------------------------------------------------------ helpers

    def _wait_ready(self, deadline: float) -> None:
        """Wait until every worker has loaded its shard; raise WorkerError when one fails."""
        pending = dict(zip(self._conns, range(1, self.world_size), strict=True))
        while pending:
            sentinels = {self._procs[r - 1].sentinel: r for r in pending.values()}
            left = deadline - time.monotonic()
            ready = multiprocessing.connection.wait([*pending, *sentinels], max(0.0, left))
            if not ready:
                raise WorkerError(
                    f"tensor-parallel ranks {sorted(pending.values())} did not load the model "
                    "in time (init_timeout)"
                )
            for item in ready:
                rank = pending.get(item) if item in pending else sentinels[item]
                message = _receive(self._conns[rank - 1])
                if message is not None and message[0] == "ready":
                    pending.pop(self._conns[rank - 1], None)
                    continue
                raise WorkerError(self._rank_message(rank, message, starting=True))

    def _describe_failure(self, exc: BaseException) -> WorkerError:
        """The WorkerError for a step that raised ``exc``: the first dead or failed rank,
        waiting briefly for a dying one to exit."""
        deadline = time.monotonic() + 2.0
        while True:
            for rank, proc in enumerate(self._procs, start=1):
                if not proc.is_alive():
                    return WorkerError(self._rank_message(rank, _receive(self._conns[rank - 1])))
            if time.monotonic() >= deadline:
                return WorkerError(
                    f"tensor-parallel step failed on rank 0 ({type(exc).__name__}: {exc}); the "
                    "ranks may be out of step, the engine stops"
                )
            time.sleep(0.05)

    def _rank_message(self, rank: int, message, starting: bool = False) -> str:
        proc = self._procs[rank - 1]
        proc.join(timeout=1.0)
        text = (
            f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
            if not proc.is_alive()
            else f"tensor-parallel rank {rank} (pid {proc.pid}) failed"
        )
        if message is not None and message[0] == "error":
            text += f":\n{message[1]}"
        elif starting:  # died before our code in it could say why
            return text + (
                " before loading its shard. Each rank is a fresh Python process "
                "(multiprocessing's spawn) that re-imports the main module: a script that "
                'creates a tensor-parallel engine must do it under `if __name__ == "__main__":` '
                "(the rank's own error is printed above)"
            )
        return text + "; the engine cannot run further steps"


# ---------------------------------------------------------------------- the wire


def _broadcast(group, message, timeout: datetime.timedelta | None = None) -> None:
    """Send ``message`` (pickled) from rank 0 to every rank of ``group``."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    size = torch.tensor([len(data)], dtype=torch.int64)
    group.broadcast(size, 0, timeout).wait()
    group.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, timeout).wait()


def _receive_broadcast(group):
    size = torch.empty(1, dtype=torch.int64)
    group.broadcast(size, 0).wait()
    data = torch.empty(int(size), dtype=torch.uint8)
    group.broadcast(data, 0).wait()
    return pickle.loads(data.numpy().tobytes())


def _new_group(name: str, store, rank: int, rendezvous: _Rendezvous, model):
    """A process group over the shared store: NCCL for the compute group of a CUDA model, gloo
    otherwise (the control group always: it carries CPU bytes)."""
    prefixed = torch.distributed.PrefixStore(name, store)
    if model is not None and torch.device(model.device).type == "cuda":
        return torch.distributed.ProcessGroupNCCL(prefixed, rank, rendezvous.world_size)
    options = torch.distributed.ProcessGroupGloo._Options()
    if name == "control":
        options._timeout = _CONTROL_TIMEOUT
    else:
        options._timeout = datetime.timedelta(seconds=rendezvous.collective_timeout)
    options._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname=rendezvous.host)]
    return torch.distributed.ProcessGroupGloo(prefixed, rank, rendezvous.world_size, options)


def _receive(conn) -> tuple | None:
    """A worker's last message if one is waiting, else None (never blocks)."""
    try:
        message = None
        while conn.poll(0):
            message = conn.recv()
        return message
    except (EOFError, OSError):
        return message


def _stop_workers(procs, conns, control) -> None:
    """Stop the workers: a stop message when they can hear it, SIGTERM, then SIGKILL."""
    if control and all(p.is_alive() for p in procs):
        with contextlib.suppress(Exception):  # a dead peer: terminated below
            _broadcast(control[0], ("stop",), datetime.timedelta(seconds=_STOP_GRACE))
    deadline = time.monotonic() + _STOP_GRACE
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=_STOP_GRACE)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
    control.clear()


# ---------------------------------------------------------------------- the worker process


def _exit_with_parent(parent_pid: int) -> None:
    """Exit this process as soon as its parent is gone (a killed engine leaves no orphan)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="pagedkv-tp-parent-watch", daemon=True).start()


def _worker_main(
    rank: int,
    rendezvous: _Rendezvous,
    model_loader,
    kv_cache_config: KVCacheConfig,
    runner_kwargs: dict,
    runtime_setup,
    conn,
    parent_pid: int,
) -> None:
    """Rank ``rank``: load the shard, meet the others, run every broadcast step until "stop"."""
    _exit_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    try:
        if runtime_setup is not None:
            runtime_setup()
        parallel = TensorParallelGroup(rank, rendezvous.world_size)
        model = model_loader(parallel=parallel).model
        max_model_len = runner_kwargs["scheduler_config"].max_model_len
        if max_model_len > model.max_positions:
            model.extend_positions(max_model_len)
        runner = ModelRunner(model, kv_cache_config, **runner_kwargs)
        conn.send(("ready", None))
        store = torch.distributed.TCPStore(
            rendezvous.host,
            rendezvous.port,
            rendezvous.world_size,
            is_master=False,
            timeout=datetime.timedelta(seconds=DEFAULT_INIT_TIMEOUT),
        )
        parallel.group = _new_group("compute", store, rank, rendezvous, model)
        control = _new_group("control", store, rank, rendezvous, None)
        with torch.inference_mode():
            while True:
                message = _receive_broadcast(control)
                if message[0] == "stop":
                    break
                runner.execute_model(message[1])
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
        os._exit(1)
    conn.close()
