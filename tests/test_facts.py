"""Runtime facts: what the instrumented process reports about its own settings (doctor/facts.py, tracker)."""

from __future__ import annotations

import pytest
import torch
from run_helpers import script, stepscope_here
from torch import nn

from stepscope.doctor import facts


def test_run_reports_the_settings_the_script_used(tmp_path):
    r = stepscope_here(tmp_path, script("doctor_facts.py"), warmup=2, steps=6)
    assert r.returncode == 0, r.describe()
    f = r.summary.facts
    assert f["autocast"] == {"cpu": "bfloat16"}  # only open inside the loop: probed during forward
    assert f["torch"]["anomaly"] is False and f["torch"]["profiler"] is False
    assert f["zero_grad"] == {"set_to_none": False}
    assert f["inputs"] == [
        {"shape": [4, 3, 8, 8], "dtype": "float32", "device": "cpu", "channels_last": False, "model": "Net"}
    ]
    (model,) = f["models"]
    assert model["type"] == "Net" and model["convs"] == 1 and model["wrapper"] is None
    assert model["params"] == (3 * 8 * 9 + 8) + (8 * 8 + 8) + (8 * 4 + 4)
    assert model["dtypes"] == {"float32": 6}
    (optimizer,) = f["optimizers"]
    assert optimizer == {
        "type": "SGD",
        "fused": None,
        "foreach": False,
        "has_fused": True,
        "has_foreach": True,
        "params": 6,
        "device": "cpu",
    }
    assert f["threads"]["torch_threads"] == 1
    assert "device" not in f and "dynamo" not in f  # no CUDA, no torch.compile: absent, not guessed
    assert r.summary.counters["checkpoint_calls"] == pytest.approx(1.0)
    # backward's recomputation of the checkpointed block is backward time, not a second forward
    assert r.summary.counters["forward_calls"] == pytest.approx(1.0)


def test_profiler_and_varying_shapes_are_seen(tmp_path):
    r = stepscope_here(tmp_path, script("doctor_facts.py"), "--profile", "--vary-shapes", warmup=2, steps=6)
    assert r.returncode == 0, r.describe()
    f = r.summary.facts
    assert f["torch"]["profiler"] is True
    assert sorted(s["shape"][2] for s in f["inputs"]) == [8, 12]


def test_describe_model_reads_the_ddp_wrapper(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        inner = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        ddp = DistributedDataParallel(inner, find_unused_parameters=True, bucket_cap_mb=10)
        fact = facts.describe_model(ddp)
    finally:
        dist.destroy_process_group()
    assert fact["type"] == "Sequential" and fact["wrapper"] == "ddp" and fact["batchnorms"] == 1
    assert fact["ddp"] == {
        "find_unused_parameters": True,
        "bucket_cap_mb": pytest.approx(10.0),
        "gradient_as_bucket_view": False,
        "static_graph": False,
    }


def test_describe_model_sees_through_torch_compile():
    model = torch.compile(nn.Linear(4, 2))  # wrapping only: nothing compiles until it is called
    fact = facts.describe_model(model)
    assert fact["type"] == "Linear" and fact["compiled"] is True and fact["wrapper"] == "compiled"


def test_dynamo_counters_count_recompile_limit_hits():
    import torch._dynamo

    torch._dynamo.reset()

    @torch.compile(backend="eager", dynamic=False)
    def scale(x: torch.Tensor, k: int) -> torch.Tensor:
        return x * k

    with torch._dynamo.config.patch(recompile_limit=2):
        for k in range(4):
            scale(torch.ones(2), k)
    counters = facts.dynamo_counters()
    torch._dynamo.reset()
    assert counters is not None
    assert counters["graphs"] >= 2
    assert counters["recompile_limit_hits"] >= 1


def test_first_input_reports_channels_last():
    x = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)
    assert facts.first_input((x,), {})["channels_last"] is True
    assert facts.first_input((torch.randn(2, 3, 4, 4),), {})["channels_last"] is False
    assert facts.first_input((1, "a"), {}) is None
