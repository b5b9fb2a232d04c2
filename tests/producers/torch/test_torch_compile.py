"""``attach()`` beside ``torch.compile``: the compiled model is traced once, whole, and timed.

torch.compile (TorchDynamo) traces a model's Python code and everything it calls, module hooks
included, and guards the compiled code on the hooks it saw. Anything of ours that it traces
and cannot compile splits the user's graph (a graph break: compiled pieces with Python between
them, every step), and hooks that change after the first call make it compile the model again.
The backend here is ``aot_eager`` (Dynamo's tracing and guards, AOTAutograd's backward, no C++
compiler needed): graph breaks and recompiles are Dynamo's, whatever the backend.
"""

from __future__ import annotations

import warnings

import torch
from torch_producer_helpers import TinyModel, read_records, steps_of, summaries_of, train

STEPS = 12


def _compiled_run(attach, memory_bus, model: torch.nn.Module) -> tuple[dict, list]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    att = attach(window_s=0.5)
    with warnings.catch_warnings(record=True) as caught:  # the filters as the script has them
        train(model, steps=STEPS)
    att.detach()
    graphs = {"breaks": sum(counters["graph_break"].values()),
              "graphs": counters["stats"]["unique_graphs"],
              "warnings": [str(w.message) for w in caught if "global hooks" in str(w.message)]}
    return graphs, read_records(memory_bus)


def test_a_compiled_model_is_traced_once_without_breaks_and_timed_every_step(
        attach, memory_bus) -> None:
    graphs, records = _compiled_run(attach, memory_bus,
                                    torch.compile(TinyModel(), backend="aot_eager"))
    # Before: 5 graph breaks (our discovery hooks, traced inside the model, called
    # threading.get_ident) and a second compile of the whole model once they were removed.
    assert graphs == {"breaks": 0, "graphs": 1, "warnings": []}
    forwards = [s for s in summaries_of(records) if s.name == "forward"]
    assert sum(s.count for s in forwards) == STEPS  # the compiled call, once a step
    assert sum(s.count for s in summaries_of(records) if s.name == "backward") == STEPS
    assert len(steps_of(records)) == STEPS


def test_a_model_that_compiles_a_part_of_itself_is_timed_as_before(attach, memory_bus) -> None:
    """A script's own model whose body is compiled: the top is the script's class (its forward
    wrapped, eager), the compiled body inside it is traced once."""
    model = TinyModel()
    model.body = torch.compile(model.body, backend="aot_eager")
    graphs, records = _compiled_run(attach, memory_bus, model)
    assert graphs == {"breaks": 0, "graphs": 1, "warnings": []}
    assert sum(s.count for s in summaries_of(records) if s.name == "forward") == STEPS
    assert len(steps_of(records)) == STEPS



def test_a_model_compiled_in_place_is_not_broken_and_its_phases_go_untimed(
        attach, memory_bus) -> None:
    """``model.compile()`` compiles the module's whole call, its hooks included: there is no
    eager point left to time its forward at, nor to find it by (docs/producers.md). The job is
    not slowed: one graph, no break; its steps are recorded, its forward and backward not."""
    model = TinyModel()
    model.compile(backend="aot_eager")
    graphs, records = _compiled_run(attach, memory_bus, model)
    assert graphs == {"breaks": 0, "graphs": 1, "warnings": []}
    assert len(steps_of(records)) == STEPS
    assert not [s for s in summaries_of(records) if s.name in ("forward", "backward")]


def test_a_compiled_ddp_model_keeps_its_all_reduce_timing(gloo_group, attach, memory_bus
                                                          ) -> None:
    """``torch.compile(DDP(model))``: the DDP wrapper runs inside the compiled call, where the
    discovery hooks are off; its all-reduces are still timed (the waits that find a straggler
    outside our hooks rest on them)."""
    from torch.nn.parallel import DistributedDataParallel

    model = torch.compile(DistributedDataParallel(TinyModel()), backend="aot_eager")
    _, records = _compiled_run(attach, memory_bus, model)
    allreduce = [s for s in summaries_of(records) if s.name == "ddp_allreduce"]
    assert sum(s.count for s in allreduce) >= STEPS  # one bucket a step, at least
    assert sum(s.count for s in summaries_of(records) if s.name == "forward") == STEPS
