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
import os
import socket
import time
from typing import Mapping

import torch

from gspo.errors import UserError
from gspo.rollout.engines.base import Capabilities, Engine, capabilities, check
from gspo.rollout.engines.base import build as build_engine
from gspo.rollout.engines.ray_cluster import (ClusterUnavailable, LocalCluster, RaySpec,
                                             check_resources, free_port, set_auth, token_env,
                                             watch_cluster)
from gspo.rollout.engines.weights import Entry, aliases, bucket_bytes, buckets, pack, unpack
from gspo.rollout.generate import Samples, SamplingParams

GROUP_TIMEOUT = datetime.timedelta(minutes=5)
"""How long a broadcast waits for the other side of a weight group."""
MAX_RESTARTS = 3
"""Replacements of one generator within one call before the run gives up (the cluster is sick)."""


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
        self.engine = build_engine(engine, model.eval().requires_grad_(False), tokenizer,
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


def on_generators(name: str) -> Capabilities:
    """Engine ``name``'s capabilities as generators on Ray: one set serves the trainer and a
    thread worker (shared); in processes of their own, they join no process group of the
    trainer's, their log-probs are never the trainer's own computation, and they are built from
    the architecture and sent whole weights (a LoRA policy's merged: no adapters)."""
    return dataclasses.replace(capabilities(name), shared=True, joins_process_group=False,
                               trainer_logprobs=False, adapters=False)


class RayEngine(Engine):
    """The generators as one engine (module docstring). Shared: a thread worker of
    rollout.async samples through it (one set of generators per run)."""

    def __init__(self, name: str, model, tokenizer, spec: RaySpec,
                 weights: Mapping[str, torch.Tensor] | None = None, **options):
        import ray
        self.ray, self.spec, self.name = ray, spec, name
        check(name, getattr(model.config, "model_type", None))
        self.capabilities = on_generators(name)
        self.pad_id = tokenizer.pad_token_id
        self.cluster, self.watch, self.auth = None, None, None
        self.connect()
        self.weights: Mapping[str, torch.Tensor] = model.state_dict() if weights is None else weights
        """The weights a replaced generator is sent: those of the last ``update_weights`` (first:
        ``weights``, or the model's own; their names and shapes lay out the buckets)."""
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


class RankZero(Engine):
    """The generators for a ``torchrun`` trainer (dist.strategy=ddp): rank 0 holds the
    ``RayEngine`` and samples the prompts of every rank; each rank gets the samples (and the
    ray/* metrics) from rank 0 (``on_main``: a broadcast over the trainer's own process group, a
    failure on rank 0 raised on every rank), then keeps its own rows (the collector's engine
    group is the whole world). The weights go from rank 0's replica, every rank's under ddp."""

    def __init__(self, name: str, engine: RayEngine | None, on_main):
        self.inner, self.on_main = engine, on_main       # engine: None off rank 0
        self.capabilities = on_generators(name)

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


def build(name: str, model, tokenizer, spec: RaySpec, ranks=None, weights=None, **options) -> Engine:
    """Generators of engine ``name`` on Ray for ``model`` (``options``: the engine's own; the
    initial ``weights``, default the model's own, go by the first sync, not through Ray: e.g. a
    LoRA policy's merged into its base, ``model``). ``ranks``
    (gspo.training.collectives.Ranks) of a torchrun trainer: ``RankZero`` over them."""
    if ranks is None or not ranks.enabled:
        return RayEngine(name, model, tokenizer, spec, weights, **options)
    built: list[RayEngine] = []
    ranks.on_main(lambda: built.append(RayEngine(name, model, tokenizer, spec, weights, **options)))
    return RankZero(name, built[0] if built else None, ranks.on_main)
