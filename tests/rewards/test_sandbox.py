"""The reward sandbox: a worker process with wall-clock, CPU-time and memory limits and no network;
faults come back as RewardFault and the next call gets a fresh worker; `rewards.sandbox=true` routes
function rewards (and a custom task's reward) through it without importing them in-process."""

import sys
import textwrap

import pytest

from gspo.errors import RewardFault
from gspo.rewards.sandbox import Limits, SandboxedFunction

MODULE = "gspo_sandbox_probe"


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sandbox")
    (folder / f"{MODULE}.py").write_text(textwrap.dedent("""
        import socket, time
        def length(completion, **row): return len(completion) + row.get("bonus", 0)
        def boom(completion, **row): raise KeyError(completion)
        def none(completion, **row): return None
        def text(completion, **row): return "one"
        def nan(completion, **row): return float("nan")
        def sleepy(completion, **row):
            if completion == "slow":
                time.sleep(60)
            return 1.0
        def spin(completion, **row):
            while True:
                pass
        def hog(completion, **row): return len(bytearray(1 << 30))
        def dial(completion, **row):
            socket.create_connection(("127.0.0.1", 9), timeout=1)
            return 1.0
        def chatty(completion, **row):
            print("protocol? what protocol")
            return 2.0
    """))
    sys.path.insert(0, str(folder))
    yield lambda name, **limits: SandboxedFunction(f"{MODULE}:{name}", Limits(**limits))
    sys.path.remove(str(folder))


def test_values_and_rows_travel_as_json(probe):
    fn = probe("length")
    assert fn("abc", bonus=2) == 5.0
    assert probe("none")("x") is None                     # FunctionReward turns it into an error
    assert probe("nan")("x") != probe("nan")("x")         # NaN comes back as NaN
    assert probe("chatty")("x") == 2.0                    # prints do not corrupt the protocol
    assert MODULE not in sys.modules                      # never imported here


@pytest.mark.parametrize("name, reason", [
    ("boom", "KeyError: 'x'"),
    ("text", "returned str 'one', expected a number"),
    ("dial", "PermissionError: network access is disabled in the gspo reward sandbox"),
])
def test_faults_are_reported(probe, name, reason):
    with pytest.raises(RewardFault, match=reason):
        probe(name)("x")


def test_wall_clock_limit_kills_and_restarts(probe):
    fn = probe("sleepy", wall_s=0.5)
    with pytest.raises(RewardFault, match=r"timed out after 0.5 s \(sandbox worker killed\)"):
        fn("slow")
    assert fn("fast") == 1.0                               # a fresh worker


def test_cpu_time_limit(probe):
    fn = probe("spin", wall_s=20, cpu_s=1)
    with pytest.raises(RewardFault, match="exceeded the CPU-time limit of 1 s"):
        fn("x")


def test_memory_limit_names_the_limit(probe):
    """A MemoryError's own text is empty: the message says which limit was hit."""
    with pytest.raises(RewardFault) as err:
        probe("hog", memory_mb=256)("x")
    assert str(err.value) == ("MemoryError: the sandbox's memory limit was hit "
                              "(rewards.sandbox_memory_mb = 256 MB for the worker's whole address space)")


def test_network_is_cut(probe):
    assert probe("length").isolation in ("namespace", "socket-patch")


def test_import_errors_are_configuration_errors(probe):
    with pytest.raises(ValueError, match=f"cannot import '{MODULE}:missing': AttributeError"):
        probe("missing")
    with pytest.raises(ValueError, match="No module named 'no_such_module'"):
        SandboxedFunction("no_such_module:fn")


def test_reward_sandbox_config_routes_function_rewards(make_cfg, probe):
    from gspo.rollout.data import build_task
    from gspo.rewards.isolation import isolated_rewards
    from gspo.tasks import Example
    cfg = make_cfg(f"rewards.sources=[{{type: function, fn: '{MODULE}:length'}}]", "rewards.sandbox=true",
                   "rewards.on_error=zero")
    reward = isolated_rewards(cfg.rewards, build_task(cfg))
    (source, _), = reward.sources
    assert isinstance(source.source.fn, SandboxedFunction)
    assert reward(["ab", "abcd"], [Example("1=", "1")] * 2).total.tolist() == [2.0, 4.0]
    assert MODULE not in sys.modules


def test_custom_task_reward_in_the_sandbox(make_cfg, probe, tmp_path):
    from gspo.rollout.data import build_task
    (tmp_path / "train.jsonl").write_text('{"prompt": "1=", "answer": "1", "bonus": 10}\n')
    (tmp_path / "test.jsonl").write_text('{"prompt": "2=", "answer": "2", "bonus": 20}\n')
    cfg = make_cfg("task.name=custom", f"task.train_file={tmp_path / 'train.jsonl'}",
                   f"task.test_file={tmp_path / 'test.jsonl'}", f"task.reward={MODULE}:length",
                   "rewards.sandbox=true")
    task = build_task(cfg)
    example = task.split("test")[0]
    assert task.reward("abc", example) == 23.0
    assert MODULE not in sys.modules
