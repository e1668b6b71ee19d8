"""One flat vector per model: parameters, grads and BatchNorm buffers as views."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from app.training.flat import FlatModel
from app.training.models import SmallCNN


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def test_vector_holds_params_then_float_buffers():
    model = _bn_model()
    expected = torch.cat([parameters_to_vector(model.parameters()), model[1].running_mean, model[1].running_var])
    flat = FlatModel(model)
    assert flat.num_params == sum(p.numel() for p in model.parameters())
    assert flat.num_buffers == 8  # running_mean + running_var, not the counter
    assert torch.equal(flat.vector, expected)
    assert flat.vector.data_ptr() == flat.vector.untyped_storage().data_ptr()  # owns its storage


def test_load_round_trip_changes_the_model():
    model = SmallCNN(1, 10)
    flat = FlatModel(model)
    new = torch.randn(flat.size)
    flat.load(new)
    assert torch.equal(parameters_to_vector(model.parameters()), new)
    flat.vector.zero_()
    assert all(p.abs().sum() == 0 for p in model.parameters())


def test_backward_writes_the_gradient_into_the_message():
    model = _bn_model()
    reference = _bn_model()
    flat = FlatModel(model)
    x, y = torch.randn(5, 1, 8, 8), torch.tensor([0, 1, 2, 0, 1])
    for _ in range(2):  # the second step must not accumulate
        flat.zero_grads()
        nn.functional.cross_entropy(model(x), y).backward()
    reference.zero_grad()
    nn.functional.cross_entropy(reference(x), y).backward()
    message = flat.pack_message()
    assert message.data_ptr() == flat.message.data_ptr()  # no copy of the gradient
    assert torch.allclose(message[: flat.num_params], parameters_to_vector(p.grad for p in reference.parameters()))
    assert torch.equal(message[flat.num_params :], flat.vector[flat.num_params :])
    assert not torch.equal(message[flat.num_params :], torch.cat([torch.zeros(4), torch.ones(4)]))


def test_adopt_repoints_the_model_without_a_copy():
    model = _bn_model()
    flat = FlatModel(model)
    grads = [p.grad for p in model.parameters()]
    new = torch.randn(flat.size)
    flat.adopt(new)
    assert flat.vector is new
    assert torch.equal(parameters_to_vector(model.parameters()), new[: flat.num_params])
    new.zero_()  # the model lives in the adopted tensor
    assert all(p.abs().sum() == 0 for p in model.parameters())
    assert all(b.abs().sum() == 0 for b in model.buffers() if b.is_floating_point())
    x, y = torch.randn(5, 1, 8, 8), torch.tensor([0, 1, 2, 0, 1])
    flat.zero_grads()
    nn.functional.cross_entropy(model(x), y).backward()
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))  # still views of message
    assert flat.pack_message()[flat.num_params :].equal(new[flat.num_params :])  # BN stats updated there


def test_grads_stay_views_of_the_message_through_steps_and_flips():
    model = _bn_model()
    flat = FlatModel(model)
    x, y = torch.randn(5, 1, 8, 8), torch.tensor([0, 1, 2, 0, 1])

    def step() -> torch.Tensor:
        flat.zero_grads()
        nn.functional.cross_entropy(model(x), y).backward()
        return flat.pack_message()

    def views_of(message: torch.Tensor) -> bool:
        start, end = message.data_ptr(), message.data_ptr() + message.numel() * message.element_size()
        return all(start <= p.grad.data_ptr() < end for p in model.parameters())

    sent = step()
    assert views_of(sent)
    kept = sent.clone()
    flat.flip()  # --overlap: `sent` is on the wire
    assert flat.message.data_ptr() != sent.data_ptr() and views_of(flat.message)
    x = torch.randn(5, 1, 8, 8)
    second = step()
    assert torch.equal(sent, kept)  # the next backward did not touch it
    assert not torch.equal(second[: flat.num_params], kept[: flat.num_params])
    flat.flip()
    assert flat.message.data_ptr() == sent.data_ptr() and views_of(sent)


def test_a_worker_pointed_at_kept_reply_buffers_makes_no_new_view_a_step(monkeypatch):
    """A worker's model follows the PS's reply buffers every step (own_buffers: the BatchNorm
    buffers stay in its own storage, their values copied): with the buffers' views kept, a step
    re-points the parameters and copies the buffers, and builds no view of anything."""
    model = _bn_model()
    flat = FlatModel(model, own_buffers=True)
    replies = [torch.randn(flat.size), torch.randn(flat.size)]
    flat.keep_views_of(replies)
    built = []
    views = FlatModel._views
    monkeypatch.setattr(FlatModel, "_views", staticmethod(lambda f, shapes: built.append(1) or views(f, shapes)))
    flat.adopt(replies[0])  # the first adopt points the buffers at own storage: views of `own`, once
    built.clear()
    for step in range(4):
        reply = replies[step % 2]
        flat.adopt(reply)
        assert model[0].weight.data_ptr() == reply.data_ptr()  # the parameters are the reply's
        assert torch.equal(model[1].running_var, reply[flat.num_params + 4 :])  # the buffers its values
        assert model[1].running_var.data_ptr() != reply[flat.num_params + 4 :].data_ptr()  # in own storage
    assert built == []


class _Branches(nn.Module):
    """Two heads, one of which a forward may skip: a parameter the backward does not reach."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.left, self.right = nn.Linear(6, 4), nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, both: bool = True) -> torch.Tensor:
        h = self.body(x).relu()
        return self.left(h) + self.right(h) if both else self.left(h)


def test_a_backward_under_writing_grads_writes_each_gradient_into_the_message_once():
    model, reference = _Branches(), _Branches()
    flat = FlatModel(model)
    flat.message.fill_(7.0)  # what an earlier push left in the slot: no zeroing is needed
    x = torch.randn(5, 6)
    with flat.writing_grads():
        model(x).square().sum().backward()
    reference(x).square().sum().backward()
    expected = parameters_to_vector(p.grad for p in reference.parameters())
    assert torch.allclose(flat.grads, expected)
    offset = 0
    for p in model.parameters():  # autograd kept the view it was handed: .grad is the message's
        assert p.grad.data_ptr() == flat.message[offset:].data_ptr()
        offset += p.numel()


def test_a_parameter_the_backward_skips_gets_zeros_and_a_backward_outside_still_adds():
    model = _Branches()
    flat = FlatModel(model)
    x = torch.randn(5, 6)
    with flat.writing_grads():
        model(x).sum().backward()
    with flat.writing_grads():  # the right head is not reached: its gradient is zeros, not the last one
        model(x, both=False).sum().backward()
    assert not any(model.right.weight.grad.flatten()) and not any(model.right.bias.grad)
    assert model.left.weight.grad.abs().sum() > 0
    once = flat.grads.clone()
    model(x, both=False).sum().backward()  # outside: autograd adds into .grad, as after zero_grads
    assert torch.allclose(flat.grads, 2 * once)
    assert model.left.weight.grad.data_ptr() == flat.message[model.body.weight.numel() + 4 :].data_ptr()


def _backward(flat: FlatModel, model: nn.Module, x: torch.Tensor) -> None:
    with flat.writing_grads():
        nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2, 0, 1])).backward()


def test_a_backward_on_the_cpu_proves_its_gradient_finite_as_it_writes_it():
    model = _bn_model()
    flat = FlatModel(model)
    _backward(flat, model, torch.randn(5, 1, 8, 8))
    flat.pack_message()
    proof = flat.finite_proof()
    assert proof is not None and proof.dtype == torch.bool and bool(proof)
    assert flat.finite_proof() is None  # once: the next message needs a backward of its own


def test_a_nan_in_a_gradient_or_a_buffer_is_never_proven_finite():
    model = _bn_model()
    flat = FlatModel(model)
    x = torch.randn(5, 1, 8, 8)
    x[0, 0, 0, 0] = float("nan")  # every gradient it reaches is NaN, and BatchNorm's running stats
    _backward(flat, model, x)
    flat.pack_message()
    assert not bool(flat.finite_proof())
    _backward(flat, model, torch.randn(5, 1, 8, 8))
    flat.buffers[0] = float("inf")  # a running stat gone bad: it travels behind the gradient
    flat.pack_message()
    assert not bool(flat.finite_proof())


def test_no_proof_for_a_message_the_backward_did_not_write_last():
    model = _bn_model()
    flat = FlatModel(model)
    _backward(flat, model, torch.randn(5, 1, 8, 8))
    flat.flip()  # the next backward's buffer: nothing wrote it
    flat.pack_message()
    assert flat.finite_proof() is None
    model2 = _bn_model()
    in_place = FlatModel(model2, accumulate=True)  # a GPU's way: autograd adds into the views, no hook
    _backward(in_place, model2, torch.randn(5, 1, 8, 8))
    in_place.pack_message()
    assert in_place.finite_proof() is None
    with pytest.raises(RuntimeError), flat.writing_grads():  # a backward that failed proves nothing
        raise RuntimeError("the forward failed")
    flat.pack_message()
    assert flat.finite_proof() is None
