"""`multistep`: sum a list of small numbers with worked steps, so response length varies.

Prompt `"S 12 7 31 5:"`, answer `"12+7=19,19+31=50,50+5=55#55"`: one running-sum step per term,
comma-separated, then `#` and the final sum. With the defaults (2..8 terms in 1..50) answers run
from 7 to ~75 characters. The verifier reads only the final answer after the last `#` (1.0 when
it equals the sum, 0.0 when wrong or when there is no `#`); it does not grade the steps, which
are there to make length and credit assignment matter.

`direct_fraction` makes some demonstrations skip the steps (`"#55"` only). A cold start on such a
mix knows both ways to answer but uses the short, unreliable one most of the time; RL with the
verifier can discover that writing the steps pays (responses grow longer as accuracy rises), the
way RL with verifiable rewards elicits worked reasoning in large models. Which examples are direct
is a fixed function of the prompt (a checksum), so the prompts themselves do not depend on it.

For long worked answers (`configs/long.yaml`): `labelled` names each number with a letter, so a
tiny model finds the next term by its letter rather than by counting positions, and
`flawed_min_terms` confines the flawed teacher to long lists, so the cold start's accuracy is set
by the share of short lists rather than by how far SFT got.
"""

from __future__ import annotations

import random
import string
import zlib

from gspo.tasks.base import Example, make_splits, pick_split, register


@register("multistep")
class MultiStep:
    """`S n1 n2 ... nk:` → running-sum steps `#` total."""

    name = "multistep"

    def __init__(
        self,
        seed: int = 0,
        n_train: int = 5000,
        n_test: int = 200,
        n_val: int = 0,
        min_terms: int = 2,
        max_terms: int = 8,
        max_value: int = 50,
        direct_fraction: float = 0.0,
        flawed_fraction: float = 0.0,
        flawed_min_terms: int = 0,
        labelled: bool = False,
    ):
        """
        seed: generator seed; the same seed gives the same splits.
        n_train, n_test, n_val: examples per split (disjoint by prompt; validation is for
            choosing hyper-parameters, e.g. the `gspo compare` grid, never test).
        min_terms, max_terms: how many numbers to add, drawn uniformly (answer length grows with it).
        max_value: numbers are drawn from 1..max_value.
        direct_fraction: share of demonstrations that give only "#total", without the steps.
        flawed_fraction: share of demonstrations from a flawed teacher that leaves out the last
            number (its steps and total are those of the list without it).
        flawed_min_terms: the flawed teacher errs only on lists of at least this many terms
            (0: on any list). Shorter lists are always demonstrated right, so a cold start that
            learned the steps answers them correctly and the longer ones partly: its greedy
            accuracy is set by the share of short lists rather than by a coin-flip decision.
        labelled: give each number a letter, `"S a12 b7 c31 d5:"` -> `"12+b7=19,19+c31=50,50+d5=55#55"`.
            Each step names the number it adds, so finding it in the prompt is a lookup of the next
            letter rather than a count of positions (which a tiny model gets wrong when numbers
            repeat); at most 26 terms.
        """
        if not 2 <= min_terms <= max_terms:
            raise ValueError(f"multistep: need 2 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
        if max_value < 1:
            raise ValueError(f"multistep: max_value must be >= 1, got {max_value}")
        if not 0.0 <= direct_fraction <= 1.0:
            raise ValueError(f"multistep: direct_fraction must be in [0, 1], got {direct_fraction}")
        self.min_terms, self.max_terms, self.max_value = min_terms, max_terms, max_value
        if not 0.0 <= flawed_fraction <= 1.0:
            raise ValueError(f"multistep: flawed_fraction must be in [0, 1], got {flawed_fraction}")
        if labelled and max_terms > len(LABELS):
            raise ValueError(f"multistep: labelled lists have at most {len(LABELS)} terms, "
                             f"got max_terms={max_terms}")
        if flawed_min_terms < 0:
            raise ValueError(f"multistep: flawed_min_terms must be >= 0, got {flawed_min_terms}")
        self.direct_fraction, self.flawed_fraction = direct_fraction, flawed_fraction
        self.flawed_min_terms, self.labelled = flawed_min_terms, labelled
        self._splits = make_splits(self.name, random.Random(seed), self._sample, n_train, n_test, n_val)

    def _sample(self, rng: random.Random) -> Example:
        k = rng.randint(self.min_terms, self.max_terms)
        nums = [rng.randint(1, self.max_value) for _ in range(k)]
        labels = LABELS if self.labelled else [""] * k
        prompt = "S " + " ".join(f"{label}{x}" for label, x in zip(labels, nums)) + ":"
        flawed = k >= self.flawed_min_terms and _share(prompt, "flawed") < self.flawed_fraction
        shown = nums[:-1] if flawed else nums
        steps, total = [], shown[0]
        for label, x in zip(labels[1:], shown[1:]):
            steps.append(f"{total}+{label}{x}={total + x}")
            total += x
        direct = _share(prompt, "direct") < self.direct_fraction
        answer = f"#{total}" if direct else ",".join(steps) + f"#{total}"
        return Example(prompt=prompt, answer=answer, data={"numbers": nums, "target": sum(nums)})

    def split(self, name: str) -> list[Example]:
        return pick_split(self.name, self._splits, name)

    def reward(self, completion: str, example: Example) -> float:
        _, sep, final = completion.strip().rpartition("#")
        return 1.0 if sep and final.strip() == str(example.data["target"]) else 0.0

    def is_correct(self, completion: str, example: Example) -> bool:
        return self.reward(completion, example) == 1.0


LABELS = list(string.ascii_lowercase)


def _share(prompt: str, salt: str) -> float:
    """A fixed pseudo-random number in [0, 1) per prompt (so prompts never depend on it)."""
    return zlib.crc32(f"{salt}:{prompt}".encode()) / 2**32
