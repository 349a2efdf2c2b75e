"""`reasoning_gym`: the procedural datasets of reasoning-gym as a task, scored by their own scorers.

`task.params: {dataset: NAME, config: {...}}` takes one generator
(`reasoning_gym.create_dataset(NAME, size=, seed=, **config)`), `{datasets: [{name, weight, config}]}`
a weighted mix (each split holds each dataset in proportion to its weight). Entries are drawn in
index order from the run's seed, test first, then train, then validation, each question kept once:
the splits are disjoint by question (two seeds of one generator can share most questions, so a
split never comes from a second seed). A generator with too few distinct questions is a one-line
error.

The prompt is the entry's question (`task.chat` renders it with the chat template; `system_prompt`
names one of reasoning-gym's own system prompts to put before it: a paragraph of the plain prompt,
a system turn under `task.chat`). The answer scored is the text
of the completion's last `<answer>...</answer>`, or the whole stripped completion when it has none;
the reward is the dataset's `score_answer` (in [0, 1]; a scorer that raises scores 0, counted in
`scorer_errors`, and per step in the metric `reward/scorer_errors`), and `is_correct` is a score
of exactly 1 (some scorers give partial credit).

Refused at set-up: a scorer known to accept junk (`game_of_life_halting`: any non-empty answer;
`coin_flip`: "0" for a probability of 0.3125), or one that gives 1.0 to a junk answer "", "x" or
"0" (not the reference itself) on its first entries, unless `allow_lenient_scorer`.
`flawed_fraction` makes a flawed teacher write a share of the training demonstrations one
character short (the reference answer with its last character left out; which questions, a fixed
function of the question). A cold start on such a mix knows the whole answer but often stops one
character early; the scorer gives the short answer no full marks, so RL has something it can fix.
Test and validation answers stay the reference (they are never demonstrated).

`no_reference` lists the datasets whose entries lack a reference answer (SFT is refused for them
in `gspo.rollout.data`). reasoning-gym is an optional extra (`pip install 'gspo[reasoning-gym]'`),
imported only when this task is built. Not a multi-turn environment: one question, one answer.
"""

from __future__ import annotations

import re
import zlib
from collections import Counter
from typing import Any

from gspo.optional import require
from gspo.tasks.base import Example, pick_split, register

KNOWN_LENIENT = {  # dataset -> what its scorer (reasoning-gym 0.1.25) gives full marks to
    "game_of_life_halting": "any non-empty answer",
    "coin_flip": '"0" for a probability of 0.3125',
}
JUNK = ("", "x", "0")  # answers a sound scorer never gives full marks (unless it is the reference)
PROBE_ENTRIES = 3  # entries per dataset the junk probe scores
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(completion: str) -> str:
    """The text of the last `<answer>...</answer>` in ``completion``, else the stripped completion."""
    found = _ANSWER.findall(completion)
    return (found[-1] if found else completion).strip()


def same_value(junk: str, reference: Any) -> bool:
    """Whether ``junk`` is the reference answer itself, as text or as a number ("0" and "0.0")."""
    text = str(reference).strip()
    try:
        return junk == text or float(junk) == float(text)
    except ValueError:
        return False


def share(question: str) -> float:
    """A fixed pseudo-random number in [0, 1) per question (so the splits never depend on it)."""
    return zlib.crc32(f"flawed:{question}".encode()) / 2**32


def dataset_specs(dataset: str | None, config: dict | None, datasets: list[dict] | None) -> list[dict]:
    """``[{name, weight, config}]`` from either form of the params; ValueError when both or none."""
    if (dataset is None) == (datasets is None):
        raise ValueError("reasoning_gym: set exactly one of task.params.dataset or task.params.datasets")
    if dataset is not None:
        return [{"name": dataset, "weight": 1.0, "config": dict(config or {})}]
    if config:
        raise ValueError("reasoning_gym: task.params.config goes with dataset; "
                         "with datasets, give each its own config")
    if not isinstance(datasets, list) or not datasets:
        raise ValueError("reasoning_gym: task.params.datasets must be a non-empty list of {name, weight, config}")
    specs = []
    for i, d in enumerate(datasets):
        if not isinstance(d, dict) or not isinstance(d.get("name"), str) or set(d) - {"name", "weight", "config"}:
            raise ValueError(f"reasoning_gym: datasets[{i}] must be {{name, weight, config}}, got {d!r:.80}")
        weight = d.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or weight <= 0:
            raise ValueError(f"reasoning_gym: datasets[{i}].weight must be > 0, got {weight!r}")
        specs.append({"name": d["name"], "weight": float(weight), "config": dict(d.get("config") or {})})
    if len({s["name"] for s in specs}) < len(specs):
        raise ValueError("reasoning_gym: a dataset is named twice in task.params.datasets")
    return specs


def shares(n: int, weights: list[float]) -> list[int]:
    """``n`` split by ``weights`` (largest remainder; the counts sum to ``n``)."""
    exact = [n * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])[: n - sum(counts)]:
        counts[i] += 1
    return counts


@register("reasoning_gym")
class ReasoningGym:
    """Questions of reasoning-gym datasets, each scored by its dataset's own `score_answer`."""

    name = "reasoning_gym"

    def __init__(self, seed: int = 0, n_train: int = 1000, n_test: int = 100, n_val: int = 0,
                 dataset: str | None = None, config: dict | None = None,
                 datasets: list[dict] | None = None, system_prompt: str | None = None,
                 allow_lenient_scorer: bool = False, flawed_fraction: float = 0.0):
        """
        seed: reasoning-gym's seed; the same seed gives the same splits.
        n_train, n_test, n_val: questions per split (disjoint by question).
        dataset, config: one reasoning-gym dataset by name and its generator options.
        datasets: instead, a weighted mix: [{name, weight, config}].
        system_prompt: one of reasoning_gym.utils.SYSTEM_PROMPTS put before each question (None: none).
        allow_lenient_scorer: keep a dataset whose scorer gives full marks to junk answers.
        flawed_fraction: share of training demonstrations from a flawed teacher that leaves out the
            answer's last character.
        """
        rg = require("reasoning_gym", "task.name=reasoning_gym")
        self.specs = dataset_specs(dataset, config, datasets)
        if min(n_train, n_test, n_val) < 0:
            raise ValueError(f"reasoning_gym: n_train, n_test, n_val must be >= 0, got {n_train}, {n_test}, {n_val}")
        from reasoning_gym.utils import SYSTEM_PROMPTS as prompts   # (the package is installed: require)
        if system_prompt is not None and system_prompt not in prompts:
            raise ValueError(f"reasoning_gym: unknown system_prompt {system_prompt!r}; valid: {', '.join(prompts)}")
        self.system_prompt = prompts[system_prompt] if system_prompt else None
        if not 0.0 <= flawed_fraction <= 1.0:
            raise ValueError(f"reasoning_gym: flawed_fraction must be in [0, 1], got {flawed_fraction}")
        self.flawed_fraction = flawed_fraction
        self.seed, self.scorer_errors, self.new_errors = seed, Counter(), 0
        self._made, self._entries = {}, {}   # name -> its dataset; (name, index) -> its entry
        if not allow_lenient_scorer:
            for s in self.specs:
                self.check_scorer(rg, s)
        self._splits = self._draw(rg, {"test": n_test, "train": n_train, "validation": n_val})
        self.no_reference = sorted({ex.data["dataset"] for exs in self._splits.values() for ex in exs
                                    if not ex.data["has_answer"]})

    def _make(self, rg, spec: dict, size: int):
        try:
            return rg.create_dataset(spec["name"], size=size, seed=self.seed, **spec["config"])
        except Exception as err:  # unknown name, bad config: reasoning-gym's own message
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"reasoning_gym: dataset {spec['name']!r}: {first[:200]}") from None

    def check_scorer(self, rg, spec: dict) -> None:
        """ValueError when the dataset's scorer gives 1.0 to a junk answer on its first entries."""
        name = spec["name"]
        if name in KNOWN_LENIENT:
            raise ValueError(f"reasoning_gym: {name}'s scorer accepts {KNOWN_LENIENT[name]}; "
                             f"set task.params.allow_lenient_scorer=true to train on it anyway")
        ds = self._make(rg, spec, PROBE_ENTRIES)
        for idx in range(PROBE_ENTRIES):
            entry = ds[idx]
            for junk in JUNK:
                if same_value(junk, entry.get("answer")):
                    continue
                try:
                    score = float(ds.score_answer(junk, entry))
                except Exception:  # noqa: BLE001  a scorer that raises on junk rejects it
                    continue
                if score >= 1.0:
                    raise ValueError(f"reasoning_gym: {name}'s scorer gives 1.0 to the junk answer "
                                     f"{junk!r}; set task.params.allow_lenient_scorer=true to train on it anyway")

    def _draw(self, rg, sizes: dict[str, int]) -> dict[str, list[Example]]:
        """Each split's share of each dataset, in index order, every question kept once."""
        weights = [s["weight"] for s in self.specs]
        quota = {split: shares(n, weights) for split, n in sizes.items()}
        out: dict[str, list[Example]] = {split: [] for split in sizes}
        seen: set[str] = set()
        for i, spec in enumerate(self.specs):
            need = sum(quota[split][i] for split in sizes)
            budget = 4 * need + 100   # entries tried before the generator counts as exhausted
            ds = self._made[spec["name"]] = self._make(rg, spec, max(budget, 1))
            idx = 0
            for split in sizes:
                got = 0
                while got < quota[split][i]:
                    if idx == budget:
                        raise ValueError(
                            f"reasoning_gym: {spec['name']} gave only {len(seen)} distinct questions in "
                            f"{budget} entries, {need} needed; lower task.n_train/n_test or widen its config")
                    entry, idx = ds[idx], idx + 1
                    if entry["question"] not in seen:
                        seen.add(entry["question"])
                        out[split].append(self._example(spec["name"], idx - 1, entry, split))
                        got += 1
        return out

    def _example(self, name: str, idx: int, entry: dict, split: str) -> Example:
        self._entries[name, idx] = entry
        answer = entry.get("answer")
        data = {"dataset": name, "index": idx, "has_answer": answer is not None}
        demo = "" if answer is None else str(answer)
        if split == "train" and share(entry["question"]) < self.flawed_fraction:
            demo, data["flawed"] = demo[:-1], True   # the flawed teacher stops one character short
        prompt = entry["question"]
        if self.system_prompt is not None:   # plain: one text; chat: a system turn (gspo.rollout.chat)
            prompt = f"{self.system_prompt}\n\n{entry['question']}"
            data["messages"] = [{"role": "system", "content": self.system_prompt},
                                {"role": "user", "content": entry["question"]}]
        return Example(prompt=prompt, answer=demo, data=data)

    def split(self, name: str) -> list[Example]:
        return pick_split(self.name, self._splits, name)

    def score(self, completion: str, example: Example, count: bool = True) -> float:
        """The dataset's `score_answer` of the extracted answer; an exception scores 0 (counted
        when ``count``: once per sample, by the reward)."""
        name = example.data["dataset"]
        ds, entry = self._made[name], self._entries[name, example.data["index"]]
        try:
            value = float(ds.score_answer(extract_answer(completion), entry))
        except Exception:  # noqa: BLE001  e.g. prime_factorization on a non-number
            if count:
                self.scorer_errors[name] += 1
                self.new_errors += 1
            return 0.0
        return min(max(value, 0.0), 1.0)

    def reward(self, completion: str, example: Example) -> float:
        return self.score(completion, example)

    def is_correct(self, completion: str, example: Example) -> bool:
        return self.score(completion, example, count=False) == 1.0   # the reward counted it

    def take_counts(self) -> dict[str, float]:
        """``reward/scorer_errors``: rewards whose scorer raised since the last call."""
        counts, self.new_errors = {"reward/scorer_errors": float(self.new_errors)}, 0
        return counts

