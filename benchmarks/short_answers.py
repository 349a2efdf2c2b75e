"""Write custom-task JSONL files with short answers (2-3 characters) and score them, for `task.name=custom`.

    python benchmarks/short_answers.py runs/short/succ --shape succ   # train/validation/test.jsonl
    PYTHONPATH=benchmarks gspo train configs/default.yaml task.name=custom \
        task.train_file=runs/short/succ/train.jsonl task.test_file=runs/short/succ/test.jsonl \
        task.validation_file=runs/short/succ/validation.jsonl task.reward=short_answers:score

Task shapes like a user's own short-answer task (docs/short-answers.md): the reward
(`score`) is 1 when the completion is exactly the row's `target`, else 0. The `answer` column is
the SFT demonstration, written on the training split by a teacher that slips: each character
with chance `--noise` (default 0.2) becomes a random one of its kind (`--slip random`) or the
next one (`--slip shift`), a yes/no label becomes the other. The cold start learns the teacher's
mixture, so its most likely answer is mostly right and a sample often is not: better greedy than
sampled. Held-out splits carry the true answer.

* ``succ``: ``succ kqz=`` -> ``lra`` (each of 2-3 letters moved on by one);
* ``rev``: ``rev kqz=`` -> ``zqk``; ``sort``: ``sort qzk=`` -> ``kqz`` (three letters);
* ``ordered``: ``ord eqz?`` -> ``yes`` (are the three letters in order; half are);
* ``before``: ``bef kqa?`` -> ``no`` (is the first letter before the last);
* ``arith``: ``37+8=`` -> ``45`` (a two-digit number plus or minus a digit; tiny-dense's 300 SFT
  steps do not learn it: a cold start of 0.05).

Rows are generated (seeded: the same seed writes the same files); train, validation and test
share no prompt.
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path
from typing import Callable

NOISE = 0.2  # chance that the teacher writes any one character of a training answer at random


def rev(rng: random.Random) -> tuple[str, str]:
    w = "".join(rng.sample(string.ascii_lowercase, 3))
    return f"rev {w}=", w[::-1]


def sort(rng: random.Random) -> tuple[str, str]:
    w = "".join(rng.sample(string.ascii_lowercase, 3))
    return f"sort {w}=", "".join(sorted(w))


def succ(rng: random.Random) -> tuple[str, str]:
    w = "".join(rng.choice(string.ascii_lowercase[:-1]) for _ in range(rng.choice((2, 3))))
    return f"succ {w}=", "".join(chr(ord(c) + 1) for c in w)


def arith(rng: random.Random) -> tuple[str, str]:
    a, b, op = rng.randint(10, 99), rng.randint(1, 9), rng.choice("+-")
    return f"{a}{op}{b}=", str(a + b if op == "+" else a - b)


def ordered(rng: random.Random) -> tuple[str, str]:
    w = sorted(rng.sample(string.ascii_lowercase, 3))
    if rng.random() < 0.5:                            # half the words in order, half not
        while w == sorted(w):
            rng.shuffle(w)
    w = "".join(w)
    return f"ord {w}?", "yes" if w == "".join(sorted(w)) else "no"


def before(rng: random.Random) -> tuple[str, str]:
    w = "".join(rng.sample(string.ascii_lowercase, 3))
    return f"bef {w}?", "yes" if w[0] < w[2] else "no"


SHAPES: dict[str, Callable[[random.Random], tuple[str, str]]] = {"rev": rev, "sort": sort, "succ": succ, "arith": arith, "ordered": ordered, "before": before}


def random_slip(c: str, rng: random.Random) -> str:
    """A random character of the same kind (digit or letter)."""
    return rng.choice(string.digits if c.isdigit() else string.ascii_lowercase)


def shift_slip(c: str, rng: random.Random) -> str:
    """The next character ("z" and "9" wrap): one wrong answer, the same on every row."""
    kind = string.digits if c.isdigit() else string.ascii_lowercase
    return kind[(kind.index(c) + 1) % len(kind)]


LABELS = {"yes": "no", "no": "yes"}
SLIPS = {"random": random_slip, "shift": shift_slip}


def teacher(target: str, rng: random.Random, noise: float, slip: str) -> str:
    """The demonstration: each character of ``target`` slipped (``SLIPS[slip]``) with chance ``noise``."""
    if target in LABELS:                              # a label slips to the other label
        return LABELS[target] if rng.random() < noise else target
    return "".join(SLIPS[slip](c, rng) if rng.random() < noise else c for c in target)


def score(completion: str, target: str, **row) -> float:
    """1.0 when the completion is exactly the true answer (surrounding blanks ignored)."""
    return float(completion.strip() == target)


def rows(shape: str, n: int, rng: random.Random, seen: set[str], noise: float, slip: str) -> list[dict]:
    """``n`` rows of ``shape`` with prompts not in ``seen`` (added to it)."""
    out, tries = [], 0
    while len(out) < n:
        tries += 1
        if tries > 100 * n:
            raise SystemExit(f"{shape}: not enough distinct prompts for {n} more rows")
        prompt, target = SHAPES[shape](rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"prompt": prompt, "answer": teacher(target, rng, noise, slip),
                    "target": target})
    return out


def write(folder: str | Path, shape: str, n_train: int = 2000, n_eval: int = 200, seed: int = 0,
          noise: float = NOISE, slip: str = "random") -> None:
    """train.jsonl (flawed demonstrations), validation.jsonl and test.jsonl (true answers)."""
    rng, seen = random.Random(seed), set()
    splits = {"test": rows(shape, n_eval, rng, seen, 0.0, slip),
              "validation": rows(shape, n_eval, rng, seen, 0.0, slip),
              "train": rows(shape, n_train, rng, seen, noise, slip)}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, split in splits.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="add")
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-eval", type=int, default=200, help="rows of validation and of test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise", type=float, default=NOISE, help="teacher's slip chance per character")
    parser.add_argument("--slip", choices=sorted(SLIPS), default="random")
    args = parser.parse_args()
    write(args.folder, args.shape, args.n_train, args.n_eval, args.seed, args.noise, args.slip)
