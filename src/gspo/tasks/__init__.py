"""Built-in verifiable tasks and their registry.

`build("arithmetic", seed=0)` returns a `Task`: seeded `split("train" | "test")` lists of
`Example(prompt, answer, data)` (disjoint by prompt) and a verifier (`reward`, `is_correct`).
Prompts and answers are short plain ASCII, sized for tiny character-level models. Built in:
`arithmetic`, `multistep`, `countdown`, `dataset` (local JSONL / JSON / parquet / CSV / arrow files
through Hugging Face datasets), `custom` (its JSONL form, read line by line, with a user reward
function), `reasoning_gym` (reasoning-gym's datasets and scorers, an optional extra), and the
tool-use tasks `calculator`, `lookup`, `guess` (multi-turn: `gspo.envs`). A new task is a class
with those methods under `@register("name")`. Reward composition lives in `gspo.rewards.sources`.

The tasks layer never imports torch, models, rewards or anything above: tasks are plain Python
over strings (import-linter); only `gspo.errors`, `gspo.registry` and `gspo.optional` are below it.
"""

from gspo.tasks.base import (
    Example,
    Task,
    TaskDataError,
    available,
    build,
    get,
    register,
    task_counts,
)

# Built-in tasks register themselves on import.
from gspo.tasks import arithmetic, countdown, dataset, multistep, reasoning_gym, tooluse  # noqa: E402,F401  isort: skip

__all__ = ["Example", "Task", "TaskDataError", "available", "build", "get", "register", "task_counts"]
