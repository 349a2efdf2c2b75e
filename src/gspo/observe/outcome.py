"""What a run did to held-out greedy accuracy, said plainly: the change, its noise, a fall named as one.

``accuracy_change(before, after)`` compares two evaluations of the same ``n`` prompts (the dicts
of ``EvalResult.as_dict``) and gives the change with the standard error of one evaluation,
``sqrt(p (1 - p) / n)`` at p = the mean of the two accuracies (binomial; docs/short-answers.md, "Greedy
accuracy on short answers"). ``change_line`` is the sentence the CLI ends a run with; a fall is
always called a fall, and said to be beyond or within that standard error. This module judges
numbers it is given; it evaluates nothing.
"""

from __future__ import annotations

import math


def standard_error(accuracy: float, n: int) -> float:
    """Binomial standard error of an accuracy measured on ``n`` prompts."""
    return math.sqrt(accuracy * (1.0 - accuracy) / n) if n > 0 else float("nan")


def accuracy_change(before: dict, after: dict) -> dict:
    """{before, after, change, stderr, fell, beyond_stderr} of two greedy evaluations."""
    b, a = before["accuracy"], after["accuracy"]
    se = standard_error((a + b) / 2, min(before["n"], after["n"]))
    change = a - b
    return {"before": b, "after": a, "change": change, "stderr": se,
            "fell": change < 0, "beyond_stderr": abs(change) > se}


def change_line(change: dict, what: str) -> str:
    """One line: 'held-out accuracy fell: 0.770 (cold start) -> 0.593 after <what> (-17.7 points,
    beyond the evaluation's standard error 0.032)'; a rise or no change is not called a fall."""
    b, a, points, se = change["before"], change["after"], 100 * change["change"], change["stderr"]
    noise = "beyond" if change["beyond_stderr"] else "within"
    head = "held-out accuracy fell:" if change["fell"] else "held-out accuracy:"
    return (f"{head} {b:.3f} (cold start) -> {a:.3f} after {what} ({points:+.1f} points, "
            f"{noise} the evaluation's standard error {se:.3f})")


def best_line(best: dict | None, fell: bool) -> str | None:
    """Where the best checkpoint by validation is (``best``: trainer's summary entry), or, after a
    fall without a validation split, how to get one; None when there is nothing to say."""
    if best is None:
        return ("no validation split to choose a better checkpoint by: set task.validation_file "
                "(custom / dataset tasks) or task.n_val") if fell else None
    return (f"best checkpoint by validation: step {best['step']} (validation accuracy "
            f"{best['accuracy']:.3f}, held-out {best['test_accuracy']:.3f}): {best['checkpoint']}")
