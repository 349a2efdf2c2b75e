"""The verifiers v1 agent: an environment of the verifiers library's v1 API (0.4: a taskset of typed
tasks with ``@vf.reward`` functions, played by a harness program in a runtime) plays each agent
episode. verifiers' own machinery runs it: its interception server, its harness program (a
subprocess), its scoring of the trace; the model calls its interception server relays go to the
recording endpoint, so every token the harness gets is sampled by the run's engine and recorded.

    rollout: {episode: agent}
    agent:
      fn: verifiers_v1
      params: {env: {taskset: {id: my-taskset}, agent: {harness: {id: "null"}}}}
    rewards: {on_error: drop, sources: [{type: env}]}

``env`` is verifiers' own environment config (what ``vf-eval``'s ``--env.*`` flags and TOML files
set), validated by ``verifiers.v1.resolve_env_config``; an agent's runtime defaults to
``subprocess`` (a harness program on this machine; verifiers' own default is a remote sandbox),
and a taskset id may also be a module's dotted path (``gspo.envs.verifiers_v1_sum``).
At set-up the environment is built once (a failure is one line). Each episode:

* the task: the taskset's task type built from the example (its ``question`` column, else its
  prompt, as ``prompt``; every other column whose name is a field of the task's data: ``answer``,
  ``info``...). The rows come from the run's task; the taskset's own ``load()`` is not read.
* the model: a ``vf.ModelContext`` whose client is verifiers' relay client (``EvalClientConfig``)
  pointed at the episode's URL, its key passed in the process environment (``GSPO_AGENT_API_KEY``).
* ``env.run_episode(task, ctx)`` inside ``env.serving()``, in the episode's own event loop, on a
  shallow copy of the environment (``serving()`` keeps its interception server on the object, and
  the episodes of a batch run at once): each episode has its interception server, torn down with
  its harness program when the episode ends or is cancelled at ``agent.timeout_s``.
* at most ``max_concurrent`` episodes at once (16 by default): each is an interception server and
  a harness process of about 100 MB, and a batch's P·G episodes would otherwise all start
  together; the others wait their turn within ``agent.timeout_s``.
* the reward: the sum of the episode's traces' rewards (one trace for a single-agent
  environment), their metrics kept in the row's info. An episode verifiers does not finish ``ok``
  raises with its first error, so it is counted in ``agent/errors`` and gets no reward.

The harness program. verifiers runs a harness's program (a PEP 723 script) with an interpreter
``uv`` prepares for it, installing ``uv`` and the script's dependencies from the package index on
first use. With ``python: trainer`` (the default) a script whose declared dependencies are all
installed here runs with this interpreter instead (the built-in chat program's are verifiers' own:
openai, mcp, httpx...), so nothing is installed while a run collects; a script needing more falls
back to ``uv``. ``python: uv`` leaves verifiers' own preparation alone.

verifiers (0.4, the v1 API) is an optional extra (``pip install 'gspo[verifiers-v1]'``), imported
only when this agent is built; its classic API (0.3.x) is ``agent.fn=verifiers``
(``verifiers_env``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import hashlib
import importlib.metadata
import os
import re
import sys
import threading
import uuid

from gspo.errors import UserError
from gspo.optional import require
from gspo.rollout.episodes.agent import AGENTS
from gspo.tasks import Example
from gspo.tasks.custom import load_module

MODEL = "policy"
"""The model name the harness sends (the endpoint serves the run's policy under any name)."""
KEY_VAR = "GSPO_AGENT_API_KEY"
"""The environment variable verifiers' relay client reads the endpoint's key from."""
PYTHONS = ("trainer", "uv")


def env_config(vf, env: dict):
    """verifiers' environment config of ``env``, each agent's runtime ``subprocess`` unless set,
    a dotted taskset id under its flat alias (``taskset_alias``)."""
    raw = copy.deepcopy(dict(env or {}))
    raw.setdefault("agent", {})
    if isinstance(raw["agent"], dict):
        raw["agent"].setdefault("runtime", {"type": "subprocess"})
    taskset = raw.get("taskset")
    if isinstance(taskset, dict) and "." in str(taskset.get("id", "")):
        taskset["id"] = taskset_alias(taskset["id"])
    return vf.resolve_env_config(raw)


def taskset_alias(dotted: str) -> str:
    """verifiers' loader imports a taskset id as a top-level module (``my_taskset``, or its own
    ``verifiers.v1.tasksets.<id>``); a module inside a package (``gspo.envs.verifiers_v1_sum``) is
    imported here and registered under a flat alias of its name, which the loader then finds."""
    alias = "gspo_taskset__" + dotted.replace(".", "__")
    if alias not in sys.modules:
        sys.modules[alias] = load_module(dotted, f"agent.params.env.taskset.id={dotted}")
    return alias


def task_of(env, example: Example):
    """The taskset's task for ``example``: ``prompt`` its question (else its prompt), and every
    column named like a field of the task's data."""
    task_cls = type(env.taskset).task_type()
    data_cls = task_cls.data_type()
    fields = {k: v for k, v in example.data.items() if k in data_cls.model_fields and k != "prompt"}
    if "answer" in data_cls.model_fields and example.answer is not None and "answer" not in fields:
        fields["answer"] = example.answer
    fields["prompt"] = str(example.data.get("question", example.prompt))
    return task_cls(data_cls(**fields), env.taskset.config.task)


def script_dependencies(script: str) -> list[str] | None:
    """The ``dependencies`` of a PEP 723 script's metadata block, a TOML document in comment lines
    (None: the script has no such block, or Python 3.10 has no TOML reader: uv prepares it)."""
    try:
        import tomllib
    except ImportError:
        return None
    match = re.search(r"^# /// script\s*$(.*?)^# ///\s*$", script, re.M | re.S)
    if not match:
        return None
    body = "\n".join(line[2:] if line.startswith("# ") else line[1:] for line in match.group(1).strip("\n").splitlines())
    return list(tomllib.loads(body).get("dependencies", []))


def installed_here(requirements: list[str]) -> bool:
    """Whether every requirement is installed in this interpreter at a version it allows."""
    from packaging.requirements import Requirement
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            return False
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            return False
    return True


def run_programs_with_this_interpreter() -> None:
    """verifiers' subprocess runtime prepares a harness program with ``uv`` (installed on first
    use, the script's dependencies from the package index); a script whose dependencies are all
    installed here is written to verifiers' script folder and run by this interpreter instead.
    Once per process; scripts needing more go to verifiers' own preparation."""
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime
    own = SubprocessRuntime.prepare_uv_script
    if getattr(own, "gspo_trainer_python", False):
        return

    @functools.wraps(own)
    async def prepare(self, script, env=None, *, activate=True):
        text = script.decode() if isinstance(script, bytes) else script
        deps = script_dependencies(text)
        if deps is None or not installed_here(deps):
            return await own(self, script, env, activate=activate)
        path = f"{self.scripts_dir}/{hashlib.sha256(text.encode()).hexdigest()}.gspo.py"
        if not os.path.exists(path):                # episodes of a batch prepare it at once: each
            os.makedirs(self.scripts_dir, exist_ok=True)    # writes its own file, then renames it
            tmp = f"{path}.{uuid.uuid4().hex}.tmp"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        if not activate:
            return [sys.executable, path]
        # as verifiers activates its uv environment: this interpreter's environment first on the
        # PATH of the program and the commands it runs
        return ["sh", "-c", 'export VIRTUAL_ENV="$1" PATH="$1/bin:$PATH"; shift; exec "$@"', "gspo-python",
                sys.prefix, sys.executable, path]

    prepare.gspo_trainer_python = True
    SubprocessRuntime.prepare_uv_script = prepare


class Gate:
    """At most ``n`` episodes of this process at once, across the threads and event loops the
    episodes run in. A waiting episode blocks a daemon thread of its own, not its loop (no polling:
    dozens of waiting episodes would keep the trainer's interpreter busy, nor a pool whose threads
    the interpreter joins at exit); cancelled while waiting, the permit its thread still takes, or
    took a moment ago, is handed back."""

    def __init__(self, n: int):
        self.permits = threading.BoundedSemaphore(n)

    @contextlib.asynccontextmanager
    async def __call__(self):
        loop = asyncio.get_running_loop()
        got = loop.create_future()
        guard, state = threading.Lock(), {"abandoned": False, "handed": False}

        def take():
            self.permits.acquire()
            with guard:
                if state["abandoned"]:
                    self.permits.release()
                    return
                state["handed"] = True
            loop.call_soon_threadsafe(lambda: got.done() or got.set_result(None))

        threading.Thread(target=take, name="gspo-v1-gate", daemon=True).start()
        try:
            await got
        except BaseException:
            with guard:
                state["abandoned"] = True
                if state["handed"]:
                    self.permits.release()
            raise
        try:
            yield
        finally:
            self.permits.release()


class VerifiersV1Agent:
    """``agent(base_url, api_key, example)`` (async): one verifiers v1 episode, scored by its
    taskset. Pickled as its options: an asynchronous worker process builds the environment again."""

    def __init__(self, env, options: tuple, max_concurrent: int):
        self.env, self.options, self.gate = env, options, Gate(max_concurrent)

    def __reduce__(self):
        return verifiers_v1, self.options

    async def __call__(self, base_url: str, api_key: str, example: Example):
        vf = require("verifiers.v1", "agent.fn=verifiers_v1")
        os.environ[KEY_VAR] = api_key          # one key per batch: every episode of it sets the same
        client = vf.EvalClientConfig(base_url=base_url, api_key_var=KEY_VAR)
        ctx = vf.ModelContext(model=MODEL, client=client)
        env = copy.copy(self.env)              # its own interception server (serving() keeps it on the object)
        async with self.gate(), env.serving():
            episode = await env.run_episode(task_of(env, example), ctx)
        if not episode.ok:
            errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
            why = f"{errors[0].type}: {errors[0].message}" if errors else "not ok"
            raise RuntimeError(f"the verifiers episode failed: {why}".splitlines()[0][:300])
        metrics = {k: float(v) for t in episode.traces for k, v in t.metrics.items() if v is not None}
        return float(sum(t.reward for t in episode.traces)), {"verifiers_metrics": metrics}


@AGENTS.register("verifiers_v1")
def verifiers_v1(env: dict, python: str = "trainer", max_concurrent: int = 16) -> VerifiersV1Agent:
    """The v1 environment of ``env`` (verifiers' environment config: ``taskset``, ``agent``'s
    harness and runtime, timeouts), built once; ``python``: how harness programs run (module doc);
    ``max_concurrent``: episodes played at once (each is an interception server and a harness
    process, about 100 MB; the others wait their turn within ``agent.timeout_s``)."""
    if python not in PYTHONS:
        raise UserError(f"agent.params.python={python!r}: expected one of {', '.join(PYTHONS)}")
    if isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int) or max_concurrent < 1:
        raise UserError(f"agent.params.max_concurrent={max_concurrent!r}: expected a whole number >= 1")
    vf = require("verifiers.v1", "agent.fn=verifiers_v1")
    version = importlib.metadata.version("verifiers")
    if not re.match(r"0\.4\.", version):
        raise UserError(f"agent.fn=verifiers_v1 serves verifiers 0.4 (the v1 API); verifiers {version} is "
                        "installed: pip install 'gspo[verifiers-v1]' (agent.fn=verifiers is its classic API)")
    try:
        environment = vf.load_environment(env_config(vf, env))
    except Exception as err:  # noqa: BLE001  the environment's own failure, said in one line
        raise UserError(f"agent.params.env: verifiers could not build the environment: "
                        f"{type(err).__name__}: {err}".splitlines()[0][:300]) from None
    if python == "trainer":
        run_programs_with_this_interpreter()
    return VerifiersV1Agent(environment, (env, python, max_concurrent), max_concurrent)
