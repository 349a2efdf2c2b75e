"""The Ray cluster of ``rollout.placement: ray``: its settings (``RaySpec``), the checks before
anything starts (``check``: Ray installed, the address reachable, the resources there), and a
local cluster started for one run (``LocalCluster``, ended with the trainer however it ends: a
``gspo.rollout.ray_keeper`` process). The generators that run on it are ``engines.ray_generators``'."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Mapping

import torch

from gspo.errors import EXIT_USAGE, UserError

CLUSTER_SILENCE_S = 10.0
"""How long the cluster's GCS may refuse connections before the run ends (``watch_cluster``)."""
OBJECT_STORE_BYTES = 256 << 20
"""A local cluster's object store: samples and prompts only; the weights never go through it."""


class ClusterUnavailable(UserError):
    """No Ray, no cluster at the address, or too few resources for the generators: one line."""


@dataclasses.dataclass(frozen=True)
class RaySpec:
    """Where the generators run and on what (the rollout.* keys of rollout.placement=ray)."""
    generators: int = 1
    cpus: float = 1.0
    gpus: float = 0.0
    address: str | None = None
    threads: int = 1
    """torch threads of each generator."""

    @classmethod
    def of(cls, rollout, threads: int) -> "RaySpec":
        """From a rollout config section (any object with its fields); ``threads``: run.threads
        (0: the generator's CPUs, rounded down)."""
        return cls(rollout.generators, rollout.generator_cpus, rollout.generator_gpus,
                   rollout.ray_address, threads or max(1, int(rollout.generator_cpus)))


# ---------------------------------------------------------------------------- checks
def check(spec: RaySpec) -> None:
    """ClusterUnavailable (one line) unless ray is installed, the cluster answers and it has the
    resources the generators ask for; before anything is built (the preflight's)."""
    if importlib.util.find_spec("ray") is None:
        raise ClusterUnavailable("rollout.placement=ray needs the ray package, which is not "
                                 "installed: pip install 'gspo[ray]'")
    if spec.address is None:
        have = {"CPU": float(os.cpu_count() or 1), "GPU": float(torch.cuda.device_count())}
        check_resources(spec, have, "this machine (the local cluster started for the run)")
        return
    host, port = parse_address(spec.address)
    try:
        socket.create_connection((host, port), timeout=3.0).close()
    except OSError as err:
        raise ClusterUnavailable(f"rollout.ray_address={spec.address}: no Ray cluster answers "
                                 f"there ({err.strerror or err}); start one with `ray start "
                                 f"--head`, or leave rollout.ray_address unset for a local "
                                 f"cluster") from None
    import logging
    import ray
    if ray.is_initialized():
        return
    try:
        ray.init(address=spec.address, logging_level=logging.WARNING, log_to_driver=False)
        check_resources(spec, ray.cluster_resources(), f"the Ray cluster at {spec.address}")
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001  ray raises ConnectionError, RuntimeError...
        raise ClusterUnavailable(f"rollout.ray_address={spec.address}: cannot join the Ray "
                                 f"cluster there ({type(err).__name__}: {err})") from None
    finally:
        ray.shutdown()


def parse_address(address: str) -> tuple[str, int]:
    """host, port of a ``host:port`` address (a Ray client's ray:// is not served)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        raise ClusterUnavailable(f"rollout.ray_address={address!r}: expected host:port (the GCS "
                                 f"address `ray start --head` prints, e.g. 10.0.0.1:6379)")
    return host, int(port)


def check_resources(spec: RaySpec, have: Mapping[str, float], where: str) -> None:
    """The generators' CPUs and GPUs fit in ``have`` (resource -> amount) of ``where``."""
    for name, each in (("CPU", spec.cpus), ("GPU", spec.gpus)):
        need = spec.generators * each
        if need > have.get(name, 0.0) + 1e-9:
            key = "generator_cpus" if name == "CPU" else "generator_gpus"
            raise ClusterUnavailable(
                f"rollout.generators={spec.generators} x rollout.{key}={each:g} = {need:g} "
                f"{name}s, but {where} has {have.get(name, 0.0):g}: use fewer generators or "
                f"fewer {name}s each")


# ---------------------------------------------------------------------------- the cluster
class LocalCluster:
    """A head node started for the run in a temporary folder, ended by its keeper
    (gspo.rollout.ray_keeper) when ``stop`` closes the keeper's pipe or the trainer dies. Ray's
    servers listen on every interface (Ray 2.60 has no loopback-only setting for them), so the
    cluster runs under Ray's token authentication with ``token``, drawn for this run: every
    server refuses a client without it (docs/distributed.md, Security)."""

    def __init__(self, cpus: float, gpus: float):
        self.temp_dir = tempfile.mkdtemp(prefix="gspo-ray-", dir="/tmp")  # short: socket paths
        self.port = free_port()
        self.token = secrets.token_hex(32)
        self.keeper = subprocess.Popen(
            [sys.executable, "-m", "gspo.rollout.ray_keeper", self.temp_dir, str(self.port),
             str(int(max(1, round(cpus)))), str(int(gpus)), str(OBJECT_STORE_BYTES)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
            env=token_env(os.environ, self.token, PYTHONPATH=os.pathsep.join(sys.path)))
        said = self.keeper.stdout.readline().decode().strip()
        if said != "ready":
            self.stop()
            raise ClusterUnavailable(f"rollout.placement=ray: the local Ray cluster did not start "
                                     f"({said or 'its keeper exited'})")
        self.address = f"127.0.0.1:{self.port}"

    @property
    def pgid(self) -> int:
        """The process group of the cluster's daemons (the keeper's)."""
        return self.keeper.pid

    def stop(self) -> None:
        """End the cluster and wait for it; its temporary folder removed."""
        if self.keeper.poll() is None:
            self.keeper.stdin.close()
            try:
                self.keeper.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.keeper.kill()
                self.keeper.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
"""How Ray finds its authentication mode and token (Ray 2.60: the variable, a file it names, or
~/.ray/auth_token)."""


def token_env(environ: Mapping[str, str], token: str, **extra: str) -> dict[str, str]:
    """``environ`` with Ray's token authentication on and ``token`` the token (in the environment,
    which only the user and root can read; never on a command line, which anyone can)."""
    env = {k: v for k, v in environ.items() if k not in AUTH_VARS}
    return {**env, **extra, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}


def set_auth(values: Mapping[str, str | None]) -> dict[str, str | None]:
    """This process's ``AUTH_VARS`` set to ``values`` (None or absent: unset) and Ray's cached
    config and token reloaded; returns the values replaced (``set_auth`` of them restores)."""
    from ray._raylet import AuthenticationTokenLoader, Config   # Ray's own reload (its tests')
    before = {k: os.environ.get(k) for k in AUTH_VARS}
    for k in AUTH_VARS:
        if values.get(k) is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = values[k]
    Config.initialize("")                       # the mode first, then the token (Ray's order)
    AuthenticationTokenLoader.instance().reset_cache()
    return before


def watch_cluster(address: str) -> threading.Event:
    """A daemon thread, until the event returned is set, that ends this process with one line and exit 2 once the cluster's GCS at
    ``address`` has refused connections for ``CLUSTER_SILENCE_S``. Without it Ray's core worker
    ends the trainer itself, 60 s after losing the GCS, with exit 1 and a screen of logs (Ray
    2.60, measured). The process ends at once (``os._exit``): a local cluster's keeper sees its
    pipe close and ends what is left of the cluster; the run resumes from its last checkpoint."""
    host, port = parse_address(address)

    stop = threading.Event()

    def watch():
        silent = 0.0
        while not stop.wait(1.0):
            try:
                socket.create_connection((host, port), timeout=1.0).close()
                silent = 0.0
            except OSError:
                silent += 1.0
            if silent >= CLUSTER_SILENCE_S:
                print(f"gspo: error: rollout.placement=ray: the Ray cluster at {address} stopped "
                      f"answering ({silent:.0f} s); start it again and continue from the last "
                      f"checkpoint with gspo train --resume RUN_DIR", file=sys.stderr, flush=True)
                os._exit(EXIT_USAGE)
    threading.Thread(target=watch, daemon=True, name="gspo-ray-watch").start()
    return stop


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
