"""The stability suite's crash rule and its claim (gspo.tools.compare_stats / compare), on metric
series written by hand: each case says where the crash starts and why."""

from __future__ import annotations

import pytest

from gspo.tools import compare, compare_stats as cs

RULE = cs.CRASH_DEFAULTS  # min_gain 0.10, fall 0.05, reward_fraction 0.5, window 5


@pytest.mark.parametrize("series, step", [
    # cold 0.30: gained (0.45 >= 0.40), then below 0.25 from step 30 on: crash at 30
    ([(0, 0.30), (10, 0.45), (20, 0.35), (30, 0.20), (40, 0.10)], 30),
    # fell below 0.25 at 20, recovered at 30, fell again at 40 and stayed: the crash is the last fall
    ([(0, 0.30), (10, 0.45), (20, 0.20), (30, 0.31), (40, 0.24)], 40),
    ([(0, 0.30), (10, 0.45), (20, 0.20), (30, 0.25)], None),      # 0.25 is not below 0.25: recovered
    ([(0, 0.30), (10, 0.39), (20, 0.0)], None),                   # gained 0.09 < 0.10: nothing to crash from
    ([(0, 0.30), (10, 0.10), (20, 0.50), (30, 0.40)], None),      # a dip before the gain is no crash
])
def test_accuracy_crash(series, step):
    assert cs.accuracy_crash(series, RULE["min_gain"], RULE["fall"]) == step


def test_reward_crash_needs_the_trailing_mean_to_stay_below_half_the_start():
    start = [(s, 0.6) for s in range(1, 6)]                         # start mean 0.6: the bar is 0.3
    # steps 6..: 0.0 each; the trailing 5-step mean at step 8 is (0.6*2 + 0)/5 = 0.24 < 0.3
    # (at step 7: 0.36), and it stays below: crash at 8
    assert cs.reward_crash(start + [(s, 0.0) for s in range(6, 16)], 0.5, 5) == 8
    back = start + [(s, 0.0) for s in range(6, 11)] + [(s, 0.6) for s in range(11, 16)]
    assert cs.reward_crash(back, 0.5, 5) is None                    # recovered by the end
    assert cs.reward_crash(start + [(6, 0.0)], 0.5, 5) is None      # too short to tell
    assert cs.reward_crash([(s, 0.0) for s in range(1, 20)], 0.5, 5) is None  # started at 0


def test_early_warnings():
    grad = [(1, 1.0), (2, 2.0), (3, 1.0), (4, 1.5), (5, 1.0), (6, 2.9), (7, 3.1), (8, 9.0)]
    # medians of the earlier values: step 6 -> 1.0 (2.9 < 3), step 7 -> 1.25 (3.1 < 3.75),
    # step 8 -> 1.5 (9.0 > 4.5): the spike is at 8; before 5 earlier values none is judged
    assert cs.first_spike(grad, 3.0, 5) == 8
    ent = [(s, 1.0) for s in range(1, 6)] + [(6, 1.4), (7, 0.6), (8, 0.3)]
    assert cs.first_excursion(ent, 0.5, 5) == 7                     # 0.6 < 1/1.5; 1.4 <= 1.5
    assert cs.first_excursion(ent[:5], 0.5, 5) is None


def _run(seed: int, final: float, crashed: bool, gate: bool, n: int = 200) -> dict:
    return {"seed": seed, "final_accuracy": final, "eval_n": n, "gate_reached": gate,
            "crash": {"crashed": crashed}, "collapsed": crashed, "steps_to_threshold": None}


def _variant(runs: list[dict]) -> dict:
    return {"runs": runs, "summary": cs.aggregate(runs)}


def test_crash_stats_reads_the_metric_rows():
    rows = [{"step": 0, "eval/accuracy": 0.3}]
    for s in range(1, 31):
        rows.append({"step": s, "reward/mean": 0.6 if s <= 15 else 0.05, "policy/entropy": 1.0,
                     "optim/grad_norm": 1.0 if s != 14 else 5.0,
                     **({"eval/accuracy": {10: 0.5, 20: 0.1, 30: 0.1}[s]} if s % 10 == 0 else {})})
    out = cs.crash_stats(rows, {})
    # accuracy: below 0.25 from step 20; reward: trailing mean < 0.3 from step 18 ((3*0.6+2*0.05)/5 = 0.38
    # at 17, (2*0.6+3*0.05)/5 = 0.27 at 18): the earlier, by reward
    assert out == {"crashed": True, "by": "reward", "step": 18, "grad_spike_step": 14,
                   "entropy_excursion_step": None}


@pytest.mark.parametrize("grpo_crash, gspo_crash, tight_crash, gate, verdict", [
    ([1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 0], True, "reproduced"),
    ([1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0], True, "inconclusive"),   # tight clip held too
    ([1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0], True, "refuted at this scale"),
    ([0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0], True, "inconclusive"),   # reached, nobody crashed
    ([1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 0], False, "regime not reached"),
])
def test_crash_claim_verdicts(grpo_crash, gspo_crash, tight_crash, gate, verdict):
    # finals: a crashed run ends at 0.1, a held one at 0.6 (200 prompts: two SEs of a difference ~0.1)
    final = lambda c: 0.1 if c else 0.6
    grpo = _variant([_run(s, final(c), bool(c), gate) for s, c in enumerate(grpo_crash)])
    gspo = _variant([_run(s, final(c) + 0.001 * s, bool(c), gate) for s, c in enumerate(gspo_crash)])
    tight = _variant([_run(s, final(c), bool(c), gate) for s, c in enumerate(tight_crash)])
    got, numbers = compare.claim_crash(gspo, grpo, tight)
    assert got == verdict, numbers


def test_paired_final_difference():
    a = _variant([_run(0, 0.6, False, True), _run(1, 0.5, False, True)])
    b = _variant([_run(0, 0.4, False, True), _run(1, 0.4, False, True), _run(2, 0.9, False, True)])
    p = compare.paired_final(a, b)
    # seeds 0, 1 only: differences 0.2, 0.1 -> mean 0.15, sample std 0.0707; at the means 0.55 and
    # 0.4: 2·sqrt(0.55·0.45/200 + 0.4·0.6/200) = 2·sqrt(0.0024375) = 0.09874
    assert (p["n"], p["diff"]) == (2, pytest.approx(0.15))
    assert p["std"] == pytest.approx(0.0707107, rel=1e-5) and p["two_se"] == pytest.approx(0.098742, rel=1e-4)


def test_the_report_lists_each_runs_crash_and_gate():
    from gspo.tools.compare_report import crash_section
    run = {**_run(0, 0.1, True, True), "crash": {"crashed": True, "by": "accuracy", "step": 40,
                                                  "grad_spike_step": 31, "entropy_excursion_step": None},
           "gate": {"moe/routing_change_rate": 0.061}}
    results = {"gate": {"moe/routing_change_rate": 0.05}, "crash_rule": dict(RULE), "claims": [],
               "variants": {"grpo": {"runs": [run]}}}
    lines = crash_section(results)
    assert lines[0] == "## Crashes"
    assert "| grpo seed 0 | yes (accuracy, step 40) | 31 | – | 0.061 | reached |" in lines
    assert crash_section({"claims": [], "variants": {}}) == []      # not a stability suite: nothing


def test_a_suite_with_an_unknown_crash_parameter_is_refused(tmp_path):
    from gspo.config import ConfigError
    suite = tmp_path / "s.yaml"
    suite.write_text("base: configs/default.yaml\nvariants: [{name: a}]\ncrash: {min_gian: 0.2}\n")
    with pytest.raises(ConfigError, match=r"crash has no parameter \['min_gian'\]; valid: min_gain, fall"):
        compare.load_suite(suite)
