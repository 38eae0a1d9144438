"""The parameter audit (stepscope.analyses.params) on small CPU models whose ground truth is known by construction.

``Net`` has every kind of parameter the audit tells apart: a frozen token embedding tied to the output layer's
weight (one tensor, two names), a trainable body, a gate whose gradient is exactly zero (multiplied by 0), a
branch taken only on odd steps (0-based), and a head that is never called.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from run_helpers import free_port
from torch import nn

from stepscope.analyses.params import (
    ModelAuditor,
    ParamAudit,
    ParamInfo,
    ParamWatch,
    audit_params,
    ddp_find_unused,
    strip_wrappers,
)

VOCAB, DIM, CLASSES = 32, 16, 4


class Gate(nn.Module):
    """A parameter that is reached by every backward pass but whose gradient is always exactly zero."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(DIM))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.scale * 0.0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.tok.weight.requires_grad_(False)  # a frozen (pretrained) embedding...
        self.body = nn.Linear(DIM, DIM)
        self.gate = Gate()
        self.odd = nn.Linear(DIM, DIM)  # only on odd steps
        self.aux_head = nn.Linear(DIM, CLASSES)  # never called
        self.out = nn.Linear(DIM, VOCAB)
        self.out.weight = self.tok.weight  # ...tied to the output projection
        self.calls = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        step = self.calls
        self.calls += 1
        h = torch.tanh(self.body(self.tok(idx)))
        h = self.gate(h)
        if step % 2 == 1:
            h = h + self.odd(h)
        return self.out(h)


def net_step(model: nn.Module, seed: int = 0):
    """One forward + backward of a Net-shaped model (plain, compiled or DDP-wrapped) on fixed data."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (4, 6), generator=g)
    target = torch.randint(0, VOCAB, (4, 6), generator=g)

    def step() -> None:
        logits = model(idx)
        F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1)).backward()

    return step


def names(infos: list[ParamInfo]) -> list[str]:
    return sorted(info.name for info in infos)


def by_name(infos: list[ParamInfo]) -> dict[str, ParamInfo]:
    return {info.name: info for info in infos}


def all_names(audit: ParamAudit) -> list[str]:
    infos = audit.unused + audit.zero_grad + audit.frozen + audit.conditional
    return [info.name for info in infos] + [alias for info in infos for alias in info.aliases]


def check_partition(audit: ParamAudit) -> None:
    """Every distinct tensor is in exactly one class; the lists do not overlap."""
    listed = [info.name for info in audit.unused + audit.zero_grad + audit.frozen + audit.conditional]
    assert len(listed) == len(set(listed)), audit
    assert audit.used_count + len(listed) == audit.total_count, audit


def hooks_left(model: nn.Module) -> int:
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


torch.set_num_threads(1)


# -- the main model: every class at once ---------------------------------------------------------------------


def test_net_every_class_three_steps():
    model = Net()
    audit = audit_params(model, net_step(model), steps=3)
    assert audit.steps == 3
    assert model.calls == 3
    assert audit.model == "Net"
    assert audit.ddp_find_unused is None
    assert audit.zero_grad_checked is False

    assert names(audit.unused) == ["aux_head.bias", "aux_head.weight"]
    unused = by_name(audit.unused)
    assert unused["aux_head.weight"].module == "aux_head"
    assert unused["aux_head.weight"].numel == DIM * CLASSES
    assert unused["aux_head.bias"].module == "aux_head"
    assert unused["aux_head.bias"].numel == CLASSES
    assert unused["aux_head.weight"].aliases == []

    # Frozen and tied: one entry, under the name it was first registered with, the other name as an alias.
    assert len(audit.frozen) == 1, audit.frozen
    frozen = audit.frozen[0]
    assert (frozen.name, frozen.module, frozen.numel, frozen.aliases) == (
        "tok.weight",
        "tok",
        VOCAB * DIM,
        ["out.weight"],
    )

    # Odd steps of 0, 1, 2: only step 1 takes the branch.
    assert names(audit.conditional) == ["odd.bias", "odd.weight"]
    for info in audit.conditional:
        assert info.reached_steps == 1, info
        assert info.module == "odd"
    assert by_name(audit.conditional)["odd.weight"].numel == DIM * DIM

    # Without include_zero_grad the gate's all-zero gradient counts as used.
    assert audit.zero_grad == []
    # body.weight, body.bias, gate.scale, out.bias; the tied out.weight is not a tensor of its own.
    assert audit.used_count == 4
    assert audit.total_count == 9
    check_partition(audit)
    assert "out.weight" not in [info.name for info in audit.unused + audit.frozen + audit.conditional]


def test_conditional_two_of_four_steps():
    model = Net()
    audit = audit_params(model, net_step(model), steps=4)
    assert audit.steps == 4
    assert names(audit.conditional) == ["odd.bias", "odd.weight"]
    assert [info.reached_steps for info in audit.conditional] == [2, 2]
    assert names(audit.unused) == ["aux_head.bias", "aux_head.weight"]
    check_partition(audit)


def test_single_step_cannot_see_the_branch():
    # One pass on step 0 never takes the odd branch: within what was observed, it is unused, not conditional.
    model = Net()
    audit = audit_params(model, net_step(model), steps=1)
    assert audit.steps == 1
    assert names(audit.unused) == ["aux_head.bias", "aux_head.weight", "odd.bias", "odd.weight"]
    assert audit.conditional == []
    check_partition(audit)


def test_advice_names_what_to_fix():
    model = Net()
    audit = audit_params(model, net_step(model), steps=4)
    advice = audit.advice
    assert "find_unused_parameters=False is safe" not in advice
    assert "aux_head.weight" in advice, advice
    assert "find_unused_parameters" in advice, advice


def test_include_zero_grad_finds_the_gate():
    model = Net()
    audit = audit_params(model, net_step(model), steps=4, include_zero_grad=True)
    assert audit.zero_grad_checked is True
    assert len(audit.zero_grad) == 1, audit.zero_grad
    gate = audit.zero_grad[0]
    assert (gate.name, gate.module, gate.numel) == ("gate.scale", "gate", DIM)
    # The rest is unchanged, and the gate is no longer counted as used.
    assert names(audit.unused) == ["aux_head.bias", "aux_head.weight"]
    assert names(audit.conditional) == ["odd.bias", "odd.weight"]
    assert names(audit.frozen) == ["tok.weight"]
    assert audit.used_count == 3
    check_partition(audit)


def test_zero_grad_only_when_zero_every_time():
    # A weight whose gradient is zero on some passes but not all is not ZERO-GRAD.
    class Sometimes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            factor = 0.0 if self.calls % 2 == 0 else 1.0
            self.calls += 1
            return (x * self.w * factor).sum()

    model = Sometimes()
    x = torch.randn(3)
    audit = audit_params(model, lambda: model(x).backward(), steps=2, include_zero_grad=True)
    assert audit.zero_grad == []
    assert audit.used_count == 1
    model = Sometimes()
    audit = audit_params(model, lambda: model(x).backward(), steps=1, include_zero_grad=True)
    assert names(audit.zero_grad) == ["w"]


def test_zero_grad_ignores_gradients_from_before_the_audit():
    # The gate was trained before (its .grad holds a non-zero gradient); in every audited pass its gradient is
    # exactly zero, so it is ZERO-GRAD: the audit must judge the gradients of the passes it watched.
    model = Net()
    model.gate.scale.grad = torch.ones(DIM)
    audit = audit_params(model, net_step(model), steps=2, include_zero_grad=True)
    assert names(audit.zero_grad) == ["gate.scale"], audit


# -- tied weights ---------------------------------------------------------------------------------------------


def test_tied_weights_used_once_and_unused_pair():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Linear(8, 8, bias=False)
            self.dec = nn.Linear(8, 8, bias=False)
            self.dec.weight = self.enc.weight
            self.spare_in = nn.Linear(8, 8, bias=False)  # a tied pair that no forward reaches
            self.spare_out = nn.Linear(8, 8, bias=False)
            self.spare_out.weight = self.spare_in.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dec(torch.relu(self.enc(x)))

    model = Tied()
    x = torch.randn(2, 8)
    audit = audit_params(model, lambda: model(x).square().mean().backward(), steps=2)
    assert audit.total_count == 2
    assert audit.used_count == 1
    assert len(audit.unused) == 1, audit.unused
    spare = audit.unused[0]
    assert (spare.name, spare.module, spare.numel, spare.aliases) == (
        "spare_in.weight",
        "spare_in",
        64,
        ["spare_out.weight"],
    )
    assert audit.frozen == [] and audit.conditional == []
    assert "spare_in.weight" in audit.advice


# -- hooks are removed ---------------------------------------------------------------------------------------


def test_hooks_removed_and_audit_repeatable():
    model = Net()
    first = audit_params(model, net_step(model), steps=4, include_zero_grad=True)
    assert hooks_left(model) == 0
    # Another backward after the audit changes nothing the audit returned.
    snapshot = first.to_dict()
    net_step(model)()
    assert first.to_dict() == snapshot
    # The same model, audited again from the same parity, gives the same answer: no hook of the first one fires.
    assert model.calls % 2 == 1
    model.calls = 0
    second = audit_params(model, net_step(model), steps=4, include_zero_grad=True)
    assert second.to_dict() == snapshot
    assert hooks_left(model) == 0


def test_param_watch_close_stops_counting():
    model = Net()
    watch = ParamWatch(model)
    assert watch.has_parameters
    assert hooks_left(model) > 0
    step = net_step(model)
    step()
    assert watch.end_backward() is True
    watch.close()
    assert hooks_left(model) == 0
    step()
    assert watch.end_backward() is False  # nothing reached: no hook left to see it
    audit = watch.audit()
    assert audit.steps == 1
    assert names(audit.unused) == ["aux_head.bias", "aux_head.weight", "odd.bias", "odd.weight"]


def test_hooks_removed_when_step_fn_raises():
    model = Net()
    calls = 0

    def step() -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("boom")
        net_step(model)()

    with pytest.raises(RuntimeError, match="boom"):
        audit_params(model, step, steps=3)
    assert hooks_left(model) == 0


def test_backward_without_the_model_is_not_a_step():
    # A backward pass that reaches none of the model's parameters does not count as one of its steps.
    model = Net()
    outside = torch.randn(3, requires_grad=True)
    calls = 0

    def step() -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            outside.sum().backward()
        else:
            net_step(model)()

    audit = audit_params(model, step, steps=3)
    assert audit.steps == 2


# -- a fully used model -----------------------------------------------------------------------------------------


def test_fully_used_model_is_safe():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(4, 8)
    audit = audit_params(model, lambda: model(x).sum().backward(), steps=2)
    assert audit.unused == [] and audit.conditional == [] and audit.frozen == [] and audit.zero_grad == []
    assert audit.used_count == 4 == audit.total_count
    assert "find_unused_parameters=False is safe" in audit.advice


def test_frozen_only_is_still_safe():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model[0].requires_grad_(False)
    x = torch.randn(4, 8)
    audit = audit_params(model, lambda: model(x).sum().backward(), steps=1)
    assert names(audit.frozen) == ["0.bias", "0.weight"]
    assert by_name(audit.frozen)["0.weight"].module == "0"
    assert audit.used_count == 2
    assert "find_unused_parameters=False is safe" in audit.advice


# -- bad input -------------------------------------------------------------------------------------------------


def test_model_without_parameters_is_rejected():
    model = nn.Sequential(nn.ReLU(), nn.Tanh())
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="no parameters"):
        audit_params(model, lambda: model(x).sum().backward())


@pytest.mark.parametrize("steps", [0, -1])
def test_steps_must_be_positive(steps):
    model = Net()
    with pytest.raises(ValueError, match="steps"):
        audit_params(model, net_step(model), steps=steps)
    assert model.calls == 0
    assert hooks_left(model) == 0


# -- wrappers -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wrapped", "clean"),
    [
        ("module._orig_mod.layer.weight", "layer.weight"),
        ("_orig_mod.module.layer.weight", "layer.weight"),
        ("module.module.layer.bias", "layer.bias"),
        ("_orig_mod.encoder._orig_mod.block.weight", "encoder.block.weight"),
        ("_fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.mlp.weight", "layers.0.mlp.weight"),
        ("layer.weight", "layer.weight"),
        ("submodule.weight", "submodule.weight"),  # "module" inside a name is not a prefix
        ("my_module.weight", "my_module.weight"),
    ],
)
def test_strip_wrappers(wrapped, clean):
    assert strip_wrappers(wrapped) == clean


def test_compiled_model_names_have_no_orig_mod():
    class Small(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(8, 16)
            self.stem.requires_grad_(False)
            self.body = nn.Linear(16, 16)
            self.head = nn.Linear(16, 2)
            self.aux_head = nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.body(self.stem(x))))

    compiled = torch.compile(Small())
    assert any(name.startswith("_orig_mod.") for name, _ in compiled.named_parameters())
    x = torch.randn(4, 8)
    audit = audit_params(compiled, lambda: compiled(x).sum().backward(), steps=2)
    assert audit.steps == 2
    assert names(audit.unused) == ["aux_head.bias", "aux_head.weight"]
    assert by_name(audit.unused)["aux_head.weight"].module == "aux_head"
    assert names(audit.frozen) == ["stem.bias", "stem.weight"]
    assert audit.used_count == 4
    assert audit.ddp_find_unused is None
    assert not any("_orig_mod" in name for name in all_names(audit)), all_names(audit)
    assert hooks_left(compiled) == 0


def test_ddp_find_unused_is_none_without_ddp():
    model = Net()
    assert ddp_find_unused(model) is None
    assert ddp_find_unused(torch.compile(model)) is None  # wrapping only; nothing is compiled until called


# -- DDP, in process, one rank ---------------------------------------------------------------------------------


@pytest.fixture
def gloo_group():
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_find_unused_true(gloo_group):
    from torch.nn.parallel import DistributedDataParallel

    inner = Net()
    model = DistributedDataParallel(inner, find_unused_parameters=True)
    assert any(name.startswith("module.") for name, _ in model.named_parameters())
    audit = audit_params(model, net_step(model), steps=4)
    assert audit.ddp_find_unused is True
    assert audit.steps == 4
    assert inner.calls == 4
    # DDP marks unreached parameters ready itself: that must not count as reaching them.
    assert names(audit.unused) == ["aux_head.bias", "aux_head.weight"]
    assert by_name(audit.unused)["aux_head.weight"].module == "aux_head"
    assert names(audit.conditional) == ["odd.bias", "odd.weight"]
    assert [info.reached_steps for info in audit.conditional] == [2, 2]
    assert len(audit.frozen) == 1
    assert (audit.frozen[0].name, audit.frozen[0].aliases) == ("tok.weight", ["out.weight"])
    assert audit.used_count == 4
    check_partition(audit)
    assert not any(name.startswith("module.") or ".module." in name for name in all_names(audit)), all_names(audit)
    assert "find_unused_parameters=False is safe" not in audit.advice
    assert hooks_left(model) == 0


def test_ddp_find_unused_false_is_reported(gloo_group):
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    x = torch.randn(4, 8)
    audit = audit_params(model, lambda: model(x).sum().backward(), steps=2)
    assert audit.ddp_find_unused is False
    assert audit.unused == [] and audit.conditional == []
    assert audit.used_count == 4
    assert "find_unused_parameters=False is safe" in audit.advice


def test_ddp_fully_used_but_find_unused_true_says_turn_it_off(gloo_group):
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), find_unused_parameters=True
    )
    x = torch.randn(4, 8)
    audit = audit_params(model, lambda: model(x).sum().backward(), steps=2)
    assert audit.ddp_find_unused is True
    assert audit.unused == [] and audit.conditional == []
    assert "find_unused_parameters=False is safe" in audit.advice


def test_ddp_find_unused_through_compile(gloo_group):
    from torch.nn.parallel import DistributedDataParallel

    for flag in (True, False):
        ddp = DistributedDataParallel(nn.Linear(4, 4), find_unused_parameters=flag)
        assert ddp_find_unused(ddp) is flag
        assert ddp_find_unused(torch.compile(ddp)) is flag  # torch.compile(DDP(model)): names _orig_mod.module.*


def test_a_models_own_attribute_called_module_keeps_its_name():
    # Not a DDP wrapper: "module." is the user's own attribute and must stay in the name.
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(4, 4)
            self.weight = nn.Parameter(torch.ones(4))
            self.extra = nn.Linear(4, 2)

        def forward(self, x):
            return self.module(x) * self.weight

    model = Holder()
    report = audit_params(model, lambda: model(torch.randn(2, 4)).sum().backward(), steps=1)
    assert [p.name for p in report.unused] == ["extra.weight", "extra.bias"]
    assert report.used_count == 3  # module.weight, module.bias, weight: three distinct tensors
    assert strip_wrappers("module.weight", data_parallel=False) == "module.weight"


def test_a_layer_unfrozen_during_training_is_watched_from_the_next_pass():
    # As stepscope params drives it: the auditor sees the model's call, and each backward begins and ends.
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    auditor = ModelAuditor(steps=3)
    for step in range(3):
        if step == 1:
            model[0].weight.requires_grad_(True)  # thawed before the second step's forward
        out = model(torch.randn(2, 4))
        auditor.see(model)
        auditor.begin_backward()
        out.sum().backward()
        auditor.end_backward()
    (report,) = auditor.audits()
    assert report.unused == []
    assert report.frozen == []
    assert [(p.name, p.reached_steps) for p in report.conditional] == [("0.weight", 2)]
