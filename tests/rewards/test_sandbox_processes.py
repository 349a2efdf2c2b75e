"""The reward sandbox owns what it starts: after each call, after a timeout, when its worker is
replaced or closed, when the parent is killed by SIGTERM or SIGKILL in the middle of a call, and
when `gspo train` ends or is stopped by SIGTERM, no process of the sandbox's remains.

The probe reward starts two processes per call: a plain child and a daemon (double fork + setsid,
so it leaves the worker's process group and its parent). Each carries a marker unique to the test
in its command line, as does the worker (the spec names the probe's module), so a scan of /proc
counts what is left. A zombie (dead, not yet reaped by its new parent) counts as gone."""

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from gspo.errors import RewardFault
from gspo.rewards.sandbox import Limits, SandboxedFunction, descendants

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

PROBE = """
import os, subprocess, sys, time
MARKER = {marker!r}
DAEMON = "import os, sys, time\\nif os.fork() == 0:\\n    os.setsid()\\n    time.sleep(300)\\n"

def spawner(completion, **row):
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", MARKER])
    subprocess.Popen([sys.executable, "-c", DAEMON, MARKER]).wait()  # its child lives on, alone
    if completion == "hang":
        time.sleep(300)
    return float(len(completion))
"""


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """(spec, marker): a fresh probe module whose name is the marker."""
    marker = f"gspo_probe_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{marker}.py").write_text(PROBE.format(marker=marker))
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{marker}:spawner", marker


def alive(marker: str) -> list[int]:
    """Pids of live (not zombie) processes whose command line contains ``marker``."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
            stat = Path(f"/proc/{entry.name}/stat").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline and stat[stat.rindex(b")") + 2:][:1] != b"Z":
            found.append(int(entry.name))
    return found


def wait_for(condition, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def none_left(marker: str) -> bool:
    return wait_for(lambda: not alive(marker), timeout=10.0)


def test_each_call_kills_what_it_started(probe):
    spec, marker = probe
    fn = SandboxedFunction(spec)
    try:
        for _ in range(3):
            assert fn("abc") == 3.0
            assert alive(marker) == [fn.pid]        # the worker only: both children are gone
        assert descendants(fn.pid) == []            # nothing re-parented to it either
    finally:
        fn.close()
    assert none_left(marker)


def test_a_timeout_kills_the_worker_and_all_it_started(probe):
    spec, marker = probe
    fn = SandboxedFunction(spec, Limits(wall_s=3.0))
    first = fn.pid
    with pytest.raises(RewardFault, match="timed out"):
        fn("hang")                                  # both children were running at the kill
    assert none_left(marker)
    assert fn("ab") == 2.0 and fn.pid != first      # the replacement worker serves the next call
    fn.close()
    assert none_left(marker)


def test_close_and_interpreter_exit_leave_nothing(probe, tmp_path):
    spec, marker = probe
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        from gspo.rewards.sandbox import SandboxedFunction
        fn = SandboxedFunction({spec!r})
        print(fn("abc"), flush=True)
    """))                                           # never closed: the atexit hook must do it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "3.0", out.stderr
    assert none_left(marker)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_parent_killed_during_a_call_leaves_nothing(probe, tmp_path, sig):
    """The parent dies by a signal without any clean-up (SIGTERM's default action, SIGKILL)
    while the worker runs a call whose two children are alive: the worker's watchdog kills them
    and the worker exits."""
    spec, marker = probe
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        from gspo.rewards.sandbox import Limits, SandboxedFunction
        SandboxedFunction({spec!r}, Limits(wall_s=300))("hang")
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    parent = subprocess.Popen([sys.executable, str(script)], env=env)
    try:
        assert wait_for(lambda: len(alive(marker)) == 3, timeout=60), alive(marker)  # worker + 2
        parent.send_signal(sig)
        assert parent.wait(timeout=30) == -sig
        assert none_left(marker), alive(marker)
    finally:
        parent.kill()
        parent.wait()


def test_gspo_train_ends_or_is_stopped_with_nothing_left(probe, tmp_path, small_config):
    """`gspo train` with the spawning reward sandboxed: a run that ends, and one stopped by
    SIGTERM (saved, exit 143), leave no worker and no child behind."""
    from gspo.config import dump_yaml
    from gspo.observe.metrics import read_metrics
    spec, marker = probe
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]),
           "OMP_NUM_THREADS": "1"}
    overrides = [f"rewards.sources=[{{type: function, fn: '{spec}'}}]", "rewards.sandbox=true",
                 "run.save_every=0"]
    for name, steps in (("ends", 2), ("stopped", 50)):
        cfg = small_config(tmp_path, *overrides, f"train.steps={steps}", run=name)
        config = tmp_path / f"{name}.yaml"
        dump_yaml(cfg, config)
        proc = subprocess.Popen([sys.executable, "-m", "gspo", "train", str(config)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if name == "stopped":
            assert wait_for(lambda: proc.poll() is None and len(read_metrics(tmp_path / name)) >= 2,
                            timeout=240)        # step 1 logged: the sandbox has served calls
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == (0 if name == "ends" else 143), err[-2000:]
        assert none_left(marker), (name, alive(marker))
