"""Quality measured on the host's CPU, in a process of its own, while the trial's probes run on the GPU.

A capacity trial on a GPU worker is ``configure → probe... → finish → quality``. The probes keep one host
thread launching work and the GPU busy; the quality call (a small model in float32 over the quality text,
:func:`kvtune.engine.quality.measure_quality`) needs neither. So where the worker runs on a GPU, the quality
of a trial's config is measured from ``configure`` on by a child process on the CPU, with the kernels'
PyTorch references (the GPU kernels are held to them by the tests), and the quality call only waits for
its answer: the trial's wall loses the quality call, and no Triton kernel is compiled for the quality
model's shapes. The child sees no GPU (``CUDA_VISIBLE_DEVICES`` empty), uses at most
:func:`quality_threads` cores and runs at a lower priority (``nice`` 10), leaving the worker's launching
thread its own core and the first claim on the others.

One child per worker, started at the first request and kept (it loads the quality model once). Requests
are answered in order; a request the worker no longer wants (its trial was pruned before the quality
call) is cancelled at the child's next decode step. The frames are pickles, each after its length, on two
pipes of their own (the child's stdout and stderr stay the worker's log).

Parent → child: ``("measure", key, config_dict)``, ``("cancel", key)``. Child → parent: ``("ready",
load_s)`` once, then per request ``("result", key, result_dict, measure_s)``, ``("error", key, line)`` or
``("cancelled", key)``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, BinaryIO

from kvtune.engine.options import usable_cores

_HEADER = struct.Struct("<Q")
MAX_THREADS = 8
NICE = 10  # the child's scheduling priority, below the worker's


def quality_threads(cpus: int | None = None) -> int:
    """The child's PyTorch threads: half the cores this process may use less one, at most 8, at least 1."""
    cpus = usable_cores() if cpus is None else cpus
    return max(1, min(MAX_THREADS, (cpus - 2) // 2))


def config_key(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True)


def _send(stream: BinaryIO, message: tuple[Any, ...]) -> None:
    data = pickle.dumps(message)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_exact(stream: BinaryIO, size: int) -> bytes | None:
    """``size`` bytes from an unbuffered stream (a pipe may give fewer per read), None at its end."""
    parts, left = [], size
    while left:
        part = stream.read(left)
        if not part:
            return None
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _receive(stream: BinaryIO) -> tuple[Any, ...] | None:
    """The next frame, or None at the end of the stream. Unbuffered, so that ``select`` on the stream
    sees every frame not yet read."""
    header = _read_exact(stream, _HEADER.size)
    if header is None:
        return None
    data = _read_exact(stream, _HEADER.unpack(header)[0])
    if data is None:
        return None
    message = pickle.loads(data)
    assert isinstance(message, tuple)
    return message


class QualityHost:
    """The parent's side: :meth:`submit` a config when its trial starts, :meth:`result` at the quality call.

    ``settings``: the study's :class:`~kvtune.tuner.protocol.QualitySettings`; ``threads``: the child's
    PyTorch threads (:func:`quality_threads`).
    """

    def __init__(self, settings: Any, threads: int | None = None) -> None:
        self.settings = settings
        self.threads = quality_threads() if threads is None else threads
        self._proc: subprocess.Popen[bytes] | None = None
        self._to_child: BinaryIO | None = None
        self._futures: dict[str, Future[tuple[dict[str, Any], float]]] = {}
        self._wanted: set[str] = set()  # keys a quality call waits for (never cancelled)
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self.load_s: float | None = None
        self._load_reported = False
        self._ended: str | None = None

    # ---- the worker's calls --------------------------------------------------------------------------
    def submit(self, config: dict[str, Any]) -> None:
        """Start measuring ``config`` (once), cancelling the requests no quality call waits for."""
        key = config_key(config)
        self._start()
        messages: list[tuple[Any, ...]] = []
        with self._lock:  # the reader thread takes it too: no write to the child while it is held
            for other in [k for k in self._futures if k != key and k not in self._wanted]:
                if not self._futures.pop(other).done():
                    messages.append(("cancel", other))
            if key not in self._futures:
                self._futures[key] = Future()
                messages.append(("measure", key, dict(config)))
        for message in messages:
            self._write(message)

    def result(self, config: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """The quality of ``config`` (submitted now if it was not) with ``load_s`` (the child's load of the
        quality model, counted in the first result only) and ``measure_s`` (the child's time on it)."""
        key = config_key(config)
        with self._lock:
            self._wanted.add(key)
        try:
            self.submit(config)
            result, measure_s = self._futures[key].result(timeout=timeout)
        finally:
            with self._lock:
                self._wanted.discard(key)
                self._futures.pop(key, None)
        load_s = 0.0
        if not self._load_reported and self.load_s is not None:
            load_s, self._load_reported = self.load_s, True
        return dict(result) | {"measure_s": measure_s, "load_s": load_s}

    def close(self) -> None:
        """End the child (it exits at the end of its input) and wait for it."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if self._to_child is not None:
            with contextlib.suppress(OSError):
                self._to_child.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # the interpreter may be shutting down
            self.close()

    # ---- the child process ---------------------------------------------------------------------------
    def _start(self) -> None:
        if self._ended is not None:
            raise RuntimeError(self._ended)
        if self._proc is not None:
            return
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(self.threads)}
        settings = dict(self.settings.__dict__)
        command = [sys.executable, "-m", "kvtune.tuner.quality_host", str(to_child_r), str(from_child_w)]
        self._proc = subprocess.Popen(command, env=env, pass_fds=(to_child_r, from_child_w), close_fds=True)
        os.close(to_child_r)
        os.close(from_child_w)
        self._to_child = os.fdopen(to_child_w, "wb")
        self._write(("init", settings, self.threads))
        from_child = os.fdopen(from_child_r, "rb", buffering=0)
        self._reader = threading.Thread(target=self._read, args=(from_child,), daemon=True)
        self._reader.start()

    def _write(self, message: tuple[Any, ...]) -> None:
        assert self._to_child is not None
        try:
            _send(self._to_child, message)
        except (BrokenPipeError, OSError) as e:
            raise RuntimeError(f"the quality process ended: {e}") from None

    def _read(self, stream: BinaryIO) -> None:
        while (message := _receive(stream)) is not None:
            kind = message[0]
            if kind == "ready":
                self.load_s = float(message[1])
                continue
            if kind == "fatal":
                self._ended = str(message[1])
                break
            with self._lock:
                future = self._futures.get(message[1])
            if future is None or future.done():
                continue  # cancelled meanwhile, or not waited for
            if kind == "result":
                future.set_result((message[2], float(message[3])))
            elif kind == "error":
                future.set_exception(RuntimeError(message[2]))
            elif kind == "cancelled":
                future.set_exception(RuntimeError(f"quality of {message[1]} was cancelled"))
        if self._ended is None:
            proc = self._proc
            code = None
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = proc.wait(timeout=5)
            self._ended = f"the quality process ended (exit code {code}); see the worker's log"
        with self._lock:
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(RuntimeError(self._ended))


# ------------------------------------------------------------------------------------------------ the child
class _Cancelled(Exception):
    pass


def _child(in_fd: int, out_fd: int) -> None:
    """Load the quality model on the CPU, then answer ``measure`` requests until the input ends."""
    import torch

    from kvtune.cache_impl.config import HybridConfig
    from kvtune.engine.model import load_model
    from kvtune.engine.quality import measure_quality

    inp, out = os.fdopen(in_fd, "rb", buffering=0), os.fdopen(out_fd, "wb")
    first = _receive(inp)
    if first is None:
        return
    _, settings, threads = first
    torch.set_num_threads(int(threads))
    with contextlib.suppress(OSError):  # the worker's launching thread goes first where cores are short
        os.nice(NICE)
    started = time.perf_counter()
    try:
        loaded = load_model(settings["model"], torch.device("cpu"), getattr(torch, settings["dtype"]))
        with open(settings["text_path"], encoding="utf-8") as f:
            text = f.read()
    except Exception as e:  # every quality call of the worker fails with this line
        _send(out, ("fatal", f"the quality process could not start: {_line(e)}"))
        return
    _send(out, ("ready", time.perf_counter() - started))
    queue: deque[tuple[Any, ...]] = deque()
    cancelled: set[str] = set()

    def take(message: tuple[Any, ...]) -> None:
        if message[0] == "cancel":
            cancelled.add(message[1])
        else:
            queue.append(message)

    def poll(key: str) -> None:
        """Between decode steps: read what arrived; stop where this request was cancelled."""
        while select.select([inp], [], [], 0)[0]:
            message = _receive(inp)
            if message is None:
                raise _Cancelled
            take(message)
        if key in cancelled:
            raise _Cancelled

    while True:
        if not queue:
            message = _receive(inp)
            if message is None:
                return
            take(message)
            continue
        _, key, config = queue.popleft()
        if key in cancelled:
            cancelled.discard(key)
            _send(out, ("cancelled", key))
            continue
        t0 = time.perf_counter()
        stop = functools.partial(_polled, poll, key)
        try:
            result = measure_quality(
                loaded,
                HybridConfig.from_dict(config),
                text,
                windows=settings["windows"],
                prefill_tokens=settings["prefill_tokens"],
                decode_tokens=settings["decode_tokens"],
                step_ms=settings["step_ms"],
                passkey=settings["passkey"],
                aggregation=settings["aggregation"],
                progress=stop,
            )
        except _Cancelled:
            cancelled.discard(key)
            _send(out, ("cancelled", key))
            continue
        except Exception as e:  # the worker turns it into the trial's one-line error
            _send(out, ("error", key, _line(e)))
            continue
        _send(out, ("result", key, result.to_dict(), time.perf_counter() - t0))


def _polled(poll: Any, key: str, done: int, total: int) -> None:
    """The progress callback: looks for a cancel of ``key`` (done and total unused)."""
    poll(key)


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


if __name__ == "__main__":
    _child(int(sys.argv[1]), int(sys.argv[2]))
