"""How the top-level model's forward is timed, and what users still can do with their model.

A model class of the user's gets its class ``forward`` wrapped (no module hooks: PyTorch's
hooked call path costs more than the timing itself); one of torch's own classes at the top, or
a model whose instance has its own ``forward``, gets module hooks. Either way the model can
still be deep-copied (an EMA copy), pickled, scripted and inspected, and a copy's forward is
not counted as the model's.
"""

from __future__ import annotations

import copy
import inspect
import pickle
import types

import torch
import torch.nn.functional as F
from torch_producer_helpers import TinyModel, read_records, steps_of, summaries_of


class ScriptableModel(torch.nn.Module):
    """Its forward names a module global (``F``): scripting must resolve it here, not in ours."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.layer(x))


def _train(model: torch.nn.Module, steps: int, ema: list[torch.nn.Module] | None = None,
           fail_at: int = -1) -> None:
    """A loop with an optional EMA copy taken after the first steps and run every step after."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    for step in range(steps):
        try:
            out = model(x if step != fail_at else torch.randn(8, 3))  # wrong width: raises
        except RuntimeError:
            continue
        loss = F.mse_loss(out, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if ema is not None:
            if step == 2:
                ema.append(copy.deepcopy(model))
            if ema:
                with torch.no_grad():
                    ema[0](x)


def _forwards(records: list) -> int:
    return sum(s.count for s in summaries_of(records) if s.name == "forward")


def test_a_user_model_class_is_timed_by_its_wrapped_forward_and_restored_on_detach(
        attach, memory_bus) -> None:
    original = TinyModel.__dict__["forward"]
    att = attach()
    model = TinyModel()
    _train(model, steps=6)
    assert TinyModel.__dict__["forward"] is not original
    assert not model._forward_pre_hooks and not model._forward_hooks  # the fast call path
    att.detach()
    assert TinyModel.__dict__["forward"] is original
    records = read_records(memory_bus)
    assert _forwards(records) == 6 == len(steps_of(records))
    assert att.stats()["errors"] == 0


def test_a_wrapped_model_can_be_copied_pickled_scripted_and_inspected(attach, memory_bus) -> None:
    model = ScriptableModel()
    signature = inspect.signature(model.forward)
    att = attach()
    ema: list[torch.nn.Module] = []
    _train(model, steps=6, ema=ema)
    assert hasattr(ScriptableModel.forward, "__trainscope_original__") and ema
    assert inspect.signature(model.forward) == signature
    x = torch.randn(4, 16)
    expected = model(x)
    assert torch.equal(pickle.loads(pickle.dumps(model))(x), expected)
    assert torch.equal(torch.jit.script(model)(x), expected)
    att.detach()
    # Six steps and one call: seven forwards; the EMA copy's and the copies' are not the model's.
    assert _forwards(read_records(memory_bus)) == 7
    assert att.stats()["errors"] == 0


def test_a_torch_class_at_the_top_is_hooked_and_can_be_copied_and_pickled(
        attach, memory_bus) -> None:
    att = attach()
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    ema: list[torch.nn.Module] = []
    _train(model, steps=6, ema=ema)
    assert model._forward_pre_hooks
    assert getattr(torch.nn.Sequential.forward, "__trainscope_original__", None) is None
    x = torch.randn(4, 16)
    expected = model(x)
    assert torch.equal(pickle.loads(pickle.dumps(model))(x), expected)  # loaded: inert hooks
    att.detach()
    assert _forwards(read_records(memory_bus)) == 7
    assert att.stats()["errors"] == 0


def test_a_forward_set_on_the_instance_is_hooked_instead(attach, memory_bus) -> None:
    """As Accelerate does for mixed precision: the class's forward would not run."""
    att = attach()
    model = TinyModel()
    plain = model.forward
    model.forward = types.MethodType(lambda self, x: plain(x).float(), model)
    _train(model, steps=5)
    assert model._forward_pre_hooks
    assert getattr(TinyModel.forward, "__trainscope_original__", None) is None
    att.detach()
    assert _forwards(read_records(memory_bus)) == 5


def test_a_forward_that_raises_leaves_the_timing_of_later_ones_intact(
        attach, memory_bus) -> None:
    att = attach()
    model = TinyModel()
    _train(model, steps=8, fail_at=5)
    att.detach()
    records = read_records(memory_bus)
    assert len(steps_of(records)) == 7
    # The failed call is timed too (it ran until it raised), then every later one.
    assert _forwards(records) == 8
    assert att.stats()["errors"] == 0


class TokenModel(torch.nn.Module):
    """A language model's shape of input: integer token ids, batch × sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Flatten(),
                                        torch.nn.Linear(8 * 6, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.body(ids)


def test_the_wrapped_and_the_hooked_forward_count_the_same_samples_and_tokens(attach) -> None:
    """A model class of the user's is timed by its wrapped class forward, one of torch's own at
    the top by module hooks: both give each step its samples and tokens (integer inputs: batch
    × sequence), time every forward and leave the model's results alone."""
    from trainscope.transport.memory import MemoryBus

    ids = torch.randint(0, 50, (4, 6))
    steps = {}
    for name in ("wrapped", "hooked"):
        torch.manual_seed(0)
        model = TokenModel()
        model = model if name == "wrapped" else model.body  # Sequential: one of torch's own
        expected = model(ids)
        bus = MemoryBus()
        att = attach(bus=bus)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the model stays as it is
        for _ in range(5):
            out = model(ids)
            assert torch.equal(out, expected)
            out.sum().backward()
            optimizer.step()
        assert (model._forward_pre_hooks != {}) == (name == "hooked")
        att.detach()
        assert att.stats()["errors"] == 0
        records = read_records(bus)
        assert _forwards(records) == 5
        steps[name] = [(r.step, r.samples, r.tokens) for r in steps_of(records)]
    assert steps["wrapped"] == steps["hooked"] == [(i, 4, 24) for i in range(5)]
