"""The keeper of a local Ray cluster started for one run: the cluster lives exactly as long as
the trainer that started it, however the trainer ends.

``python -m gspo.rollout.ray_keeper TEMP_DIR PORT CPUS GPUS OBJECT_STORE_BYTES`` runs in a
session of its own (the trainer starts it with ``start_new_session``), starts a head node with
``ray start --head`` with the node address 127.0.0.1 and the token authentication its
environment sets (``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN``: the run's token, never on a
command line; its daemons inherit the keeper's process group and environment), prints
``ready`` (or ``failed: <why>``) on its stdout, then blocks reading its stdin, a pipe whose
writing end only the trainer holds. When that pipe ends (the trainer closed it, or died: even a
SIGKILL closes it) the keeper ends the cluster: every process of its group and every child of
one (Ray's workers set process groups of their own), SIGTERM, then SIGKILL two seconds later,
and removes the cluster's temporary folder.

Why a keeper: a cluster that ``ray.init()`` starts inside the trainer lives in the trainer's
process group, and after a SIGKILL of the trainer two of its processes (the dashboard agent and
the runtime-env agent) stayed alive (Ray 2.60, measured: docs/distributed.md). It never runs
``ray stop``, which ends every Ray cluster of the machine's user, not only this one.

Standard library only: it starts in a fraction of a second and imports neither torch nor ray.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time


def members(pgid: int) -> set[int]:
    """Processes of group ``pgid`` and the children of any of them (this process left out)."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                stats[int(entry)] = (int(fields[1]), int(fields[2]))      # ppid, pgid
            except (OSError, IndexError, ValueError):
                continue                                                   # gone meanwhile
    group = {pid for pid, (_, g) in stats.items() if g == pgid}
    children = {pid for pid, (ppid, _) in stats.items() if ppid in group}
    return (group | children) - {os.getpid()}


def end_cluster(pgid: int, grace_s: float = 2.0) -> None:
    """SIGTERM to every process of the cluster (``members``), SIGKILL to those left after
    ``grace_s``, until none is left."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = members(pgid)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)


def main(temp_dir: str, port: str, cpus: str, gpus: str, object_store: str) -> int:
    pgid = os.getpgid(0)
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    command = [ray, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
               f"--num-cpus={cpus}", f"--num-gpus={gpus}", f"--temp-dir={temp_dir}",
               f"--object-store-memory={object_store}", "--include-dashboard=false",
               "--disable-usage-stats"]
    try:
        started = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                 timeout=120)
        failed = started.returncode != 0
        why = (started.stderr.strip().splitlines() or ["exit %d" % started.returncode])[-1]
    except (OSError, subprocess.TimeoutExpired) as err:
        failed, why = True, str(err)
    print(f"failed: {why}" if failed else "ready", flush=True)
    if not failed:
        try:
            sys.stdin.buffer.read()           # until the trainer closes the pipe or dies
        except OSError:
            pass
    end_cluster(pgid)
    shutil.rmtree(temp_dir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # a Ctrl-C reaches the whole terminal group:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # the trainer saves, then ends the cluster
    sys.exit(main(*sys.argv[1:]))
