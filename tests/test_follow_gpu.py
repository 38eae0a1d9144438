"""Where the GPU only follows the host, a phase's span between its events is host time (docs/gpu-validation.md).

tests/gpu_scripts/host_paced.py's forward sleeps 3 ms on the host around a 64-wide layer: the events around it span
the host's 3 ms while the GPU idles, and before the probe (clock.DeviceTimer) the verdict read that as compute.
With HEAVY=1 the step is 4096-wide matmuls the host waits for at the loss's sync, and stays compute. Skipped without
a GPU.
"""

from __future__ import annotations

import pytest
import torch
from run_helpers import REPO, stepscope_run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
SCRIPT = str(REPO / "tests" / "gpu_scripts" / "host_paced.py")


def _run(tmp_path, **env):
    r = stepscope_run(tmp_path, SCRIPT, warmup=5, steps=40, timeout=300, env=env)
    assert r.returncode == 0, r.describe()
    s = r.summary
    for name, p in s.phases.items():
        print(f"{name}: host {p.mean_ms:.3f} ms, gpu {p.device_mean_ms}, host-paced {p.device_host_paced}")
    print(s.verdict, s.notes)
    return s


@pytest.mark.parametrize("item", ["0", "1"], ids=["no-sync", "loss-read"])
def test_a_forward_that_sleeps_around_a_tiny_layer_is_host_time(tmp_path, item):
    s = _run(tmp_path, ITEM=item)
    forward = s.phases["forward"]
    assert forward.device_mean_ms is not None and forward.device_mean_ms > 2.5  # the span, as the events read it
    assert forward.device_host_paced is not None and forward.device_host_paced > 0.9, forward
    assert s.verdict.bound == "host", s.verdict
    assert any("forward: the GPU kept up with the host's launches" in line for line in s.verdict.evidence), s.verdict
    assert s.invariants == [], s.invariants


def test_matmuls_the_host_waits_for_stay_gpu_work(tmp_path):
    s = _run(tmp_path, ITEM="1", HEAVY="1")
    for name in ("forward", "backward"):
        paced = s.phases[name].device_host_paced
        assert paced is not None and paced < 0.1, (name, s.phases[name])
    assert s.verdict.bound == "compute", s.verdict
    assert not any("mostly the host's" in note for note in s.notes), s.notes
