"""The end-of-run verdict on held-out greedy accuracy (gspo.observe.outcome): a fall is called
one, beyond or within the standard error of one evaluation; a rise never is."""

import math

from gspo.observe.outcome import accuracy_change, best_line, change_line, standard_error


def _eval(accuracy: float, n: int) -> dict:
    return {"accuracy": accuracy, "n": n}


def test_standard_error_is_binomial():
    # sqrt(0.5 * 0.5 / 100) = 0.05; a certain outcome has none
    assert math.isclose(standard_error(0.5, 100), 0.05)
    assert standard_error(1.0, 200) == 0.0


def test_a_fall_beyond_the_noise_is_stated():
    # the run: 0.770 -> 0.593 on 200 prompts; p = (0.770 + 0.593) / 2 = 0.6815,
    # se = sqrt(0.6815 * 0.3185 / 200) = sqrt(0.00108528) = 0.032944
    change = accuracy_change(_eval(0.770, 200), _eval(0.593, 200))
    assert change["fell"] and change["beyond_stderr"]
    assert math.isclose(change["stderr"], 0.032944, abs_tol=1e-6)
    assert change_line(change, "200 gspo steps") == (
        "held-out accuracy fell: 0.770 (cold start) -> 0.593 after 200 gspo steps "
        "(-17.7 points, beyond the evaluation's standard error 0.033)")


def test_a_small_fall_is_still_a_fall_within_the_noise():
    # 0.80 -> 0.79 on 200: p = 0.795, se = sqrt(0.795 * 0.205 / 200) = 0.028551 > 0.01
    change = accuracy_change(_eval(0.80, 200), _eval(0.79, 200))
    assert change["fell"] and not change["beyond_stderr"]
    assert change_line(change, "1 gspo steps").startswith("held-out accuracy fell: 0.800")
    assert "(-1.0 points, within the evaluation's standard error 0.029)" in change_line(change, "x")


def test_a_rise_is_not_called_a_fall():
    # 0.5 -> 0.6 on 100: p = 0.55, se = sqrt(0.55 * 0.45 / 100) = 0.049749 < 0.1
    change = accuracy_change(_eval(0.5, 100), _eval(0.6, 100))
    line = change_line(change, "200 gspo steps")
    assert not change["fell"] and change["beyond_stderr"]
    assert "fell" not in line
    assert line == ("held-out accuracy: 0.500 (cold start) -> 0.600 after 200 gspo steps "
                    "(+10.0 points, beyond the evaluation's standard error 0.050)")
    assert "fell" not in change_line(accuracy_change(_eval(0.5, 100), _eval(0.5, 100)), "x")


def test_best_line_points_to_the_checkpoint_or_says_how_to_get_one():
    best = {"step": 125, "accuracy": 0.81, "test_accuracy": 0.77, "checkpoint": "runs/x/best"}
    assert best_line(best, fell=True) == ("best checkpoint by validation: step 125 (validation "
                                          "accuracy 0.810, held-out 0.770): runs/x/best")
    assert "task.validation_file" in best_line(None, fell=True)
    assert best_line(None, fell=False) is None
