"""Scoring that cannot stop the fit: verifiers run in worker processes with a wall-clock limit and rlimits.

A verifier screened for code (verifier_guard.py) can still take minutes on a short answer (sympy simplifying
`sin(exp(exp(exp(x))))`), or crash its interpreter. An RL policy finds such answers, so a verifier that reads them
runs in a ScoringPool: worker processes (forkserver: started clean, not forked from a trainer holding CUDA and
threads) that each score one answer at a time, so a step's answers are scored in parallel. A worker gets
`timeout_s` of wall clock per answer; past it, it is killed (SIGKILL) and replaced, and the answer scores 0. A
worker that dies (memory limit, a crash in native code) or a verifier that raises also scores 0. The fit goes on;
`ScoreReport.stats` counts what happened for the step's log (reward/score_timeouts, reward/score_errors,
time/score_s).

Each worker also runs under rlimits: address space `memory_bytes` beyond what it maps once loaded, CPU time
`timeout_s` + 2 s per answer (a worker the trainer no longer watches still ends), no core files, no file writes
(RLIMIT_FSIZE 0), no new processes or threads (RLIMIT_NPROC 0; not enforced for root), and few file descriptors.
These bound what an answer can cost; they are not a sandbox for code: keeping code from running at all is the
guard's job.

Workers start from a forkserver with reasoning-gym preloaded, and never re-run the trainer's main module (which
multiprocessing does in every spawned or forkserver child: under `trace-rl` that imported torch and lightning,
36 s and 1 GB of address space per worker on a loaded 2-core machine). So a script that scores needs no
`if __name__ == "__main__":` guard, and a verifier must be importable from a module other than `__main__`.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import pickle
import resource
import signal
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

SCORE_TIMEOUT_S = 3.0
"""Default wall clock per answer (ReasoningGymEnv's `score_timeout_s`, set through data.env_kwargs)."""

MEMORY_BYTES = 2 << 30
"""Default address space a scoring worker may add to what it maps once loaded (reasoning-gym and sympy: ~240 MB)."""

START_TIMEOUT_S = 120.0
"""How long a new worker may take to load the verifier before the pool gives up (a broken install, not an answer)."""

CPU_SLACK_S = 2
OPEN_FILES = 256

_CONTEXT = multiprocessing.get_context("forkserver")


def default_workers() -> int:
    """Scoring workers when none is given: up to 4, never more than the CPUs this process may use."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


@dataclass
class ScoreReport:
    """A batch's rewards (in order) and what went wrong while scoring them."""

    rewards: list[float]
    timeouts: int = 0
    """Answers whose verifier ran past the limit (worker killed, reward 0)."""
    errors: int = 0
    """Answers whose verifier raised, returned no finite number, or whose worker died (reward 0)."""
    seconds: float = 0.0

    def stats(self) -> dict[str, float]:
        """The step log's scoring entries."""
        return {"reward/score_timeouts": float(self.timeouts), "reward/score_errors": float(self.errors),
                "time/score_s": self.seconds}


def score_responses(env: Any, problems: Sequence[Any], responses: Sequence[str]) -> ScoreReport:
    """Score responses[i] against problems[i] with `env`: through its `score_batch` where it has one (a pool), else
    its `score` one by one, an exception counted as an error and scored 0."""
    if len(problems) != len(responses):
        raise ValueError(f"{len(problems)} problems for {len(responses)} responses")
    start = time.perf_counter()
    batch = getattr(env, "score_batch", None)
    if batch is not None:
        report = batch(list(problems), list(responses))
    else:
        report = ScoreReport(rewards=[])
        for problem, response in zip(problems, responses, strict=True):
            try:
                report.rewards.append(float(env.score(problem, response)))
            except Exception:
                report.rewards.append(0.0)
                report.errors += 1
    report.seconds = time.perf_counter() - start
    return report


class _Worker:
    """One scoring process, its end of the pipe, and the answer it is scoring."""

    def __init__(self, process: Any, conn: Connection, started: float) -> None:
        self.process, self.conn = process, conn
        self.ready = False
        self.job: int | None = None
        self.deadline = started + START_TIMEOUT_S

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """While a worker starts, `__main__` names no file or module, so multiprocessing does not re-run it there."""
    main = sys.modules["__main__"]
    saved = {key: vars(main)[key] for key in ("__file__", "__spec__") if key in vars(main)}
    vars(main).pop("__file__", None)
    vars(main)["__spec__"] = None
    try:
        yield
    finally:
        vars(main).pop("__spec__", None)
        vars(main).update(saved)


def _stop_all(workers: list[_Worker]) -> None:
    while workers:
        workers.pop().stop()


class ScoringPool:
    """Worker processes that score answers with one verifier, `timeout_s` each, killed and replaced when late.

    verifier: pickled by the caller (an object with `score_answer(answer, entry) -> float`); prepare: a module-level
    function each worker calls before loading it (verifier_guard.guard_list_verifiers); preload: modules the
    forkserver imports once, so a replacement worker starts in milliseconds. Workers start on first use, up to
    `workers`, and stop with the pool (close, or when it is collected)."""

    def __init__(
        self,
        verifier: bytes,
        workers: int | None = None,
        timeout_s: float = SCORE_TIMEOUT_S,
        memory_bytes: int = MEMORY_BYTES,
        prepare: Callable[[], None] | None = None,
        preload: Sequence[str] = (),
    ) -> None:
        workers = default_workers() if workers is None else workers
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"score_workers must be an integer >= 1, got {workers!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
            raise ValueError(f"score_timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
        if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes < 256 << 20:
            raise ValueError(f"memory_bytes must be an integer of at least 256 MiB, got {memory_bytes!r}")
        self.verifier, self.workers, self.timeout_s = verifier, workers, float(timeout_s)
        self.memory_bytes, self.prepare = memory_bytes, prepare
        if preload:
            _CONTEXT.set_forkserver_preload(["trace_lightning.envs.scoring", *preload])
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def close(self) -> None:
        """Stop every worker (a later `score` starts new ones)."""
        _stop_all(self._workers)

    def score(self, jobs: Sequence[tuple[str, dict[str, Any]]]) -> ScoreReport:
        """The verifier's score for each (answer, entry), in order; 0 for one that ran late, raised or crashed.
        RuntimeError only when a worker cannot even load the verifier (START_TIMEOUT_S)."""
        start = time.perf_counter()
        report = ScoreReport(rewards=[0.0] * len(jobs))
        pending = deque(range(len(jobs)))
        while pending or any(w.job is not None for w in self._workers):
            busy = sum(w.job is not None for w in self._workers)
            while len(self._workers) < min(self.workers, busy + len(pending)):
                self._workers.append(self._spawn())
            for worker in self._workers:
                if worker.ready and worker.job is None and pending:
                    self._send(worker, pending.popleft(), jobs, report)
            watched = [w for w in self._workers if w.job is not None or not w.ready]
            if not watched:
                continue
            timeout = max(0.0, min(w.deadline for w in watched) - time.monotonic())
            for conn in wait([w.conn for w in watched], timeout):
                worker = next(w for w in watched if w.conn is conn)
                self._receive(worker, report)
            now = time.monotonic()
            for worker in [w for w in self._workers if w.deadline <= now and (w.job is not None or not w.ready)]:
                if not worker.ready:
                    self._drop(worker)
                    raise RuntimeError(f"a scoring worker did not load its verifier in {START_TIMEOUT_S:.0f} s")
                report.timeouts += 1  # its reward stays 0
                self._drop(worker)
        report.seconds = time.perf_counter() - start
        return report

    def _spawn(self) -> _Worker:
        parent, child = _CONTEXT.Pipe()
        process = _CONTEXT.Process(target=_serve, args=(child, self.verifier, self.prepare, self.memory_bytes,
                                                        self.timeout_s), daemon=True, name="trace-lightning-scoring")
        with _main_module_hidden():
            process.start()
        child.close()
        return _Worker(process, parent, time.monotonic())

    def _send(self, worker: _Worker, index: int, jobs: Sequence[tuple[str, dict[str, Any]]],
              report: ScoreReport) -> None:
        worker.job, worker.deadline = index, time.monotonic() + self.timeout_s
        try:
            worker.conn.send(jobs[index])
        except (OSError, ValueError, pickle.PicklingError):
            report.errors += 1
            self._drop(worker)

    def _receive(self, worker: _Worker, report: ScoreReport) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError, pickle.UnpicklingError):
            message = None
        if not worker.ready:
            if message != ("ready",):
                self._drop(worker)
                raise RuntimeError(f"a scoring worker failed while loading its verifier: {message!r}")
            worker.ready = True
            return
        if message is None:  # died mid-answer: memory limit, a native crash, SIGXCPU
            report.errors += 1
            self._drop(worker)
            return
        status, value = message
        assert worker.job is not None
        if status == "ok":
            report.rewards[worker.job] = value
        else:
            report.errors += 1
        worker.job = None

    def _drop(self, worker: _Worker) -> None:
        worker.stop()
        self._workers.remove(worker)


def _serve(conn: Connection, verifier: bytes, prepare: Callable[[], None] | None, memory_bytes: int,
           timeout_s: float) -> None:
    """A worker: load the verifier, limit itself, then score (answer, entry) pairs until the pipe closes."""
    try:
        if prepare is not None:
            prepare()
        scorer = pickle.loads(verifier)
        _limit(memory_bytes)
    except Exception as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready",))
    cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    while True:
        try:
            answer, entry = conn.recv()
        except (EOFError, OSError):
            return
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = int(usage.ru_utime + usage.ru_stime + timeout_s) + CPU_SLACK_S
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu_hard))
        try:
            value = float(scorer.score_answer(answer, entry))
            message: tuple[str, Any] = ("ok", value) if math.isfinite(value) else ("error", f"score {value}")
        except BaseException as e:  # noqa: BLE001 - whatever the verifier does with an answer is that answer's 0
            message = ("error", type(e).__name__)
        conn.send(message)


def _limit(memory_bytes: int) -> None:
    """The worker's rlimits (the module docstring's list). Writes fail with EFBIG instead of killing the worker."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    for limit, value in ((resource.RLIMIT_AS, _address_space() + memory_bytes), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_FSIZE, 0),
                         (resource.RLIMIT_NPROC, 0), (resource.RLIMIT_NOFILE, OPEN_FILES)):
        hard = resource.getrlimit(limit)[1]
        soft = value if hard == resource.RLIM_INFINITY else min(value, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(limit, (soft, soft))


def _address_space() -> int:
    """Bytes of address space this process maps now (VmSize): what it loaded, which the limit comes on top of (a
    BLAS started with many threads maps gigabytes it never touches)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0
