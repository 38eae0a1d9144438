"""The script lint: what it finds in a training script's source, on which line, and what it leaves alone."""

from __future__ import annotations

import textwrap

import pytest

from stepscope.doctor.lint import LintError, LintHit, lint_file, lint_source


def lint(source: str) -> list[tuple[str, int]]:
    return [(hit.kind, hit.line) for hit in lint_source(textwrap.dedent(source))]


def kinds(source: str) -> set[str]:
    return {kind for kind, _ in lint(source)}


# -- debug modes ---------------------------------------------------------------------------------------------------


def test_set_detect_anomaly_true_is_a_hit_on_its_line():
    source = """\
    import torch

    torch.autograd.set_detect_anomaly(True)
    """
    assert lint(source) == [("anomaly", 3)]


def test_set_detect_anomaly_false_is_not_a_hit():
    assert lint("import torch\ntorch.autograd.set_detect_anomaly(False)\n") == []


def test_detect_anomaly_context_manager_is_a_hit():
    source = """\
    import torch

    for x in data:
        with torch.autograd.detect_anomaly():
            model(x).sum().backward()
    """
    assert lint(source) == [("anomaly", 4)]


def test_gradcheck_and_gradgradcheck_are_hits():
    source = """\
    import torch
    from torch.autograd import gradcheck

    torch.autograd.gradcheck(f, (x,))
    gradcheck(f, (x,))
    torch.autograd.gradgradcheck(f, (x,))
    """
    assert lint(source) == [("gradcheck", 4), ("gradcheck", 5), ("gradcheck", 6)]


def test_profiler_profile_is_a_hit():
    source = """\
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train()
    """
    assert lint(source) == [("profiler", 3)]


def test_a_profile_function_that_is_not_torchs_is_not_a_hit():
    assert lint("import cProfile\ncProfile.run('main()')\nprofile(main)\n") == []


def test_profile_imported_from_torch_profiler_is_a_hit():
    source = """\
    from torch.profiler import profile, ProfilerActivity

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train()
    """
    assert lint(source) == [("profiler", 3)]


def test_use_deterministic_algorithms_true_is_a_hit_and_false_is_not():
    source = """\
    import torch

    torch.use_deterministic_algorithms(False)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.deterministic = False
    """
    assert lint(source) == [("deterministic", 4), ("deterministic", 5)]


# -- settings ------------------------------------------------------------------------------------------------------


def test_cudnn_benchmark_assignments_are_found_on_or_off():
    source = """\
    import torch

    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.benchmark = False
    """
    assert lint(source) == [("cudnn_benchmark_on", 3), ("cudnn_benchmark_off", 4)]


def test_tf32_assignments_are_found_on_or_off():
    source = """\
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = True
    """
    assert lint(source) == [("tf32_off", 3), ("tf32_on", 4)]


def test_dataloader_without_num_workers_is_a_hit():
    source = """\
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset, batch_size=32, shuffle=True)
    """
    hits = lint_source(textwrap.dedent(source))
    assert hits == [LintHit("num_workers_zero", 3, "loader = DataLoader(dataset, batch_size=32, shuffle=True)")]


def test_dataloader_with_num_workers_zero_is_a_hit():
    source = """\
    import torch

    loader = torch.utils.data.DataLoader(
        dataset,
        num_workers=0,
    )
    """
    assert lint(source) == [("num_workers_zero", 3)]  # the call's first line


def test_dataloader_with_workers_is_not_a_hit():
    source = """\
    from torch.utils.data import DataLoader

    a = DataLoader(dataset, batch_size=32, num_workers=4)
    b = DataLoader(dataset, batch_size=32, num_workers=args.workers)
    """
    assert lint(source) == []


def test_dataloader_with_keyword_unpacking_is_not_a_hit():
    source = """\
    from torch.utils.data import DataLoader

    kwargs = {"batch_size": 32, "num_workers": 4}
    loader = DataLoader(dataset, **kwargs)
    idle = DataLoader(dataset, **kwargs, num_workers=0)
    """
    assert lint(source) == [("num_workers_zero", 5)]


def test_zero_grad_keeping_the_gradients_is_a_hit():
    source = """\
    opt.zero_grad(set_to_none=False)
    opt.zero_grad(False)
    opt.zero_grad()
    opt.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=False)
    """
    assert lint(source) == [("zero_grad_keep", 1), ("zero_grad_keep", 2), ("zero_grad_keep", 5)]


def test_ddp_with_find_unused_parameters_is_a_hit():
    source = """\
    import torch

    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank], find_unused_parameters=True)
    other = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank], find_unused_parameters=False)
    plain = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    """
    assert lint(source) == [("find_unused_parameters", 3)]


def test_ddp_alias_with_find_unused_parameters_is_a_hit():
    source = """\
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(model, device_ids=[rank], find_unused_parameters=True)
    """
    assert lint(source) == [("find_unused_parameters", 3)]


def test_activation_checkpoint_call_is_found():
    source = """\
    from torch.utils.checkpoint import checkpoint
    import torch

    y = checkpoint(block, x, use_reentrant=False)
    z = torch.utils.checkpoint.checkpoint(block, y, use_reentrant=False)
    save_checkpoint(model)
    """
    assert lint(source) == [("checkpoint", 4), ("checkpoint", 5)]


# -- host syncs in the loop ----------------------------------------------------------------------------------------


def test_item_in_the_loop_body_is_a_hit_with_its_line():
    source = """\
    total = 0.0
    for x, y in loader:
        loss = model(x, y)
        loss.backward()
        total += loss.item()
    """
    assert lint_source(textwrap.dedent(source)) == [LintHit("loop_sync", 5, "total += loss.item()")]


def test_item_outside_any_loop_is_not_a_hit():
    source = """\
    for x, y in loader:
        loss = model(x, y)
    print(loss.item())
    """
    assert lint(source) == []


def test_item_in_a_function_defined_in_the_loop_is_not_a_hit():
    source = """\
    for x, y in loader:
        def report():
            return loss.item()
        scale = lambda: loss.item()
        loss = model(x, y)
    """
    assert lint(source) == []


def test_loop_inside_a_function_still_counts():
    source = """\
    def train(loader):
        for x in loader:
            acc = (model(x).argmax(1) == 0).float().mean().cpu()
    """
    assert lint(source) == [("loop_sync", 3)]


def test_reads_in_the_loop_header_or_else_run_once():
    source = """\
    for v in values.tolist():
        pass
    else:
        print(loss.item())
        torch.autograd.set_detect_anomaly(True)
    while step < limit.item():
        step += 1
    """
    assert lint(source) == [("anomaly", 5)]  # the else clause is read, just not as part of the loop


def test_synchronize_in_a_while_loop_is_a_hit():
    source = """\
    import torch

    step = 0
    while step < 100:
        train_step()
        torch.cuda.synchronize()
        step += 1
    torch.cuda.synchronize()
    """
    assert lint(source) == [("loop_sync", 6)]


def test_every_scalar_read_in_nested_loops_is_found_and_calls_with_positional_arguments_are_not():
    source = """\
    for epoch in range(3):
        for x in loader:
            a = out.tolist()
            b = out.numpy()
            c = out.cpu()
            d = out.item()
            e = out.numpy(force=True)
            f = out.cpu(0)
    """
    assert lint(source) == [("loop_sync", 3), ("loop_sync", 4), ("loop_sync", 5), ("loop_sync", 6), ("loop_sync", 7)]


def test_hits_come_in_line_order_with_the_stripped_line():
    source = """\
    import torch
    torch.backends.cudnn.benchmark = True
    loader = DataLoader(ds)
    for x in loader:
            loss = model(x); print(loss.item())
    torch.autograd.set_detect_anomaly(True)
    """
    hits = lint_source(textwrap.dedent(source))
    assert [h.to_dict() for h in hits] == [
        {"kind": "cudnn_benchmark_on", "line": 2, "text": "torch.backends.cudnn.benchmark = True"},
        {"kind": "num_workers_zero", "line": 3, "text": "loader = DataLoader(ds)"},
        {"kind": "loop_sync", "line": 5, "text": "loss = model(x); print(loss.item())"},
        {"kind": "anomaly", "line": 6, "text": "torch.autograd.set_detect_anomaly(True)"},
    ]


def test_a_clean_script_has_no_hits():
    source = """\
    import torch
    from torch.utils.data import DataLoader

    loader = DataLoader(ds, batch_size=64, num_workers=8, pin_memory=True)
    for x, y in loader:
        x = x.to("cuda", non_blocking=True)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(loss.item())
    """
    assert lint(source) == []


# -- errors --------------------------------------------------------------------------------------------------------


def test_a_syntax_error_names_the_line():
    source = "import torch\n\nfor x in loader\n    pass\n"
    with pytest.raises(LintError, match=r"train\.py does not parse \(line 3: ") as info:
        lint_source(source, filename="train.py")
    assert isinstance(info.value.__cause__, SyntaxError)


def test_lint_file_reads_a_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\ntorch.autograd.set_detect_anomaly(True)\n", encoding="utf-8")
    assert lint_file(script) == [LintHit("anomaly", 2, "torch.autograd.set_detect_anomaly(True)")]
    assert lint_file(str(script)) == lint_file(script)


def test_lint_file_syntax_error_names_the_file_and_line(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("x = (\n", encoding="utf-8")
    with pytest.raises(LintError, match=r"broken\.py does not parse \(line 1"):
        lint_file(script)


def test_a_missing_file_is_a_lint_error(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(LintError, match=r"cannot read .*nope\.py"):
        lint_file(missing)


def test_a_file_that_is_not_utf8_is_a_lint_error(tmp_path):
    script = tmp_path / "latin1.py"
    script.write_bytes(b"# caf\xe9\nx = 1\n")
    with pytest.raises(LintError, match="cannot read"):
        lint_file(script)
