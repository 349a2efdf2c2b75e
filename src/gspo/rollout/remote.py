"""Generators on Ray (``rollout.placement: ray``): an ``Engine`` whose samples come from actors.

``RayEngine`` is the trainer's side: it connects to a Ray cluster (``rollout.ray_address``) or
starts a local one for the run (``LocalCluster``, ended with the trainer however it ends: a
``gspo.rollout.ray_keeper`` process), starts ``rollout.generators`` ``Generator`` actors, each
building its own ``rollout.engine`` (hf | vllm) from the policy's architecture and tokenizer on
``generator_cpus`` / ``generator_gpus`` of its own, and then behaves as any engine:

* ``update_weights(weights, version)`` sends the weights to every generator over a
  ``torch.distributed`` gloo group of two (trainer, generator j: a ``TCPStore`` and a
  ``ProcessGroupGloo`` built directly, so they sit beside a torchrun world), in buckets of bytes
  (``buckets``: the tensors' bytes laid end to end, ``BUCKET_BYTES`` at most, one broadcast
  each; a tied tensor sent once). A generator receives every bucket into buffers of its own and only then hands the whole
  set to its engine (``Engine.update_weights``), and stamps it with the sync's number: each
  ``generate`` names the sync it expects, and a generator holding another refuses. So no sample
  is ever drawn from half-updated weights. A version already synced is not sent again (a refill
  round of dynamic sampling).
* ``generate`` splits the P prompts into contiguous shards, one per generator; generator j's
  seed is ``seed + a_j`` (a_j: its first prompt's index), the convention by which vllm's
  per-prompt seeds make the shards the one-call batch; an hf engine seeds one generator per
  call, so only a single hf generator reproduces the colocated batch. Samples are padded to the
  longest shard and stacked in prompt order.
* **A generator that dies** (its actor or process gone, a broken group) is replaced: a fresh
  actor, a fresh group, the latest weights sent to it, its shard re-issued with the same seed;
  the batch is the one it would have been. ``metrics()`` counts the restarts.

Under ``torchrun`` (dist.strategy=ddp) rank 0 alone talks to the generators and hands every
rank the samples of the whole batch (``RankZero``).

The generators only sample; rewards, π_old and the version arithmetic of ``rollout.async`` stay
with the trainer (the collector and gspo.training.batch_source). ``ray`` is imported only here,
when an engine is built. Shapes: P prompts, G responses per prompt, N = P·G rows, T positions.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Mapping

import torch

from gspo.errors import EXIT_USAGE, UserError
from gspo.rollout import engines
from gspo.rollout.generate import Samples, SamplingParams

BUCKET_BYTES = 64 << 20
"""Most bytes one broadcast carries: per-tensor overhead, not bandwidth, is what a sync of many
small tensors costs (docs/performance.md, Weight sync)."""
ALIGN = 64
"""Each tensor's bytes start at a multiple of this in its bucket (a dtype view needs it)."""
GROUP_TIMEOUT = datetime.timedelta(minutes=5)
"""How long a broadcast waits for the other side of a weight group."""
MAX_RESTARTS = 3
"""Replacements of one generator within one call before the run gives up (the cluster is sick)."""
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


# ---------------------------------------------------------------------------- weight groups
@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of the weights, as both sides lay it out."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int                 # in its bucket, bytes
    nbytes: int


def aliases(weights: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """name -> the earlier name of the same tensor (tied embeddings: ``lm_head.weight`` is
    ``model.embed_tokens.weight``): sent once, set under both names."""
    seen, out = {}, {}
    for name, t in weights.items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if key in seen:
            out[name] = seen[key]
        else:
            seen[key] = name
    return out


def buckets(weights: Mapping[str, torch.Tensor], limit: int | None = None
            ) -> list[list[Entry]]:
    """The weights' tensors in order (an alias left out), dealt into buckets of at most
    ``limit`` bytes (default ``BUCKET_BYTES``; a larger tensor alone in one), each tensor at an
    ``ALIGN``-ed offset."""
    limit = BUCKET_BYTES if limit is None else limit
    skip = aliases(weights)
    out, current, size = [], [], 0
    for name, t in weights.items():
        if name in skip:
            continue
        nbytes = t.numel() * t.element_size()
        offset = -(-size // ALIGN) * ALIGN
        if current and offset + nbytes > limit:
            out.append(current)
            current, offset = [], 0
        current.append(Entry(name, tuple(t.shape), t.dtype, offset, nbytes))
        size = offset + nbytes
    return out + ([current] if current else [])


def bucket_bytes(bucket: list[Entry]) -> int:
    return bucket[-1].offset + bucket[-1].nbytes


def pack(bucket: list[Entry], weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The bucket's tensors as one uint8 CPU tensor (a lone tensor: its own bytes, no copy)."""
    if len(bucket) == 1:
        return weights[bucket[0].name].detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    buf = torch.empty(bucket_bytes(bucket), dtype=torch.uint8)
    for e in bucket:
        buf[e.offset:e.offset + e.nbytes] = weights[e.name].detach().cpu().contiguous() \
            .reshape(-1).view(torch.uint8)
    return buf


def unpack(bucket: list[Entry], buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of ``buf`` as the bucket's tensors."""
    return {e.name: buf[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in bucket}


def group(host: str, port: int, rank: int) -> "torch.distributed.ProcessGroupGloo":
    """Rank ``rank`` of a gloo group of two whose store is at host:port (rank 0 serves it, on
    ``host`` alone: a TCPStore's own socket would listen on every interface)."""
    import torch.distributed as dist
    listen = socket.create_server((host, port)).detach() if rank == 0 else None
    store = dist.TCPStore(host, port, 2, is_master=rank == 0, timeout=GROUP_TIMEOUT,
                          wait_for_workers=False, master_listen_fd=listen)
    return dist.ProcessGroupGloo(store, rank, 2, GROUP_TIMEOUT)


# ---------------------------------------------------------------------------- the actor
class Generator:
    """A Ray actor (``ray.remote(Generator)``): one engine, the receiving end of a weight group."""

    def __init__(self, engine: str, config, dtype: torch.dtype, tokenizer, options: dict,
                 threads: int):
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(threads)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)   # weights: the first sync
        self.engine = engines.build(engine, model.eval().requires_grad_(False), tokenizer,
                                    **options)
        self.layout: list[list[Entry]] = []
        self.buffers: list[torch.Tensor] = []
        self.sync = -1                       # the number of the last complete sync
        self.pg = None

    def pid(self) -> int:
        return os.getpid()

    def join(self, host: str, port: int, layout: list[list[Entry]], tied: dict[str, str]) -> int:
        """Join the weight group served at host:port; receive buffers for ``layout``;
        ``tied``: name -> the name whose tensor it is (``aliases``)."""
        self.pg = group(host, port, 1)
        self.layout, self.tied = layout, tied
        self.buffers = [torch.empty(bucket_bytes(b), dtype=torch.uint8) for b in layout]
        return os.getpid()

    def receive(self, sync: int, version: int | None) -> int:
        """Every bucket of the weights, then the whole set to the engine as ``version``; the
        sync's number is kept only once the engine holds them all."""
        for buf in self.buffers:
            self.pg.broadcast(buf, 0).wait()
        weights = {}
        for bucket, buf in zip(self.layout, self.buffers):
            weights.update(unpack(bucket, buf))
        weights.update({name: weights[same] for name, same in self.tied.items()})
        self.engine.update_weights(weights, version)
        self.sync = sync
        return sync

    def generate(self, prompt_ids: list[list[int]], group_size: int, params: SamplingParams,
                 seed: int | None, with_logprobs: bool, sync: int) -> Samples:
        if sync != self.sync:
            raise RuntimeError(f"generator holds the weights of sync {self.sync}, asked for {sync}")
        return self.engine.generate(prompt_ids, group_size, params, seed=seed,
                                    with_logprobs=with_logprobs)

    def weights(self) -> dict[str, torch.Tensor]:
        """The engine's weights (hf: its module's ``state_dict``; else the last set received):
        what the tests compare with the trainer's, bit for bit."""
        module = self.engine.module
        if module is not None:
            return {k: v.clone() for k, v in module.state_dict().items()}
        got = {k: v.clone() for b, buf in zip(self.layout, self.buffers)
               for k, v in unpack(b, buf).items()}
        return {**got, **{name: got[same] for name, same in self.tied.items()}}


# ---------------------------------------------------------------------------- the trainer's side
@dataclasses.dataclass
class Handle:
    """One generator as the trainer holds it: the actor and the sending end of its group."""
    actor: object
    pg: object
    pid: int


class RayEngine(engines.Engine):
    """The generators as one engine (module docstring). Shared: a thread worker of
    rollout.async samples through it (one set of generators per run)."""

    shared = True

    def __init__(self, name: str, model, tokenizer, spec: RaySpec, **options):
        import ray
        self.ray, self.spec, self.name = ray, spec, name
        inner = engines.spec(name)
        engines.check(name, getattr(model.config, "model_type", None))
        self.always_logprobs, self.own_kernels = inner.always_logprobs, inner.own_kernels
        self.default_correction = inner.default_correction
        self.pad_id = tokenizer.pad_token_id
        self.cluster, self.watch, self.auth = None, None, None
        self.connect()
        self.weights: Mapping[str, torch.Tensor] = model.state_dict()
        """The weights a replaced generator is sent: those of the last ``update_weights``."""
        self.layout, self.tied = buckets(self.weights), aliases(self.weights)
        self.make = ray.remote(Generator).options(num_cpus=spec.cpus, num_gpus=spec.gpus)
        self.build_args = (name, model.config, next(model.parameters()).dtype, tokenizer,
                           options, spec.threads)
        self.syncs, self.synced_version = 0, None
        self.restarts, self.sync_s, self.sync_bytes = 0, 0.0, 0
        self.generators = [self.start() for _ in range(spec.generators)]
        self.sync_all(None)

    # -- the cluster
    def connect(self) -> None:
        """Join the cluster at the address, or start a local one; refuse too few resources."""
        import logging
        spec = self.spec
        if spec.address is None:
            self.cluster = LocalCluster(spec.generators * spec.cpus, spec.generators * spec.gpus)
            self.auth = set_auth(token_env({}, self.cluster.token))   # restored by close
        address = spec.address or self.cluster.address
        try:
            self.ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
            check_resources(spec, self.ray.cluster_resources(), f"the Ray cluster at {address}")
            self.watch = watch_cluster(address)
        except BaseException as err:
            self.close()
            if isinstance(err, UserError):
                raise
            raise ClusterUnavailable(f"rollout.placement=ray: cannot join the Ray cluster at "
                                     f"{address} ({type(err).__name__}: {err})") from None

    # -- generators
    def start(self) -> Handle:
        """A new generator, its weight group formed (it has no weights until a sync)."""
        actor = self.make.remote(*self.build_args)
        self.ray.get(actor.pid.remote())        # a failed build raises here, not as a group timeout
        host = "127.0.0.1" if self.cluster is not None else self.ray.util.get_node_ip_address()
        port = free_port()
        joined = actor.join.remote(host, port, self.layout, self.tied)
        pg = group(host, port, 0)              # returns once the generator has joined
        return Handle(actor, pg, self.ray.get(joined))

    def replace(self, j: int) -> None:
        """Generator j is gone: a new one in its place, sent the latest weights."""
        old = self.generators[j]
        try:
            self.ray.kill(old.actor, no_restart=True)
        except Exception:  # noqa: BLE001  already gone
            pass
        self.restarts += 1
        self.generators[j] = self.start()
        if self.send([j], self.syncs, self.synced_version):
            raise RuntimeError(f"generator {j} failed its first sync")

    # -- weights
    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int | None) -> None:
        self.weights = weights
        if version is not None and version == self.synced_version:
            return                                  # this version is there already
        self.sync_all(version)

    def sync_all(self, version: int | None) -> None:
        """Send ``self.weights`` to every generator as a new sync (replacing any that fails)."""
        self.syncs += 1
        t0 = time.perf_counter()
        failed = self.send(range(len(self.generators)), self.syncs, version)
        self.synced_version = version
        for j in failed:                  # replaced, and sent this sync alone
            self.retry(j, lambda: None)
        self.sync_s += time.perf_counter() - t0
        self.sync_bytes += sum(bucket_bytes(b) for b in self.layout) * len(self.generators)

    def send(self, which, sync: int, version: int | None) -> list[int]:
        """Broadcast the weights to generators ``which`` (bucket by bucket, to all at once);
        the indices of those that failed."""
        which = list(which)
        done = {j: self.generators[j].actor.receive.remote(sync, version) for j in which}
        failed = set()
        for bucket in self.layout:
            buf = pack(bucket, self.weights)
            works = {}
            for j in which:
                if j not in failed:
                    try:
                        works[j] = self.generators[j].pg.broadcast(buf, 0)
                    except RuntimeError:
                        failed.add(j)
            for j, work in works.items():
                try:
                    work.wait()
                except RuntimeError:
                    failed.add(j)
        for j in which:
            try:
                self.ray.get(done[j])
            except self.ray.exceptions.RayError:      # died, or its side of the group broke
                failed.add(j)
        return sorted(failed)

    def retry(self, j: int, call):
        """``call()`` until generator j answers, replacing it each time it is gone."""
        for _ in range(MAX_RESTARTS):
            try:
                self.replace(j)
                return call()
            except (self.ray.exceptions.RayActorError, RuntimeError):
                continue
        raise ClusterUnavailable(f"rollout.placement=ray: generator {j} died {MAX_RESTARTS} times "
                                 f"in a row; is the Ray cluster alive? (continue with --resume)")

    # -- sampling
    def generate(self, prompt_ids: list[list[int]], group_size: int, params: SamplingParams,
                 seed: int | None = None, with_logprobs: bool = True) -> Samples:
        shards = torch.arange(len(prompt_ids)).tensor_split(min(len(self.generators),
                                                                len(prompt_ids)))

        def issue(j: int):
            first = int(shards[j][0])
            part = prompt_ids[first:first + len(shards[j])]
            return self.generators[j].actor.generate.remote(
                part, group_size, params, None if seed is None else seed + first,
                with_logprobs, self.syncs)

        refs = [issue(j) for j in range(len(shards))]
        samples = []
        for j, ref in enumerate(refs):
            try:
                samples.append(self.ray.get(ref))
            except self.ray.exceptions.RayActorError:     # gone: replaced, its prompts re-issued
                samples.append(self.retry(j, lambda: self.ray.get(issue(j))))
        return stack(samples, self.pad_id)

    def metrics(self) -> dict:
        """ray/* since the last call: seconds and MB of weight syncs, generators replaced."""
        out = {"ray/sync_s": self.sync_s, "ray/sync_mb": self.sync_bytes / 2**20,
               "ray/generator_restarts": float(self.restarts)}
        self.sync_s, self.sync_bytes = 0.0, 0
        return out

    def pids(self) -> list[int]:
        """The generators' process ids (tests kill one)."""
        return [g.pid for g in self.generators]

    def close(self) -> None:
        """Generators ended, the cluster left (a local one stopped and its folder removed)."""
        for g in getattr(self, "generators", []):
            try:
                self.ray.kill(g.actor, no_restart=True)
            except Exception:  # noqa: BLE001  gone already
                pass
        self.generators = []
        if self.watch is not None:
            self.watch.set()                    # the cluster goes now: no longer a fault
        if self.ray.is_initialized():
            self.ray.shutdown()
        if self.auth is not None:               # after the shutdown: no thread reads the token
            set_auth(self.auth)
            self.auth = None
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None


def stack(parts: list[Samples], pad_id: int) -> Samples:
    """Samples of consecutive prompt shards as one, each padded to the longest response."""
    T = max(p.response_ids.shape[1] for p in parts)

    def widen(x: torch.Tensor, value) -> torch.Tensor:
        return torch.cat([x, x.new_full((x.shape[0], T - x.shape[1]), value)], dim=1)

    logp = None if parts[0].logp is None else torch.cat([widen(p.logp, 0.0) for p in parts])
    return Samples(torch.cat([widen(p.response_ids, pad_id) for p in parts]),
                   torch.cat([widen(p.response_mask, 0.0) for p in parts]),
                   torch.cat([p.truncated for p in parts]), logp)


class RankZero(engines.Engine):
    """The generators for a ``torchrun`` trainer (dist.strategy=ddp): rank 0 holds the
    ``RayEngine`` and samples the prompts of every rank; each rank gets the samples (and the
    ray/* metrics) from rank 0 (``on_main``: a broadcast over the trainer's own process group, a
    failure on rank 0 raised on every rank), then keeps its own rows (the collector's engine
    group is the whole world). The weights go from rank 0's replica, every rank's under ddp."""

    shared = True

    def __init__(self, name: str, engine: RayEngine | None, on_main):
        self.inner, self.on_main = engine, on_main       # engine: None off rank 0
        kind = engines.spec(name)
        self.always_logprobs, self.own_kernels = kind.always_logprobs, kind.own_kernels
        self.seeds_per_prompt, self.default_correction = kind.seeds_per_prompt, kind.default_correction

    def generate(self, prompt_ids: list[list[int]], group_size: int, params: SamplingParams,
                 seed: int | None = None, with_logprobs: bool = True) -> Samples:
        return self.on_main(lambda: self.inner.generate(prompt_ids, group_size, params, seed,
                                                        with_logprobs))

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int | None) -> None:
        self.on_main(lambda: self.inner.update_weights(weights, version))

    def metrics(self) -> dict:
        return self.on_main(lambda: self.inner.metrics())

    def pids(self) -> list[int]:
        return [] if self.inner is None else self.inner.pids()

    def close(self) -> None:
        """Rank 0 ends the generators (no collective: a run may be closing on an error)."""
        if self.inner is not None:
            self.inner.close()
            self.inner = None


def build(name: str, model, tokenizer, spec: RaySpec, ranks=None, **options) -> engines.Engine:
    """Generators of engine ``name`` on Ray for ``model`` (``options``: the engine's own, but
    initial ``weights``: a generator gets its weights by the first sync, not through Ray).
    ``ranks`` (gspo.training.collectives.Ranks) of a torchrun trainer: ``RankZero`` over them."""
    options.pop("weights", None)
    if ranks is None or not ranks.enabled:
        return RayEngine(name, model, tokenizer, spec, **options)
    built: list[RayEngine] = []
    ranks.on_main(lambda: built.append(RayEngine(name, model, tokenizer, spec, **options)))
    return RankZero(name, built[0] if built else None, ranks.on_main)
