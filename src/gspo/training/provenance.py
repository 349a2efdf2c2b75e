"""Provenance: what produced a run, written to ``RUN/provenance.json`` and checked against later.

A run folder says which code, libraries and hardware made it and which objective was in force::

    code          gspo version; git commit of the checkout gspo runs from, whether its source
                  (the package folder) differs from that commit and a hash of the difference;
                  'unknown' with the reason when gspo is not run from a git checkout
    libraries     Python, torch (+ CUDA), transformers, tokenizers, safetensors, pydantic;
                  peft / vLLM: their version when installed, else null
    hardware      device and dtype, CPU model, GPU name, world size (ranks)
    objective     its registry entry: name, algorithm, citation, equations, sequence level,
                  paper defaults, the hyper-parameters in force and the aggregation
    advantage     the advantage estimator (the algorithm's own description)
    sampling      rollout and evaluation sampling parameters
    config        the resolved config and its SHA-256
    hub           each hub id the config names (model.path, reward models, task.dataset): the commit of its
                  cached snapshot (null when not cached)

``gspo train`` writes it when it claims the run folder (rank 0; a resumed run keeps the earlier
sessions under ``history``), ``gspo compare`` into its output folder, ``gspo sft`` / ``gspo eval``
into ``--out``. ``check`` compares a run's record with the present: another objective
definition or aggregation is a ``ProvenanceError`` (one line, exit 2); other code, libraries,
hardware, advantage or sampling are warnings naming what differs. ``mixed_code`` tells
``gspo compare`` whether its runs came from one code. docs/provenance.md.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch
import transformers

import gspo
from gspo.core import objectives
from gspo import hub
from gspo.observe.provenance import FILE, code_id, read, sessions, summary, table  # noqa: F401
from gspo.training import algorithms
from gspo.errors import UserError
from gspo.storage import write_atomic

FORMAT = 1
LIBRARIES = ("tokenizers", "safetensors", "pydantic", "peft", "vllm")
"""Recorded by installed version (null when not installed); torch and transformers as imported."""
PACKAGE_DIR = Path(gspo.__file__).resolve().parent
GIT_TIMEOUT_S = 10.0


class ProvenanceError(UserError):
    """The run was made with another objective definition or aggregation than the present one."""


# ------------------------------------------------------------------------------------ collecting

def _git(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, timeout=GIT_TIMEOUT_S)


def _pip_commit() -> str | None:
    """The commit pip recorded when gspo was installed from a git URL (PEP 610), if any."""
    try:
        text = importlib.metadata.distribution("gspo").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return None
    return (json.loads(text).get("vcs_info") or {}).get("commit_id") if text else None


def _source_diff_sha256(top: Path, package: str) -> str | None:
    """SHA-256 of the package's changes against HEAD (tracked diff + untracked files, with their
    content); None when there are none."""
    diff = _git(["diff", "HEAD", "--binary", "--", package], top).stdout
    untracked = _git(["ls-files", "--others", "--exclude-standard", "-z", "--", package],
                     top).stdout.split(b"\0")
    untracked = sorted(p for p in untracked if p and not p.endswith(b".pyc"))  # no bytecode
    if not diff and not untracked:
        return None
    h = hashlib.sha256(diff)
    for name in untracked:
        h.update(b"\0" + name + b"\0" + (top / os.fsdecode(name)).read_bytes())
    return h.hexdigest()


NOT_A_CHECKOUT = "not run from a git checkout (an installed package?)"


def _checkout(package_dir: Path) -> tuple[dict | None, str]:
    """(commit, dirty, diff_sha256, source) of the git checkout that tracks ``package_dir``, or
    (None, why not)."""
    if not shutil.which("git"):
        return None, "git is not installed"
    top = _git(["rev-parse", "--show-toplevel"], package_dir)
    if top.returncode:
        problem = (top.stderr.decode(errors="replace").strip().splitlines() or ["?"])[0]
        return None, (NOT_A_CHECKOUT if "not a git repository" in problem
                      else f"git failed: {problem}")
    if _git(["ls-files", "--error-unmatch", "__init__.py"], package_dir).returncode:
        return None, NOT_A_CHECKOUT      # e.g. installed into an ignored folder of some repository
    root = Path(os.fsdecode(top.stdout.strip()))
    head = _git(["rev-parse", "HEAD"], root)
    if head.returncode:
        return None, f"git checkout {root} has no commit yet"
    diff = _source_diff_sha256(root, os.path.relpath(package_dir, root))
    return {"commit": head.stdout.decode().strip(), "dirty": diff is not None,
            "diff_sha256": diff, "source": f"git checkout {root}"}, ""


def code(package_dir: Path = PACKAGE_DIR) -> dict:
    """gspo's version and the git commit of the checkout it runs from (see the module doc)."""
    out = {"gspo": gspo.__version__, "commit": "unknown", "dirty": None, "diff_sha256": None,
           "source": None, "package": str(package_dir)}
    try:
        found, reason = _checkout(package_dir)
    except (OSError, subprocess.SubprocessError) as err:
        found, reason = None, f"git failed ({type(err).__name__}: {err})"
    if found is not None:
        return {**out, **found}
    pip = _pip_commit()
    if pip:
        return {**out, "commit": pip, "source": "pip install from git (direct_url.json)"}
    return {**out, "source": f"unknown: {reason}"}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def libraries() -> dict:
    """Python and library versions; CUDA / cuDNN as torch was built with them."""
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "cuda": torch.version.cuda, "cudnn": None}
    if torch.backends.cudnn.is_available():
        out["cudnn"] = torch.backends.cudnn.version()
    return {**out, **{name: _version(name) for name in LIBRARIES}}


def cpu_model() -> str:
    """The CPU's marketing name (Linux /proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware")) and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def hardware(device: str, dtype: str, world_size: int) -> dict:
    """Where the run computes: ``device`` as resolved (cpu, cuda:0...), its dtype, the ranks."""
    gpu = None
    if torch.cuda.is_available():  # the device's GPU, or the machine's first one for a CPU run
        gpu = torch.cuda.get_device_name(torch.device(device) if device.startswith("cuda") else 0)
    return {"device": device, "dtype": dtype, "world_size": world_size, "cpu": cpu_model(),
            "cpu_count": os.cpu_count(), "gpu": gpu,
            "gpu_count": torch.cuda.device_count() if gpu else 0,
            "platform": platform.platform()}


def objective_entry(cfg, algorithm) -> dict:
    """The objective of ``cfg`` (run by ``algorithm``, a ``gspo.training.algorithms`` instance) as the
    registry defines it, with the hyper-parameters in force."""
    entry = {"name": cfg.objective.name, "algorithm": type(algorithm).__name__}
    if algorithm.objective is None:   # sft, dpo: no policy-gradient loss from the registry
        summary = (type(algorithm).__doc__ or "").strip().splitlines()[:1]
        return {**entry, "registry": None, "summary": " ".join(summary)}
    spec, o = objectives.spec(algorithm.objective), cfg.objective
    resolved = objectives.resolve(spec.name, eps_low=o.eps_low, eps_high=o.eps_high,
                                  aggregation=o.aggregation, **o.params)
    return {**entry, "registry": spec.name, "paper": spec.paper, "equations": spec.equations,
            "sequence_level": spec.sequence_level, "defaults": dict(spec.defaults),
            "hyperparameters": resolved, "aggregation": resolved["aggregation"],
            "token_sum_norm": cfg.rollout.max_new_tokens}


def advantage_entry(algorithm) -> dict:
    """The algorithm's ``advantage_estimator()``; one that lacks it is recorded as such."""
    describe = getattr(algorithm, "advantage_estimator", None)
    if describe is None:
        return {"name": "unknown", "formula": f"{type(algorithm).__name__} does not describe its "
                                              "advantages (gspo.training.algorithms.Algorithm)"}
    return describe()


def hub_ids(paths: dict) -> dict:
    """``{key: {"id", "revision"}}`` for each of ``paths`` (key -> path) that is a hub id."""
    return {key: {"id": path, "revision": hub.cached_revision(path)}
            for key, path in paths.items() if hub.is_hub_id(path)}


def hub_entry(cfg) -> dict:
    """``{key: {"id", "revision"}}`` for each Hugging Face hub id ``cfg`` loads a checkpoint or dataset from."""
    paths = {"model.path": cfg.model.path,
             "model.tokenizer": None if cfg.model.path else cfg.model.tokenizer}
    paths.update({f"rewards.sources[{i}].path": s.path for i, s in enumerate(cfg.rewards.sources)
                  if s.type == "model"})
    out = hub_ids(paths)
    if cfg.task.name == "dataset" and hub.is_hub_id(cfg.task.dataset):
        out["task.dataset"] = {"id": cfg.task.dataset,
                               "revision": hub.cached_revision(cfg.task.dataset, "dataset")}
    return out


def config_sha256(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def collect(cfg=None, *, command: str, device: str | None = None, world_size: int = 1,
            extra: dict | None = None) -> dict:
    """This process's provenance for ``command``; with a TrainConfig ``cfg`` also its objective,
    advantage estimator, sampling and resolved config. ``device``: as resolved (default: the
    config's ``model.device`` as written)."""
    prov = {"format": FORMAT, "command": command,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "argv": sys.argv[1:], "code": code(), "libraries": libraries()}
    if cfg is not None:
        config = cfg.model_dump(mode="json")
        r, e = cfg.rollout, cfg.eval
        algorithm = algorithms.get(cfg.objective.name)(cfg)   # group-relative | ppo | sft
        prov.update({
            "hardware": hardware(device or cfg.model.device, cfg.model.dtype, world_size),
            "objective": objective_entry(cfg, algorithm),
            "advantage": advantage_entry(algorithm),
            "sampling": {"rollout": {"temperature": r.temperature, "top_p": r.top_p,
                                     "top_k": r.top_k, "max_new_tokens": r.max_new_tokens,
                                     "group_size": r.group_size,
                                     "prompts_per_step": r.prompts_per_step},
                         "eval": {"temperature": e.temperature, "k": e.k, "greedy_accuracy": True},
                         "seed": cfg.seed},
            "hub": hub_entry(cfg), "config_sha256": config_sha256(config), "config": config})
    elif device is not None:
        prov["hardware"] = hardware(device, "n/a", world_size)
    if extra:
        prov.update(extra)
    return prov


# ------------------------------------------------------------------------------------ the file

def write(folder: str | Path, prov: dict, *, resume: bool = False) -> Path:
    """Write ``folder/provenance.json`` atomically; ``resume``: the earlier sessions of the run
    (its previous file and that file's history) go under ``history``, oldest first."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if resume and (old := read(folder)) is not None:
        history = old.pop("history", [])
        prov = {**prov, "history": [*history, old]}
    path = folder / FILE
    write_atomic(path, json.dumps(prov, indent=1, ensure_ascii=False, default=str))
    return path


# ------------------------------------------------------------------------------------ comparing

def _fmt(value) -> str:
    return "absent" if value is None else repr(value) if isinstance(value, str) else str(value)


def _changed(label: str, before: dict, after: dict, keys=None) -> list[str]:
    """'label.key before -> after' for every key whose value differs."""
    keys = keys if keys is not None else sorted(set(before) | set(after))
    return [f"{label}{k} {_fmt(before.get(k))} -> {_fmt(after.get(k))}" for k in keys
            if before.get(k) != after.get(k)]


OBJECTIVE_KEYS = ("name", "algorithm", "registry", "equations", "sequence_level", "aggregation",
                  "token_sum_norm")
"""Objective fields that must match (besides every default and hyper-parameter); the citation
text only warns."""


def objective_differences(run: dict, now: dict) -> list[str]:
    """What makes ``now``'s objective another one than ``run``'s (empty: the same definition)."""
    if not run or not now:
        return []
    out = _changed("", run, now, OBJECTIVE_KEYS)
    out += _changed("defaults.", run.get("defaults") or {}, now.get("defaults") or {})
    out += _changed("hyperparameters.", run.get("hyperparameters") or {},
                    now.get("hyperparameters") or {},
                    sorted((set(run.get("hyperparameters") or {})
                            | set(now.get("hyperparameters") or {})) - {"aggregation"}))
    return out


def warnings_between(run: dict, now: dict) -> list[str]:
    """One line per kind of difference that does not change the objective."""
    out = []
    if summary(run) != summary(now):
        out.append(f"code: {summary(run)} -> {summary(now)}")
    libs = _changed("", run.get("libraries", {}), now.get("libraries", {}))
    if libs:
        out.append("libraries: " + ", ".join(libs))
    if run.get("hardware") and now.get("hardware"):
        hw = _changed("", run["hardware"], now["hardware"],
                      ("device", "dtype", "gpu", "world_size"))
        if hw:
            out.append("hardware: " + ", ".join(hw))
    ro, no = run.get("objective") or {}, now.get("objective") or {}
    if ro.get("paper") != no.get("paper") and ro and no:
        out.append(f"objective citation: {_fmt(ro.get('paper'))} -> {_fmt(no.get('paper'))}")
    for key in ("advantage", "sampling", "hub"):   # hub: another commit of a hub id now cached
        if run.get(key) and now.get(key):
            diff = _changed("", _flat(run[key]), _flat(now[key]))
            if diff:
                out.append(f"{key}: " + ", ".join(diff))
    if run.get("config") and now.get("config"):
        keys = [k for k in _changed("", _flat(run["config"]), _flat(now["config"]))
                if not k.startswith("run.")]
        if keys:
            out.append("config: " + ", ".join(keys))
    return out


def _flat(tree: dict, prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1}."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check(folder: str | Path, now: dict, *, action: str, warn: Callable[[str], None]) -> None:
    """Compare the run in ``folder`` with ``now`` before ``action`` (resume, audit): another
    objective definition or aggregation raises ProvenanceError naming what differs; other
    differences (code, libraries, hardware...) are passed to ``warn``, one line each."""
    run = read(folder)
    if run is None:
        warn(f"{folder}: no {FILE} (a run made before gspo recorded provenance): cannot check "
             f"that the {action} uses the run's objective and code")
        return
    where = Path(folder) / FILE
    for session in sessions(run):
        differ = objective_differences(session.get("objective"), now.get("objective"))
        if differ:
            raise ProvenanceError(
                f"{action}: the objective differs from the run's ({where}): {'; '.join(differ)} "
                f"(the run was made by {summary(session)}: use that code, or start a new run)")
    seen = []
    for session in sessions(run):
        for line in warnings_between(session, now):
            if line not in seen:
                seen.append(line)
                warn(f"{action}: differs from the run ({where}): {line}")


def mixed_code(runs: dict[str, Path]) -> dict[str, list[str]]:
    """{code id: the labels of the runs made with it}, over every session of every run."""
    by_code: dict[str, list[str]] = {}
    for label, folder in runs.items():
        prov = read(folder)
        for session in sessions(prov) if prov else [None]:
            labels = by_code.setdefault(code_id(session), [])
            if label not in labels:
                labels.append(label)
    return by_code
