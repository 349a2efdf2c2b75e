"""The guessing game of tests/game_fakes.py written as a real openenv-core 0.3.0 environment:
``Environment``, ``Action`` and ``Observation`` subclasses of openenv's own, a typed ``EnvClient``
(the shape ``openenv init``'s template writes), and ``serve``, which runs openenv's own server
(``create_app`` under uvicorn) on 127.0.0.1 in a thread. Importable by module:callable from the
reset/step tests; imports openenv, so only where it is installed (make test-verifiers)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn
from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server import Action, Environment, Observation, State, create_app

from game_fakes import PROMPT, Game


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    feedback: str


class GuessEnv(Environment[GuessAction, GuessObservation, State]):
    """Each wrong guess: "higher" or "lower", reward -0.25; the right one: "right", done, reward 1."""

    SUPPORTS_CONCURRENT_SESSIONS = True    # one instance per session: no state is shared
    closed: list = []                      # the targets of the closed instances (the server closes its sessions')

    def __init__(self):
        super().__init__()
        self.game, self._state = Game(), State()

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self.game.start(seed)
        self._state = State(episode_id=episode_id)
        return GuessObservation(feedback=PROMPT)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        assert isinstance(action, GuessAction)
        self._state.step_count += 1
        answer, done = self.game.guess(action.guess)
        return GuessObservation(feedback=answer, done=done, reward=1.0 if done else -0.25)

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        GuessEnv.closed.append(self.game.target)


class GuessClient(EnvClient[GuessAction, GuessObservation, State]):
    """The game's typed client: its results' observations are ``GuessObservation``s."""

    def _step_payload(self, action: GuessAction) -> dict:
        return {"guess": action.guess}

    def _parse_result(self, payload: dict) -> StepResult[GuessObservation]:
        obs = GuessObservation(feedback=payload.get("observation", {}).get("feedback", ""),
                               done=payload.get("done", False), reward=payload.get("reward"))
        return StepResult(observation=obs, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict) -> State:
        return State(**payload)


@contextlib.contextmanager
def serve(max_sessions: int = 8):
    """openenv's server of ``GuessEnv`` on a free port of 127.0.0.1, in a thread: yields its URL;
    on exit the server stops and its thread is joined."""
    app = create_app(GuessEnv, GuessAction, GuessObservation, max_concurrent_envs=max_sessions)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("openenv's server did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        assert not thread.is_alive(), "openenv's server thread did not stop"
