"""What dali-train relies on from torch's internals, each named, so that a torch release that changes one fails
here with the contract it broke instead of as a silently wrong training run elsewhere.

The trainer skips a step whose loss or gradients are not finite without the host reading whether it is one
(trainer.optimizer_step): it hands the verdict to the fused optimizer as `optimizer.found_inf`, the attribute
torch's GradScaler sets for fp16 (torch/amp/grad_scaler.py), and keeps every optimizer fused and its state
where the fused kernels read it (trainer.skips_on_device)."""

from __future__ import annotations

import copy

import pytest
import torch

from dalifeed.train.trainer import skips_on_device

TORCH = f"torch {torch.__version__}"


def model_and_grads(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    model(torch.randn(5, 6)).square().sum().backward()
    return model


def fused(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = [t.clone() for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [p.detach().clone() for p in model.parameters()] + state


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_a_fused_optimizer_reads_found_inf_and_skips_on_the_device(name):
    model = model_and_grads()
    optimizer = skips_on_device(fused(name, model))
    optimizer.found_inf = torch.zeros(())
    optimizer.step()  # one step taken: the state exists
    before = snapshot(model, optimizer)
    optimizer.found_inf = torch.ones(())
    optimizer.step()
    after = snapshot(model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), (
        f"{TORCH}: a fused {name} step with optimizer.found_inf = 1 changed the weights or the optimizer's state; "
        f"dali-train's skipped steps (trainer.optimizer_step) rely on the fused kernels reading found_inf")
    optimizer.found_inf = torch.zeros(())
    optimizer.step()
    assert not torch.equal(snapshot(model, optimizer)[0], after[0]), (
        f"{TORCH}: a fused {name} step with optimizer.found_inf = 0 did not step")


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_a_group_made_fused_again_takes_found_inf(name):
    """An optimizer loaded from an unfused checkpoint keeps the checkpoint's groups, `fused` False among them:
    skips_on_device sets `param_groups[i]["fused"]` (and `foreach` None) again, and the step must then be
    the fused one, which reads found_inf; an unfused step ignores it."""
    model = model_and_grads()
    plain = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if name == "sgd" else
             torch.optim.AdamW(model.parameters(), lr=0.01))
    plain.step()
    saved = copy.deepcopy(plain.state_dict())
    optimizer = fused(name, model)
    optimizer.load_state_dict(saved)
    assert optimizer.param_groups[0]["fused"] in (False, None), f"{TORCH}: load_state_dict no longer takes the groups"
    skips_on_device(optimizer)
    before = snapshot(model, optimizer)
    optimizer.found_inf = torch.ones(())
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(model, optimizer))), (
        f"{TORCH}: after param_groups[i]['fused'] = True a {name} step ignored found_inf: the group flag no longer "
        f"selects the fused kernel (trainer.skips_on_device)")


@pytest.mark.kernels
def test_fused_sgds_skipped_first_step_keeps_the_zero_momentum_buffers_it_is_given():
    """Fused SGD's first step makes its momentum buffers with torch.empty_like when there are none, so a skipped
    first step would leave garbage in them: skips_on_device gives it zeros first, which the first taken step
    must use as a plain SGD's first step does (buffer = gradient)."""
    model = model_and_grads()
    reference = copy.deepcopy(model)  # a deep copy leaves the gradients behind
    for a, b in zip(reference.parameters(), model.parameters()):
        a.grad = b.grad.clone()
    optimizer = skips_on_device(fused("sgd", model))
    assert all(torch.equal(optimizer.state[p]["momentum_buffer"], torch.zeros_like(p)) for p in model.parameters())
    optimizer.found_inf = torch.ones(())
    optimizer.step()
    assert all(torch.equal(optimizer.state[p]["momentum_buffer"], torch.zeros_like(p)) for p in model.parameters()), (
        f"{TORCH}: a skipped fused SGD step changed the momentum buffers it was given")
    optimizer.found_inf = torch.zeros(())
    optimizer.step()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    plain.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, msg=lambda m: f"{TORCH}: fused SGD's first taken step after zero momentum "
                                                      f"buffers differs from plain SGD's: {m}")


def test_fused_adamws_step_count_lives_on_the_device_and_a_skipped_step_does_not_count():
    model = model_and_grads()
    optimizer = skips_on_device(fused("adamw", model))
    optimizer.found_inf = torch.zeros(())
    optimizer.step()
    optimizer.found_inf = torch.ones(())
    optimizer.step()
    for p in model.parameters():
        step = optimizer.state[p]["step"]
        assert step.device == p.device and step.dtype == torch.float32 and float(step) == 1.0, (
            f"{TORCH}: fused AdamW's step count is {step!r}; dali-train keeps it on the parameter's device in "
            f"float32, where its kernel counts and takes a skipped step back (trainer.skips_on_device)")
