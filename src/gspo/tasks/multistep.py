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
"""

from __future__ import annotations

import random
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
        self.direct_fraction, self.flawed_fraction = direct_fraction, flawed_fraction
        self._splits = make_splits(self.name, random.Random(seed), self._sample, n_train, n_test, n_val)

    def _sample(self, rng: random.Random) -> Example:
        k = rng.randint(self.min_terms, self.max_terms)
        nums = [rng.randint(1, self.max_value) for _ in range(k)]
        prompt = "S " + " ".join(map(str, nums)) + ":"
        flawed = _share(prompt, "flawed") < self.flawed_fraction
        shown = nums[:-1] if flawed else nums
        steps, total = [], shown[0]
        for x in shown[1:]:
            steps.append(f"{total}+{x}={total + x}")
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


def _share(prompt: str, salt: str) -> float:
    """A fixed pseudo-random number in [0, 1) per prompt (so prompts never depend on it)."""
    return zlib.crc32(f"{salt}:{prompt}".encode()) / 2**32
