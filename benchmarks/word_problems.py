"""Write a GSM8K-style data set of one-step word problems as parquet files, for `task.name=dataset`.

    python benchmarks/word_problems.py runs/word-problems        # train.parquet, test.parquet
    gspo train configs/dataset_math.yaml

The columns are named as a user's data might be, `question` and `solution` (mapped to prompt and
answer by `task.columns`), plus `operation`; each solution shows one step and ends with GSM8K's
`#### n` line, which the `math` reward compares by value. Problems are generated from templates
(seeded, so the same seed writes the same files); train and test share no question.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import datasets

NAMES = ("Ana", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea")
ITEMS = ("apples", "books", "coins", "pens", "shells", "cards", "stamps", "marbles")
TEMPLATES = {  # operation -> (question, the step shown, result)
    "add": ("{n} has {a} {item} and gets {b} more. How many {item} does {n} have now?",
            "{a}+{b}={r}", lambda a, b: a + b),
    "sub": ("{n} has {a} {item} and gives away {b}. How many {item} are left?",
            "{a}-{b}={r}", lambda a, b: a - b),
    "mul": ("{n} fills {a} boxes with {b} {item} each. How many {item} is that?",
            "{a}*{b}={r}", lambda a, b: a * b),
}


def problem(rng: random.Random) -> dict:
    op = rng.choice(sorted(TEMPLATES))
    question, step, fn = TEMPLATES[op]
    a, b = rng.randint(2, 9), rng.randint(1, 9)
    if op == "sub":
        a, b = max(a, b), min(a, b)
    r = fn(a, b)
    fields = dict(n=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b, r=r)
    return {"question": question.format(**fields),
            "solution": step.format(**fields) + f"\n#### {r}", "operation": op}


def write(folder: str | Path, n_train: int = 2000, n_test: int = 200, seed: int = 0) -> None:
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < n_train + n_test:
        row = problem(rng)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows[n_test:]).to_parquet(str(folder / "train.parquet"))
    datasets.Dataset.from_list(rows[:n_test]).to_parquet(str(folder / "test.parquet"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write(args.folder, args.n_train, args.n_test, args.seed)
