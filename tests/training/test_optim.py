"""gspo.training.optim.MinibatchSteps: the one minibatch-steps helper of every algorithm (the RL
step, PPO's critic, SFT, DPO): a finite loss steps, a NaN/Inf loss or gradient is skipped and
counted with its gradient dropped, the scheduler advances either way; metrics averaged."""

import pytest
import torch

from gspo.training.optim import MinibatchSteps, build_optimizer, build_scheduler


def _parts(lr=0.5):
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -1.0]]))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return model, opt, build_scheduler(opt, "constant", 0, 10)


def test_a_finite_loss_steps_and_a_nan_one_is_skipped_and_counted():
    model, opt, sched = _parts()
    steps = MinibatchSteps(opt, sched, max_norm=100.0)
    x = torch.tensor([[1.0, 2.0]])
    # loss = w·x = 1 - 2 = -1; ∇_w = x = (1, 2), |∇| = √5 < 100: SGD w ← w - 0.5·x = (0.5, -2)
    norm = steps.step(model(x).sum(), model.parameters())
    assert norm.item() == pytest.approx(5 ** 0.5)
    assert model.weight.tolist() == [[0.5, -2.0]]
    steps.step(model(x).sum() * float("nan"), model.parameters())   # skipped: weights unchanged
    assert model.weight.tolist() == [[0.5, -2.0]] and steps.skipped == 1
    assert model.weight.grad is None                                 # the NaN gradient dropped
    assert sched.last_epoch == 2                                     # advanced either way


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_a_non_finite_gradient_is_skipped_though_the_loss_is_finite():
    model, opt, sched = _parts()
    steps = MinibatchSteps(opt, sched, max_norm=1.0)
    model.weight.register_hook(lambda g: g * float("inf"))
    steps.step(model(torch.tensor([[1.0, 2.0]])).sum(), model.parameters())
    assert model.weight.tolist() == [[1.0, -1.0]] and steps.skipped == 1


def test_means_average_each_metric_over_the_minibatches():
    model, opt, sched = _parts()
    steps = MinibatchSteps(opt, sched, max_norm=1.0)
    steps.add({"a": torch.tensor(1.0), "b": torch.tensor(2, dtype=torch.int64)})
    steps.add({"a": torch.tensor(3.0), "b": torch.tensor(5, dtype=torch.int64)})
    assert steps.means() == {"a": 2.0, "b": 3.5}


def test_the_clip_is_the_callers():
    """The RL step clips through its ranks (Dist.clip_grad_norm); the helper calls what it is given."""
    model, opt, sched = _parts()
    seen = []
    steps = MinibatchSteps(opt, sched, max_norm=0.25,
                           clip=lambda params, max_norm: seen.append(max_norm) or torch.tensor(1.0))
    steps.step(model(torch.tensor([[1.0, 2.0]])).sum(), model.parameters())
    assert seen == [0.25] and steps.skipped == 0


def test_build_optimizer_steps_only_trainable_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].requires_grad_(False)
    opt = build_optimizer(model, 1e-3)
    assert sum(len(g["params"]) for g in opt.param_groups) == 2
