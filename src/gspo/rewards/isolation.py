"""Reward fault isolation: a reward call that fails costs one sample, never the run, unless asked.

A reward source fails on a sample when it raises, hangs past ``rewards.timeout_s``, or returns
None, a non-number, NaN or Inf. ``IsolatedReward`` scores each sample separately for sources that
allow it (verifiers and functions; a reward model scores the batch, and fails as a batch),
collects the failures and applies ``rewards.on_error``:

* ``fail`` (default): ``RewardError`` naming the source, the sample, its prompt and completion;
* ``zero``: the failed source scores 0 for that sample;
* ``drop``: the sample's total reward is NaN. ``gspo.core.advantages.group_advantages`` gives it
  advantage 0 and normalises the rest of its group among themselves (a group left with fewer than
  2 samples has no signal), and the training step takes it out of the loss mask, so it leaves the
  loss exactly as a response dropped by ``train.mask_truncated`` does; the loss normalisers count
  only the remaining responses.

Either way the number of failed samples is logged per step as ``reward/errors``.

Timeouts run the call in a worker thread; a call still running after the timeout is abandoned
(Python cannot kill a thread) and a fresh worker takes the next call. At most ``rewards.max_hung``
such threads are tolerated per run. Code that can hang or that executes model output belongs in
``rewards.sandbox`` (``gspo.rewards.sandbox``: a killable, limited process). This module does not decide
what a reward means, and never retries.
"""

from __future__ import annotations

import math
import queue
import sys
import threading
from dataclasses import dataclass, field

import torch

from gspo.errors import RewardError, RewardFault
from gspo.rewards.sandbox import Limits
from gspo.rewards.sources import CombinedReward, RewardResult, build_rewards, score
from gspo.tasks.base import reward_value

MAX_LOGGED = 5  # failure messages printed per reward source and run (all are counted)
SANDBOX_GRACE_S = 5.0  # in-process timeout beyond the sandbox's own wall limit, so it acts first


def sandbox_limits(policy) -> Limits | None:
    """The sandbox's limits from the ``rewards`` config section (None: no sandbox)."""
    if not policy.sandbox:
        return None
    return Limits(wall_s=policy.timeout_s, cpu_s=policy.sandbox_cpu_s,
                  memory_mb=policy.sandbox_memory_mb)


def isolation_options(policy) -> dict:
    """IsolatedTask / IsolatedReward keywords from the ``rewards`` config section."""
    timeout = policy.timeout_s + (SANDBOX_GRACE_S if policy.sandbox else 0.0)
    return {"on_error": policy.on_error, "timeout_s": timeout, "max_hung": policy.max_hung}


def isolated_rewards(policy, task) -> "IsolatedReward":
    """The run's reward: the sources of ``policy.sources`` (the ``rewards`` config section),
    function sources in the sandbox when ``policy.sandbox``, each sample isolated."""
    specs = [s.model_dump() for s in policy.sources]
    return IsolatedReward(build_rewards(specs, task, sandbox_limits(policy)), **isolation_options(policy))


@dataclass
class _Job:
    fn: object
    args: tuple
    kwargs: dict
    done: threading.Event = field(default_factory=threading.Event)
    value: object = None
    error: BaseException | None = None


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        try:
            job.value = job.fn(*job.args, **job.kwargs)
        except BaseException as err:  # noqa: BLE001  handed to the caller
            job.error = err
        job.done.set()


class TimedCaller:
    """``caller(fn, *args)``: the result, or ``RewardFault`` when it has not returned in ``timeout_s``."""

    def __init__(self, timeout_s: float | None, max_hung: int = 8):
        self.timeout_s, self.max_hung, self.hung = timeout_s, max_hung, 0
        self._jobs: queue.SimpleQueue | None = None

    def __getstate__(self) -> dict:
        """Pickled without its worker thread (the copy starts its own on first use): an
        asynchronous rollout worker process gets the task's caller this way."""
        return {**self.__dict__, "_jobs": None}

    def __call__(self, fn, *args, **kwargs):
        if not self.timeout_s:
            return fn(*args, **kwargs)
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._jobs,), daemon=True,
                             name="gspo-reward").start()
        job = _Job(fn, args, kwargs)
        self._jobs.put(job)
        if not job.done.wait(self.timeout_s):
            raise self._hung()  # the next call gets a new worker
        if job.error is not None:
            raise job.error
        return job.value

    def map(self, fn, calls: list[tuple]) -> list[tuple[object, BaseException | None]]:
        """``fn(*args)`` for each args of ``calls``, as (value, error) pairs: what ``self(fn, *args)``
        would return or raise, one after the other, but handed to the worker all at once (one
        thread hand-off per batch, not per call). Each call still gets ``timeout_s``, counted from
        the return of the one before; after a hung call the rest go to a fresh worker. Raises
        ``RewardError`` as ``self(...)`` does after too many hung calls."""
        if not self.timeout_s:
            return [_run(fn, args) for args in calls]
        results: list[tuple[object, BaseException | None]] = []
        while len(results) < len(calls):
            if self._jobs is None:
                self._jobs = queue.SimpleQueue()
                threading.Thread(target=_serve, args=(self._jobs,), daemon=True,
                                 name="gspo-reward").start()
            jobs = [_Job(fn, args, {}) for args in calls[len(results):]]
            for job in jobs:
                self._jobs.put(job)
            for job in jobs:
                if not job.done.wait(self.timeout_s):
                    results.append((None, self._hung()))   # the jobs after it: a fresh worker
                    break
                results.append((job.value, job.error))
        return results

    def _hung(self) -> RewardFault:
        """Abandon the stuck worker (a daemon thread); the fault of the call, or RewardError."""
        self._jobs = None
        self.hung += 1
        if self.hung > self.max_hung:
            raise RewardError(
                f"reward calls hung {self.hung} times (rewards.timeout_s={self.timeout_s:g}); each "
                f"leaves a thread running, so the run stops here. Fix the reward function or set "
                f"rewards.sandbox=true to run it in a process that can be killed")
        return RewardFault(f"timed out after {self.timeout_s:g} s")


def _run(fn, args: tuple) -> tuple[object, BaseException | None]:
    """(fn(*args), None), or (None, the exception it raised)."""
    try:
        return fn(*args), None
    except BaseException as err:  # noqa: BLE001  handed to the caller, as from the worker
        return None, err


def check_value(value) -> float:
    """``gspo.tasks.base.reward_value``, its error as a RewardFault (the guard's own fault)."""
    try:
        return reward_value(value)
    except (TypeError, ValueError) as err:
        raise RewardFault(str(err)) from None


def describe(err: BaseException) -> str:
    """One line about a failed call: our own faults as they are, user exceptions with their type."""
    if isinstance(err, RewardFault):
        return str(err)
    return f"{type(err).__name__}: {err}".splitlines()[0][:300]


class IsolatedSource:
    """One reward source scored sample by sample (or as a batch), failures as (index, reason)."""

    def __init__(self, source, caller: TimedCaller):
        self.source, self.name, self.caller = source, source.name, caller
        self.label = getattr(source, "label", repr(source.name))  # in messages: as the config says
        self.per_sample = getattr(source, "per_sample", False)
        self.reads_records = getattr(source, "reads_records", False)
        self.needs_episode = getattr(source, "needs_episode", False)

    def __call__(self, completions: list[str], examples: list, records: list | None = None
                 ) -> tuple[list[float], dict[int, str]]:
        n, faults = len(completions), {}
        values = [math.nan] * n
        if not self.per_sample:
            try:
                out = list(score(self.source, completions, examples, records))
                if len(out) != n:
                    raise RewardFault(f"returned {len(out)} values for {n} completions")
            except (Exception, SystemExit) as err:  # noqa: BLE001
                return values, {i: describe(err) for i in range(n)}
            for i, v in enumerate(out):
                try:
                    values[i] = check_value(v)
                except RewardFault as err:
                    faults[i] = str(err)
            return values, faults
        calls = [([c], [ex]) for c, ex in zip(completions, examples)]
        if self.reads_records:      # each row's episode record beside it (None: single turn)
            calls = [(*call, None if records is None else [records[i]]) for i, call in enumerate(calls)]
        for i, (value, error) in enumerate(self.caller.map(self.source, calls)):  # one hand-off
            try:
                if error is not None:
                    raise error
                values[i] = check_value(value[0])
            except RewardError:
                raise
            except (Exception, SystemExit) as err:  # noqa: BLE001  isolated to this sample
                faults[i] = describe(err)
        return values, faults


class IsolatedReward:
    """``CombinedReward`` with per-sample fault isolation and the ``on_error`` policy."""

    def __init__(self, combined: CombinedReward, *, on_error: str = "fail", timeout_s: float | None = 30.0,
                 max_hung: int = 8, log=None):
        if on_error not in ("fail", "zero", "drop"):
            raise ValueError(f"rewards.on_error must be fail, zero or drop; got {on_error!r}")
        self.caller = TimedCaller(timeout_s, max_hung)
        self.sources = [(IsolatedSource(s, self.caller), w) for s, w in combined.sources]
        self.on_error = on_error
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.logged: dict[str, int] = {}

    @property
    def weights(self) -> dict[str, float]:
        return {s.name: w for s, w in self.sources}

    def __call__(self, completions: list[str], examples: list, records: list | None = None):
        n = len(completions)
        if len(examples) != n:
            raise ValueError(f"got {n} completions but {len(examples)} examples")
        total = torch.zeros(n, dtype=torch.float32)                        # [N]
        failed = torch.zeros(n, dtype=torch.bool)                          # [N]
        per_source = {}
        for source, weight in self.sources:
            values, faults = source(completions, examples, records)
            for i, reason in faults.items():
                self._report(source, i, completions[i], examples[i], reason)
            r = torch.tensor(values, dtype=torch.float32)                  # [N], NaN where failed
            if faults:
                failed[list(faults)] = True
                if self.on_error == "zero":
                    r = torch.nan_to_num(r, nan=0.0)
            per_source[source.name] = r
            total += weight * torch.nan_to_num(r, nan=0.0)
        if self.on_error == "drop":
            total[failed] = math.nan
        return RewardResult(total=total, per_source=per_source, errors=failed)

    def _report(self, source: IsolatedSource, i: int, completion: str, example, reason: str) -> None:
        name = source.name
        what = (f"reward {source.label} failed on sample {i} (prompt {example.prompt[:60]!r}, "
                f"completion {completion[:60]!r}): {reason}")
        if self.on_error == "fail":
            raise RewardError(f"{what}. rewards.on_error=fail: fix the reward, or set "
                              f"rewards.on_error=zero or drop to continue past such samples")
        self.logged[name] = self.logged.get(name, 0) + 1
        if self.logged[name] <= MAX_LOGGED:
            last = " (further failures of this source are only counted, in reward/errors)" \
                if self.logged[name] == MAX_LOGGED else ""
            self.log(f"warning: {what}; rewards.on_error={self.on_error}{last}")


class IsolatedTask:
    """A task whose ``reward`` / ``is_correct`` (user code for a custom task) cannot stall or crash
    evaluation: a failure scores 0 / incorrect, or raises RewardError under ``on_error=fail``."""

    def __init__(self, task, *, on_error: str = "fail", timeout_s: float | None = 30.0,
                 max_hung: int = 8):
        self.inner, self.on_error = task, on_error
        self.caller = TimedCaller(timeout_s, max_hung)

    def __getattr__(self, name):  # everything else is the task's own (name, split, data...)
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _guarded(self, what: str, fn, completion: str, example, failed):
        try:
            value, error = self.caller(fn, completion, example), None
        except RewardError:
            raise
        except (Exception, SystemExit) as err:  # noqa: BLE001
            value, error = None, err
        return self._outcome(what, value, error, completion, example, failed)

    def _outcome(self, what: str, value, error: BaseException | None, completion: str, example, failed):
        """``value``, or after ``error``: ``failed``, or RewardError under on_error=fail."""
        if error is None:
            return value
        if isinstance(error, RewardError) or not isinstance(error, (Exception, SystemExit)):
            raise error
        if self.on_error == "fail":
            spec = getattr(self.inner, "reward_spec", None)    # a custom task: the user's function
            who = f"task.reward {spec!r} ({what})" if spec else f"task {self.inner.name!r} {what}"
            raise RewardError(f"{who} failed (prompt "
                              f"{example.prompt[:60]!r}, completion {completion[:60]!r}): "
                              f"{describe(error)}. rewards.on_error=fail") from None
        return failed

    def reward(self, completion: str, example) -> float:
        checked = lambda c, ex: check_value(self.inner.reward(c, ex))  # noqa: E731
        return self._guarded("reward", checked, completion, example, 0.0)

    def is_correct(self, completion: str, example) -> bool:
        return bool(self._guarded("is_correct", self.inner.is_correct, completion, example, False))

    def is_correct_all(self, completions: list[str], examples: list) -> list[bool]:
        """``[self.is_correct(c, ex) ...]`` with one thread hand-off for the batch (``TimedCaller.map``)."""
        results = self.caller.map(self.inner.is_correct, list(zip(completions, examples)))
        return [bool(self._outcome("is_correct", value, error, c, ex, False))
                for (value, error), c, ex in zip(results, completions, examples)]


def correct_all(task, completions: list[str], examples: list) -> list[bool]:
    """``task.is_correct`` of each sample; a ``IsolatedTask`` hands the batch to its worker at once."""
    if isinstance(task, IsolatedTask):
        return task.is_correct_all(completions, examples)
    return [bool(task.is_correct(c, ex)) for c, ex in zip(completions, examples)]
