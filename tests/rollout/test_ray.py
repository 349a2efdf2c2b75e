"""Generators on Ray (rollout.placement=ray, gspo.rollout.engines.ray_generators) on a local cluster of this
machine, in runs: s = 0 is the colocated run (metrics and weights), a killed generator replaced
with nothing lost, s = 1 the colocated asynchronous run; a SIGKILLed trainer leaves no process
behind, a finished one neither, a lost cluster ends the run in one line; bad input is one line,
exit 2, before training; every server of the cluster refuses a client without the run's token.
The engine alone (bit-equal syncs, shards, a killed generator): tests/rollout/test_ray_engine.py.

Each cluster start costs seconds (``ray start``, actors importing torch and transformers). A
test's own ``ray.init`` runs without token authentication (no ~/.ray/auth_token written); a
local cluster uses its run's token and lives in /tmp/gspo-ray-*, removed when it stops."""

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gspo.config import load_config
from gspo.errors import UserError
from gspo.models.presets import load_model
from gspo.observe.metrics import read_metrics
from gspo.rollout.engines import ray_cluster, ray_generators
from gspo.rollout.ray_keeper import members
from gspo.tools import preflight
from gspo.training.trainer import Trainer
from conftest import parity_rewards

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="ray is not installed (pip install 'gspo[ray]')")

pytestmark = pytest.mark.usefixtures("ray_without_auth")


def clusters_left() -> list[str]:
    return [p.name for p in Path("/tmp").glob("gspo-ray-*")]


def assert_bit_equal(got, want):
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), \
        [k for k in want if not torch.equal(got[k], want[k])]


# ------------------------------------------------------------------------ runs
def _cfg(make_cfg, reward_module, *overrides, run):
    return make_cfg("sft.enabled=false", "train.steps=3", parity_rewards(reward_module),
                    "rollout.max_new_tokens=8", *overrides, run=run)


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "async/", "ray/"))}
            for r in rows]


def _final_weights(run_dir):
    return load_model(f"{run_dir}/checkpoints/step_{3:06d}")[0].state_dict()


@pytest.fixture
def kept_clusters(monkeypatch):
    """The local clusters started while the test runs (their process groups), recorded."""
    started = []
    original = ray_cluster.LocalCluster.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        started.append(self.pgid)
    monkeypatch.setattr(ray_cluster.LocalCluster, "__init__", recording)
    return started


@needs_ray
def test_staleness_zero_on_ray_is_the_colocated_run(make_cfg, reward_module, kept_clusters,
                                                    monkeypatch):
    """Synchronous on Ray, and rollout.async s = 0 on Ray with generator 0 SIGKILLed before the
    batch of step 2: both the colocated run, metrics and final weights; nothing left running."""
    colocated = _cfg(make_cfg, reward_module, run="colocated")
    Trainer(colocated, log=lambda m: None).run()
    calls, generate = [], ray_generators.RayEngine.generate

    def kill_at_step_2(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            os.kill(self.pids()[0], signal.SIGKILL)
        return generate(self, *args, **kwargs)
    monkeypatch.setattr(ray_generators.RayEngine, "generate", kill_at_step_2)
    runs = {"ray": ("rollout.placement=ray",),
            "ray-s0": ("rollout.placement=ray", "rollout.async=true", "rollout.max_staleness=0")}
    for run, overrides in runs.items():
        cfg = _cfg(make_cfg, reward_module, *overrides, run=run)
        calls.clear()
        Trainer(cfg, log=lambda m: None).run()
        a, b = read_metrics(colocated.run.dir), read_metrics(cfg.run.dir)
        assert _strip(a) == _strip(b), run
        assert_bit_equal(_final_weights(cfg.run.dir), _final_weights(colocated.run.dir))
        assert sum(r.get("ray/generator_restarts", 0) for r in b) == 1, run
        assert all(r["ray/sync_mb"] > 0 for r in b if "ray/sync_mb" in r)
    assert any(r["reward/std"] > 0 for r in read_metrics(colocated.run.dir)[1:])
    assert len(kept_clusters) == 2
    assert not any(members(pgid) for pgid in kept_clusters)       # clean shutdown
    assert not clusters_left()


@needs_ray
def test_lora_on_ray_samples_as_the_colocated_lora_run(make_cfg, reward_module):
    """model.lora with hf generators on Ray, which sample whole weights only: they are built from
    the policy's base and sent its adapters merged into the weights before every step
    (gspo.rollout.engine_host), so they sample what the colocated run samples through peft's
    adapters: every reward and response metric of every step equal, the generators' weights
    the final adapters merged. (Other metrics differ by rounding: the colocated sampler's
    log-probs come from peft's forward.)"""
    from gspo.rollout.engines.weights import merged_adapters
    lora = "model.lora={r: 4, alpha: 8}"
    colocated = _cfg(make_cfg, reward_module, lora, run="colocated")
    Trainer(colocated, log=lambda m: None).run()
    cfg = _cfg(make_cfg, reward_module, lora, "rollout.placement=ray", run="ray")
    trainer = Trainer(cfg, log=lambda m: None)
    try:
        trainer.train()
        engine = trainer.collector.engine
        engine.update_weights(trainer.collector.host.weights(), None)
        got = engine.ray.get(engine.generators[0].actor.weights.remote())
        assert_bit_equal(got, dict(merged_adapters(trainer.model)))
    finally:
        trainer.collector.close()
    a, b = read_metrics(colocated.run.dir), read_metrics(cfg.run.dir)
    sampled = lambda rows: [{k: v for k, v in r.items() if k.startswith(("reward/", "response/"))}  # noqa: E731
                            for r in rows]
    assert [r["step"] for r in b] == [0, 1, 2, 3] and all(r["ray/sync_mb"] > 0 for r in b[1:])
    assert sampled(a) == sampled(b)
    assert any(r["reward/std"] > 0 for r in a[1:])


@needs_ray
def test_staleness_one_on_ray_is_the_colocated_asynchronous_run(make_cfg, reward_module):
    """s = 1: the bounded-staleness machinery of rollout.async unchanged (the thread worker's
    π_prox and correction), its sampler the generator: the colocated thread worker's run."""
    s1 = ("rollout.async=true", "rollout.max_staleness=1", "rollout.async_worker=thread")
    colocated = _cfg(make_cfg, reward_module, *s1, run="colocated-s1")
    Trainer(colocated, log=lambda m: None).run()
    cfg = _cfg(make_cfg, reward_module, "rollout.placement=ray", *s1, run="ray-s1")
    Trainer(cfg, log=lambda m: None).run()
    a, b = read_metrics(colocated.run.dir), read_metrics(cfg.run.dir)
    assert [r["async/staleness"] for r in b[1:]] == [0.0, 1.0, 1.0]
    assert _strip(a) == _strip(b)
    assert_bit_equal(_final_weights(cfg.run.dir), _final_weights(colocated.run.dir))


def descendants(pid: int) -> set[int]:
    """``pid``'s children, theirs, and so on (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text()
                                          .rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - out
        out |= frontier
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_training(tmp_path, small_config):
    """``gspo train`` on Ray in a subprocess, once it has done RL steps: (the process, its
    keeper's pid, every process of its cluster)."""
    cfg = small_config(tmp_path, "sft.enabled=false", "train.steps=400", "rollout.placement=ray")
    from gspo.config import dump_yaml
    dump_yaml(cfg, tmp_path / "cfg.yaml")
    trainer = subprocess.Popen([sys.executable, "-m", "gspo", "train", str(tmp_path / "cfg.yaml")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        metrics = Path(cfg.run.dir) / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and trainer.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:   # RL steps
                break
            time.sleep(0.5)
        assert trainer.poll() is None, trainer.stderr.read().decode()[-2000:]
        keeper = [p for p in descendants(trainer.pid)
                  if b"gspo.rollout.ray_keeper" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(keeper) == 1
        # `ray start` leaves its daemons to init: they are the keeper's group, and their children
        processes = {q for p in members(keeper[0]) for q in {p, *descendants(p)}} | set(keeper)
        generators = [p for p in processes
                      if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"ray::Generator")]
        assert generators and len(processes) > 5       # gcs, raylet, agents, the generator...
    except BaseException:
        trainer.kill()
        trainer.wait()
        raise
    return trainer, keeper[0], processes


def assert_gone(processes, before, within_s=30):
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [(p, Path(f"/proc/{p}/cmdline").read_bytes()[:60]) for p in processes if alive(p)]
    assert not left
    assert set(clusters_left()) <= before                # the keeper removed its folder


@needs_ray
def test_a_killed_trainer_leaves_no_process_behind(tmp_path, small_config):
    """SIGKILL the trainer mid-run: its keeper ends the cluster (Ray's daemons, the generator)."""
    before = set(clusters_left())
    trainer, _, processes = start_training(tmp_path, small_config)
    trainer.kill()
    trainer.wait()
    trainer.stderr.close()
    assert_gone(processes, before)


@needs_ray
def test_a_lost_cluster_ends_the_run_in_one_line_exit_2(tmp_path, small_config):
    """SIGKILL the cluster's GCS and raylet mid-run: one line, exit 2, within seconds (Ray alone
    ends the driver after 60 s, exit 1, with pages of logs); nothing of the cluster left."""
    before = set(clusters_left())
    trainer, keeper, processes = start_training(tmp_path, small_config)
    for pid in members(keeper):
        if re.search(rb"gcs_server|raylet/raylet", Path(f"/proc/{pid}/cmdline").read_bytes()):
            os.kill(pid, signal.SIGKILL)
    try:
        code = trainer.wait(timeout=60)
    finally:
        trainer.kill()
    err = trainer.stderr.read().decode().strip().splitlines()
    assert code == 2, err[-5:]
    assert err[-1].startswith("gspo: error: rollout.placement=ray: the Ray cluster at")
    assert not [line for line in err if not line.startswith(("step ", "held-out", "gspo: error"))]
    assert_gone(processes, before)


# ------------------------------------------------------------------------ bad input
def _placement(tmp_path, *overrides):
    return load_config(None, [f"run.dir={tmp_path / 'run'}", "rollout.placement=ray", *overrides])


def _one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_ray_not_installed_is_one_line(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(UserError) as err:
        preflight.check_placement(_placement(tmp_path))
    assert "pip install 'gspo[ray]'" in _one_line(err)


@needs_ray
def test_an_unreachable_address_is_one_line(tmp_path):
    port = ray_cluster.free_port()                               # nothing listens there
    t0 = time.perf_counter()
    with pytest.raises(UserError) as err:
        preflight.check_placement(_placement(tmp_path, f"rollout.ray_address=127.0.0.1:{port}"))
    assert "no Ray cluster answers" in _one_line(err) and time.perf_counter() - t0 < 5
    with pytest.raises(UserError, match="expected host:port"):
        preflight.check_placement(_placement(tmp_path, "rollout.ray_address=ray://head:10001"))


@needs_ray
def test_more_generators_than_resources_is_one_line(tmp_path):
    with pytest.raises(UserError) as err:
        preflight.check_placement(_placement(tmp_path, "rollout.generators=1000"))
    assert "rollout.generators=1000 x rollout.generator_cpus=1 = 1000 CPUs" in _one_line(err)
    with pytest.raises(UserError, match="GPUs"):
        preflight.check_placement(_placement(tmp_path, "rollout.generator_gpus=1"))


def test_the_cli_refuses_before_training_exit_2(tmp_path, capsys):
    from gspo.cli import main
    port = ray_cluster.free_port()
    code = main(["train", f"run.dir={tmp_path / 'run'}", "rollout.placement=ray",
                 f"rollout.ray_address=127.0.0.1:{port}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("overrides, message", [
    (("rollout.async=true", "rollout.async_worker=process"), "rollout.async_worker=process"),
])
def test_what_ray_cannot_serve_is_refused(tmp_path, overrides, message):
    with pytest.raises(Exception, match=message):
        _placement(tmp_path, *overrides)


def test_the_async_worker_on_ray_is_a_thread(tmp_path):
    cfg = _placement(tmp_path, "rollout.async=true")
    assert cfg.rollout.async_worker == "thread"


# ------------------------------------------------------------------------ security
GRPC_PROBES = ("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo", "/ray.rpc.NodeManagerService/GetNodeStats",
               "/ray.rpc.ObjectManagerService/Pull", "/ray.rpc.CoreWorkerService/GetCoreWorkerStats",
               "/ray.rpc.RayletDriver/ClusterInfo")
"""A method of each server a Ray 2.60 node runs (GCS, raylet, object manager, worker, client
server); a server answers UNIMPLEMENTED for the others, before any authentication."""


LOOPBACK = re.compile(r"(::ffff:)?127\.|::1$")


def listeners(pids) -> set[tuple[str, int, str]]:
    """(address, port, process name) of every TCP socket ``pids`` listen on."""
    psutil = pytest.importorskip("psutil")
    out = set()
    for pid in pids:
        try:
            p = psutil.Process(pid)
            out |= {(c.laddr.ip, c.laddr.port, p.name()) for c in p.net_connections(kind="tcp")
                    if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue                                            # gone meanwhile
    return out


def refuses_without_token(host: str, port: int, token: str) -> str:
    """How the server at host:port answers a client without ``token``: 'refused' when every
    method it serves demands it (gRPC UNAUTHENTICATED, HTTP 401) and one of them works with it,
    else what it did."""
    import urllib.error
    import urllib.request
    grpc = pytest.importorskip("grpc")
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        served = []
        for method in GRPC_PROBES:
            call = channel.unary_unary(method)
            try:
                call(b"", timeout=5)
                return f"{method}: answered without the token"
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    continue
                if err.code() != grpc.StatusCode.UNAUTHENTICATED:
                    break                                       # not gRPC: HTTP below
                served.append(method)
            try:
                call(b"", timeout=5, metadata=[("authorization", f"Bearer {token}")])
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                    return f"{method}: refused the run's token too"
        if served:
            return "refused"
    try:
        urllib.request.urlopen(f"http://{host}:{port}/", timeout=5)
        return "HTTP: answered without the token"
    except urllib.error.HTTPError as err:
        return "refused" if err.code == 401 else f"HTTP {err.code}"
    except OSError as err:
        return f"neither gRPC nor HTTP: {err}"


@needs_ray
def test_the_local_cluster_refuses_a_client_without_the_runs_token():
    """Ray 2.60's servers listen beyond loopback whatever the node address: each server of the
    run's cluster that does (GCS, raylet, object manager, the generator's worker, the client
    server, the runtime-env agent) refuses a client without the run's token, on the address it
    listens on (the trainer's Ray worker too; its weight group's store listens on loopback
    only); the token is on no command line; the trainer's Ray settings are restored after."""
    from gspo.models.presets import build_model
    model, tokenizer = build_model("tiny-dense", 0)
    before = {k: os.environ.get(k) for k in ray_cluster.AUTH_VARS}
    engine = ray_generators.build("hf", model.eval(), tokenizer, ray_cluster.RaySpec(generators=1, cpus=1))
    try:
        token = engine.cluster.token
        assert len(token) == 64 and os.environ["RAY_AUTH_TOKEN"] == token
        processes = {q for p in members(engine.cluster.pgid) for q in {p, *descendants(p)}}
        found = listeners(processes | {engine.cluster.pgid, os.getpid()})     # the trainer's too
        names = {name for _, _, name in found}
        assert {"gcs_server", "raylet"} <= names and any("Generator" in n for n in names), names
        beyond = [(ip, port, name) for ip, port, name in found if not LOOPBACK.match(ip)]
        assert {"gcs_server", "raylet"} <= {name for _, _, name in beyond}
        for ip, port, name in sorted(beyond):
            host = "127.0.0.1" if ip in ("0.0.0.0", "::") else ip.removeprefix("::ffff:")
            assert refuses_without_token(host, port, token) == "refused", (ip, port, name)
        assert token not in Path(f"/proc/{engine.cluster.keeper.pid}/cmdline").read_text()
    finally:
        engine.close()
    assert {k: os.environ.get(k) for k in ray_cluster.AUTH_VARS} == before
    assert not clusters_left()
