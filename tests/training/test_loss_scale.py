"""Dynamic loss scaling (model.dtype=float16, gspo.training.loss_scale): a scaled step's
gradients equal the unscaled backward's before the optimizer (bit for bit: a power-of-two scale
is exact), a float16 gradient that underflows unscaled survives scaled, an overflowing update is
skipped, counted and backs the scale off (the weights untouched), finite updates grow it, and the
scale survives a state-dict round trip; float16 is resolved to float32 masters."""

import math

import pytest
import torch

from gspo.config import TrainConfig
from gspo.config.resolve import Environment, resolve
from gspo.training.loss_scale import LossScaler
from gspo.training.master_weights import MasterWeightsAdamW
from gspo.training.optim import MinibatchSteps, build_optimizer, build_scheduler, scaled


def _mlp(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1)).to(dtype)


def _loss(model, dtype=torch.float32):
    x = torch.linspace(-1, 1, 32, dtype=dtype).reshape(4, 8)
    return model(x).float().pow(2).mean()


def test_a_scaled_step_has_the_unscaled_gradients_bit_for_bit():
    """S = 2^16: every intermediate gradient is S times the unscaled one, exactly (multiplying
    by a power of two only moves the exponent), so dividing by S before the step gives them back."""
    plain, model = _mlp(), _mlp()
    _loss(plain).backward()
    opt = MasterWeightsAdamW(list(model.parameters()), loss_scaler=LossScaler(2.0 ** 16), lr=1e-3)
    scaled(_loss(model), opt).backward()
    params = opt.take_grads(opt.loss_scaler.scale)              # what the clip and the step read
    for got, want in zip(params, plain.parameters()):
        assert torch.equal(got.grad, want.grad)


def test_a_float16_gradient_that_underflows_unscaled_survives_scaled():
    """loss = 2^-30 · Σ w (float32): ∂loss/∂w = 2^-30, cast to float16 below float16's smallest subnormal 2^-24, so the
    unscaled float16 gradient is 0; with S = 2^16 it is 2^-14, unscaled exactly in float32."""
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    (w.float().sum() * 2.0 ** -30).backward()             # the loss in float32, as the trainer's
    assert (w.grad == 0).all()
    w.grad = None
    opt = MasterWeightsAdamW([w], loss_scaler=LossScaler(2.0 ** 16), lr=1e-3)
    scaled(w.float().sum() * 2.0 ** -30, opt).backward()
    (master,) = opt.take_grads(opt.loss_scaler.scale)
    assert master.grad.dtype == torch.float32 and (master.grad == 2.0 ** -30).all()


def _float16_steps(scale, interval=2000):
    model = _mlp(torch.float16)
    opt = build_optimizer(model, 1e-3, master_weights="float32")
    opt.loss_scaler.scale, opt.loss_scaler.growth_interval = scale, interval
    return model, opt, MinibatchSteps(opt, build_scheduler(opt, "constant", 0, 10), 1.0)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_an_overflowing_update_is_skipped_counted_and_backs_the_scale_off():
    """S = 2^24 times a loss gradient of order 1 exceeds float16's 65504: inf gradients."""
    model, opt, steps = _float16_steps(2.0 ** 24)
    before = [p.detach().clone() for p in model.parameters()]
    steps.step(_loss(model, torch.float16), model.parameters())
    assert steps.skipped == 1 and opt.loss_scaler.scale == 2.0 ** 23
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))   # never applied
    assert all(p.grad is None for p in model.parameters())
    for _ in range(16):                                        # backs off until the step fits
        steps.step(_loss(model, torch.float16), model.parameters())
    assert 1 < steps.skipped < 17 and opt.loss_scaler.good_steps == 17 - steps.skipped
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert steps.means()["optim/loss_scale"] > 0


def test_finite_updates_grow_the_scale_and_it_survives_a_state_dict_round_trip():
    model, opt, steps = _float16_steps(2.0 ** 8, interval=2)
    for _ in range(4):
        steps.step(_loss(model, torch.float16), model.parameters())
    assert steps.skipped == 0 and opt.loss_scaler.scale == 2.0 ** 10
    state = opt.state_dict()
    _, other, _ = _float16_steps(1.0)
    other.load_state_dict(state)
    assert other.loss_scaler.state_dict() == {"scale": 2.0 ** 10, "good_steps": 0}


def test_float16_parameters_need_float32_masters():
    with pytest.raises(ValueError, match="master_weights=float32"):
        build_optimizer(_mlp(torch.float16), 1e-3)
    assert build_optimizer(_mlp(), 1e-3, master_weights="float32").loss_scaler is None


def test_model_dtype_float16_resolves_to_float32_masters():
    out = resolve(TrainConfig(model={"dtype": "float16"}), Environment())
    assert out.config.train.master_weights == "float32" and "train.master_weights" in out.derived
    with pytest.raises(ValueError, match="master_weights=float32"):
        resolve(TrainConfig(model={"dtype": "float16"}, train={"master_weights": "model"}),
                Environment())


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_an_overflow_leaves_the_grad_norm_mean_finite_but_a_float32_inf_is_reported():
    """An update the loss scale dropped (finite loss, inf gradient) is left out of
    optim/grad_norm's mean, so the guard's nan rule does not discard the step (restoring the
    scale's back-off with it); without a loss scale an inf norm is reported as it is."""
    model, opt, steps = _float16_steps(2.0 ** 24)
    for _ in range(20):                                      # overflows until S fits, then steps
        norm = steps.step(_loss(model, torch.float16), model.parameters())
        steps.add({"optim/grad_norm": norm.detach(), "sft/loss": torch.tensor(1.0)})
    finite_norms = 20 - steps.skipped
    assert steps.skipped > 1 and finite_norms > 0
    assert [len(steps.collected["optim/grad_norm"]), len(steps.collected["sft/loss"])] == [finite_norms, 20]
    assert math.isfinite(steps.means()["optim/grad_norm"])

    model = _mlp(torch.float32)
    opt = build_optimizer(model, 1e-3)
    plain = MinibatchSteps(opt, build_scheduler(opt, "constant", 0, 10), 1.0)
    loss = (model(torch.ones(2, 8)) * float("inf")).sum()             # finite inputs, inf loss
    plain.add({"optim/grad_norm": plain.step(loss, model.parameters()).detach()})
    assert plain.skipped == 1 and not math.isfinite(plain.means()["optim/grad_norm"])
