"""A user reward function in a separate process, with CPU-time, memory, file-size and wall-clock
limits and no network: for reward code that executes model-written text.

None of the built-in rewards executes model output: ``countdown`` parses completions with ``ast``
against a whitelist and evaluates them exactly with ``Fraction``; the others compare strings. A
user function that runs generated code (``exec``, ``subprocess``, a Python interpreter...) should
be configured with ``rewards.sandbox: true``; it then runs here.

``SandboxedFunction("module:function", limits)`` is called like the function,
``fn(completion, **row)``, and returns a number; with ``kind="tool"`` (a multi-turn tool) it is
called ``fn(**arguments)`` and returns what the tool returned (str, int, float or bool). One worker process (``python -m gspo.rewards.sandbox``) imports the function
once and serves calls over JSON lines on stdin/stdout: nothing is pickled either way. Per call:

* wall clock: the parent waits ``wall_s``, then kills the worker and everything it started and
  starts a fresh worker for the next call (the call fails with ``RewardFault``);
* CPU time: the worker sets its soft ``RLIMIT_CPU`` to what it has used plus ``cpu_s`` before
  each call; going past it kills the worker (SIGXCPU);
* memory: ``RLIMIT_AS`` of ``memory_mb`` for the whole worker (a ``MemoryError`` in the user's
  code fails that call only); written files are capped at ``file_mb``, core dumps off;
* network: a new network namespace (``unshare``) when the kernel allows it, and in every case
  the ``socket`` module's constructors raise ``PermissionError``. ``isolation`` says which.

The sandbox owns every process it starts. The worker is a child subreaper
(``PR_SET_CHILD_SUBREAPER``), so a process the user's code starts stays its descendant even when
it daemonises (double fork, ``setsid``), and

* after each call the worker kills all its descendants (a reward that shells out to a compiler
  or a test runner leaves nothing behind; nothing the function starts outlives its call);
* the parent kills the worker's whole tree (frozen with SIGSTOP first, so nothing forks while it is
  killed) on a timeout, when the worker is replaced, on ``close()`` and at interpreter exit;
* a watchdog thread in the worker notices when its parent is gone (the trainer SIGKILLed, or
  ended by a signal without clean-up) and then kills its descendants and exits.

Descendants are found by their parent pid in ``/proc`` (Linux). Not a jail: the worker sees the file system with the user's permissions and inherits only
PATH, HOME, LANG and PYTHONPATH from the environment. The worker's stdout and stderr (the user
function's prints) are discarded.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import json
import math
import numbers
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict, dataclass

from gspo.errors import RewardFault
from gspo.tasks.record import keywords_for

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
STARTUP_S = 60.0  # importing the user's module may take a while
KEEP_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")
KINDS = ("reward", "tool")  # fn(completion, **row) -> number | fn(**arguments) -> str/int/float/bool
PR_SET_CHILD_SUBREAPER = 36
WATCHDOG_S = 0.2  # how often the worker checks that its parent is alive
LIVE: weakref.WeakSet = weakref.WeakSet()  # the open sandboxes, closed at interpreter exit


@dataclass
class Limits:
    """Per-call limits of the sandbox worker."""

    wall_s: float = 10.0
    cpu_s: float = 10.0
    memory_mb: int = 1024
    file_mb: int = 16
    key: str = "rewards.sandbox"
    """The config prefix the limits come from, for messages (``rewards.sandbox_memory_mb``)."""


class SandboxedFunction:
    """``fn(completion, **row) -> value`` run in a limited worker process; faults raise ``RewardFault``."""

    def __init__(self, spec: str, limits: Limits | None = None, kind: str = "reward"):
        if kind not in KINDS:
            raise ValueError(f"sandbox kind must be one of {', '.join(KINDS)}, got {kind!r}")
        self.spec, self.limits, self.kind = spec, limits or Limits(), kind
        self.__qualname__ = spec  # FunctionReward names its source after this
        self.isolation: str | None = None
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        LIVE.add(self)
        try:
            self._start()
        except RewardFault as err:  # at build time this is a configuration problem
            raise ValueError(f"reward sandbox: {err}") from None

    # -------------------------------------------------------------------------------- parent
    @property
    def pid(self) -> int | None:
        """The worker's process id (None between a fault and the next call)."""
        return None if self._proc is None else self._proc.pid

    def __call__(self, *completion: str, **row):
        if len(completion) != (self.kind == "reward"):
            raise TypeError(f"a sandboxed {self.kind} takes {'one positional argument' if self.kind == 'reward' else 'keyword arguments only'}")
        return self.request({"completion": completion[0] if completion else None, "row": row})

    def score(self, completion: str, row: dict, record: dict):
        """A reward on one row, with the episode record's fields the function names as
        parameters (the worker picks them: ``gspo.tasks.record.keywords_for``)."""
        return self.request({"completion": completion, "row": row, "record": record})

    def request(self, call: dict):
        """One call in the worker: its value, or ``RewardFault``."""
        if self._proc is None:
            self._start()
        request = json.dumps(call, default=repr) + "\n"
        try:
            self._proc.stdin.write(request.encode())
            self._proc.stdin.flush()
            reply = self._readline(time.monotonic() + self.limits.wall_s)
        except TimeoutError:
            self.close()
            raise RewardFault(f"timed out after {self.limits.wall_s:g} s (sandbox worker killed)") from None
        except (EOFError, BrokenPipeError, OSError):
            raise RewardFault(f"sandbox worker died: {self._death()}") from None
        if "error" in reply:
            raise RewardFault(reply["error"])
        if "type" in reply:
            expected = "a number" if self.kind == "reward" else "str, int, float or bool"
            raise RewardFault(f"returned {reply['type']} {reply['repr']}, expected {expected}")
        return reply.get("value")  # None (the function returned None), a float (maybe NaN); a tool's value

    def _start(self) -> None:
        env = {k: os.environ[k] for k in KEEP_ENV if k in os.environ}
        paths = [os.getcwd()] + [p for p in sys.path if p and os.path.isdir(p)]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        config = json.dumps({"spec": self.spec, "kind": self.kind, **asdict(self.limits)})
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "gspo.rewards.sandbox", config], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
        self._buf = b""
        try:
            ready = self._readline(time.monotonic() + STARTUP_S)
        except (TimeoutError, EOFError, OSError):
            raise RewardFault(f"sandbox worker for {self.spec!r} did not start: {self._death()}") from None
        if not ready.get("ready"):
            self.close()
            raise RewardFault(ready.get("error", "worker refused to start"))
        self.isolation = ready["network"]

    def _readline(self, deadline: float) -> dict:
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            if select.select([fd], [], [], remaining)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise EOFError
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def _death(self) -> str:
        proc, self._proc = self._proc, None
        if proc is None:
            return "not running"
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            _kill(proc)
            return "unresponsive (killed)"
        _kill(proc)  # its process group goes with it
        if code == -signal.SIGXCPU:
            return f"exceeded the CPU-time limit of {self.limits.cpu_s:g} s ({self.limits.key}_cpu_s)"
        if code < 0:
            return (f"killed by {signal.Signals(-code).name} (the memory limit, "
                    f"{self.limits.key}_memory_mb = {self.limits.memory_mb}?)")
        return f"exited with status {code}"

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            _kill(proc)

    def __del__(self):
        self.close()


def _kill(proc: subprocess.Popen) -> None:
    """Kill the worker, everything it started and its process group; reap the worker."""
    if proc.returncode is None:  # not reaped yet, so its pid is still its own: kill its tree
        kill_tree(proc.pid, include_root=True)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # a member that is no descendant any more
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream is not None and not stream.closed:
            stream.close()


@atexit.register
def close_all() -> None:
    """Close every open sandbox (their workers and all they started): the run's end."""
    for sandbox in list(LIVE):
        sandbox.close()


# ------------------------------------------------------------------------------ process trees
def descendants(root: int) -> list[int]:
    """The pids below ``root`` in the process tree (children first), from ``/proc/*/stat``."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])  # after "(comm)": state, ppid
        children.setdefault(ppid, []).append(int(entry.name))
    found, frontier = [], [root]
    while frontier:
        frontier = [c for p in frontier for c in children.get(p, [])]
        found += frontier
    return found


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(root: int, include_root: bool) -> None:
    """SIGKILL everything below ``root`` (and ``root`` itself if asked). Each process is stopped
    first, until a pass finds no new one, so that nothing forks between the listing and the kill."""
    stopped: set[int] = set()
    while True:
        pids = set(descendants(root)) | ({root} if include_root else set())
        new = pids - stopped
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        stopped |= new
    for pid in stopped:
        _signal(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------ worker
def _no_network() -> str:
    """Cut the network: a fresh network namespace if allowed; always disable ``socket``."""
    isolation = "socket-patch"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        for flags in (CLONE_NEWNET, CLONE_NEWUSER | CLONE_NEWNET):
            if libc.unshare(flags) == 0:
                isolation = "namespace"
                break
    except (OSError, AttributeError):
        pass
    import socket

    def refuse(*args, **kwargs):
        raise PermissionError("network access is disabled in the gspo reward sandbox")

    for name in ("socket", "create_connection", "create_server", "getaddrinfo", "fromfd", "socketpair"):
        setattr(socket, name, refuse)
    return isolation


def _import(spec: str):
    module, _, attr = spec.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{spec!r} is not callable")
    return obj


def _reap_descendants() -> None:
    """In the worker: kill whatever the user's code started and collect the dead (orphans that
    re-parented to this subreaper included)."""
    kill_tree(os.getpid(), include_root=False)
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:  # a child that is not dead yet: SIGKILL is on its way
            time.sleep(0.01)


def _watch_parent(parent: int) -> None:
    """In the worker: once the parent is gone (its SIGKILL, or a signal that skipped clean-up),
    kill everything this worker started and exit, whatever the main thread is doing."""
    while os.getppid() == parent:
        time.sleep(WATCHDOG_S)
    kill_tree(os.getpid(), include_root=False)
    os._exit(1)


def _own_descendants() -> None:
    """Make the worker the subreaper of everything it starts, and watch its parent."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the process group still catches most
        pass
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()


def _memory_message(config: dict) -> str:
    return (f"MemoryError: the sandbox's memory limit was hit ({config['key']}_memory_mb = "
            f"{config['memory_mb']} MB for the worker's whole address space)")


def _encode_tool(value) -> dict:
    if isinstance(value, (str, bool, int, float)):
        return {"value": value}
    return {"type": type(value).__name__, "repr": repr(value)[:80]}


def _encode(value) -> dict:
    if value is None:
        return {"value": None}
    if isinstance(value, numbers.Real):
        return {"value": float(value)}  # NaN / Infinity travel as JSON extensions
    return {"type": type(value).__name__, "repr": repr(value)[:80]}


def _worker(config: dict) -> None:
    proto = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # the user's prints must not corrupt the protocol
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        proto.write(json.dumps(obj).encode() + b"\n")

    _own_descendants()
    network = _no_network()
    mem, fsize = config["memory_mb"] << 20, config["file_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        fn = _import(config["spec"])
    except BaseException as err:  # noqa: BLE001  the user's module, whatever it raises
        send({"ready": False, "error": f"cannot import {config['spec']!r}: {type(err).__name__}: {err}"})
        return
    send({"ready": True, "network": network})
    _, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)
    for line in sys.stdin.buffer:
        request = json.loads(line)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        soft = math.ceil(usage.ru_utime + usage.ru_stime + config["cpu_s"])
        if cpu_hard != resource.RLIM_INFINITY:
            soft = min(soft, cpu_hard)
        resource.setrlimit(resource.RLIMIT_CPU, (soft, cpu_hard))
        try:
            if config["kind"] == "tool":
                reply = _encode_tool(fn(**request["row"]))
            else:
                row = keywords_for(fn, request["row"], request.get("record") or {})
                reply = _encode(fn(request["completion"], **row))
        except MemoryError:
            reply = {"error": _memory_message(config)}
        except BaseException as err:  # noqa: BLE001  isolated to this call
            reply = {"error": f"{type(err).__name__}: {err}"[:500]}
        _reap_descendants()  # nothing the call started outlives it
        send(reply)


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
