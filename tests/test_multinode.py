"""Multi-node jobs on one machine: two torchrun "nodes" meeting at a c10d rendezvous, and srun-style tasks.

Ground truth: on node 1 the process with local rank 1 sleeps 1.25 ms more per sample (10 ms per batch of 8) in its
loader, so it is the job's straggler, and every other rank, on both nodes, waits for it in DDP's all-reduce. Each
node's `stepscope run` sees half the job; `stepscope merge` (or a shared `--out` folder) must see all of it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from run_helpers import free_port, script

from stepscope.summary import RunSummary

STEPSCOPE = [sys.executable, "-m", "stepscope"]
TIMEOUT_S = 240


def _node(k: int, port: int, out: list[str], slow: bool) -> list[str]:
    """Node ``k``'s command: stepscope around a 2-node, 2-process-per-node torchrun."""
    launcher = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(k),
        "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
    ]  # fmt: skip
    slow_args = ["--slow-local-rank", "1"] if slow else ["--slow-rank", "-1"]
    train = [script("ddp.py"), "--sample-ms", "0", "--extra-ms", "1.25", *slow_args]
    return [*STEPSCOPE, "run", "--warmup", "5", "--steps", "20", *out, "--", *launcher, *train]


def _start_all(commands: list[list[str]], cwd: Path, env: list[dict[str, str]] | None = None) -> list[str]:
    """Start every command at once (they rendezvous with each other), wait for all; returns their outputs."""
    procs = [
        subprocess.Popen(
            cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env[i] if env else None
        )
        for i, cmd in enumerate(commands)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output
    return outputs


def _merge(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*STEPSCOPE, "merge", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def _slow_process(job: RunSummary, node_output: str) -> RunSummary:
    """The rank that the script made slow, as it said on node 1's output."""
    (line,) = [line for line in node_output.splitlines() if line.startswith("ddp: slow rank ")]
    (slow,) = [r for r in job.ranks if r.meta.rank == int(line.split()[-1])]
    return slow


def _assert_job(job: RunSummary, slow: RunSummary, output: str) -> None:
    """The merged job: 4 ranks on 2 nodes, the slow process named as the straggler with its node, verdict data."""
    assert job.world_size == 4 and sorted(r.meta.rank for r in job.ranks) == [0, 1, 2, 3], output
    assert job.cluster is not None and job.cluster.missing_ranks == [], output
    assert len(job.cluster.nodes) == 2 and sorted(len(n["ranks"]) for n in job.cluster.nodes) == [2, 2], output
    straggler = job.cluster.straggler
    assert straggler is not None and straggler.rank == slow.meta.rank, (straggler, output)
    assert straggler.node == slow.meta.node and straggler.phase == "data_wait", (straggler, output)
    assert 6 < straggler.excess_ms < 16, (straggler, output)
    assert len(straggler.waiting_ranks) == 3, (straggler, output)
    assert job.verdict.bound == "data", (job.verdict, output)
    assert f"straggler: rank {slow.meta.rank} on {slow.meta.node}, data_wait +" in output, output
    # Cluster samples/s is the whole job's: the 4 ranks' samples per step over the job's step (the slowest rank's:
    # the job is synchronous), not one node's half, nor a sum of rates each over its own rank's time.
    batches = sum(r.throughput.samples_per_s / r.throughput.steps_per_s for r in job.ranks)
    step_ms = max(r.throughput.step_time_ms for r in job.ranks)
    assert job.cluster.samples_per_s == pytest.approx(batches * 1e3 / step_ms), output
    assert job.cluster.samples_per_s <= sum(r.throughput.samples_per_s for r in job.ranks) * (1 + 1e-9), output


def test_a_two_node_torchrun_job_merges_into_one(tmp_path):
    port = free_port()
    nodes = [_node(k, port, ["--json", f"node{k}.json"], slow=k == 1) for k in (0, 1)]
    outputs = _start_all(nodes, tmp_path)
    halves = [RunSummary.from_json(tmp_path / f"node{k}.json") for k in (0, 1)]
    for k, half in enumerate(halves):
        # Each node alone: half the job, and it says where the other half is.
        assert half.world_size == 4 and len(half.ranks) == 2, outputs[k]
        assert any("ran on the job's other nodes" in note for note in half.notes), half.notes
    assert halves[0].ranks[0].meta.job_id == halves[1].ranks[0].meta.job_id is not None
    result = _merge("node0.json", "node1.json", "--json", "job.json", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    _assert_job(RunSummary.from_json(tmp_path / "job.json"), _slow_process(halves[1], outputs[1]), result.stdout)
    assert "nodes: 2" in result.stdout, result.stdout


def test_a_two_node_job_through_a_shared_out_folder(tmp_path):
    port, shared = free_port(), tmp_path / "shared"
    nodes = [_node(k, port, ["--out", str(shared), "--json", f"node{k}.json"], slow=k == 1) for k in (0, 1)]
    outputs = _start_all(nodes, tmp_path)
    files = sorted(p.name for p in shared.glob("*.json"))
    assert len(files) == 4 and all(name.startswith(f"rank0000{i}-") for i, name in enumerate(files)), files
    slow = _slow_process(RunSummary.from_json(tmp_path / "node1.json"), outputs[1])
    for k in (0, 1):
        # Each node waited for the other's ranks in the shared folder: both report the whole job.
        _assert_job(RunSummary.from_json(tmp_path / f"node{k}.json"), slow, outputs[k])
    result = _merge(str(shared), "--json", "job.json", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    _assert_job(RunSummary.from_json(tmp_path / "job.json"), slow, result.stdout)


def _srun_env(task: int, tasks: int, job: str, port: int) -> dict[str, str]:
    """What srun gives each task of a 2-node, 1-task-per-node step (and a job script's MASTER_ADDR/PORT)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    return {
        **env,
        "SLURM_JOB_ID": job, "SLURM_STEP_ID": "0", "SLURM_PROCID": str(task), "SLURM_LOCALID": "0",
        "SLURM_NTASKS": str(tasks), "SLURM_NODEID": str(task), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }  # fmt: skip


def test_srun_tasks_without_torchrun_are_ranks_of_one_job(tmp_path):
    port, shared = free_port(), tmp_path / "shared"
    train = [script("ddp.py"), "--slurm", "--sample-ms", "0", "--extra-ms", "1.25", "--slow-rank", "1"]
    task = [*STEPSCOPE, "run", "--warmup", "5", "--steps", "20", "--out", str(shared), *train]
    outputs = _start_all([task, task], tmp_path, env=[_srun_env(i, 2, "4242", port) for i in (0, 1)])
    result = _merge(str(shared), "--json", "job.json", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr + "".join(outputs)
    job = RunSummary.from_json(tmp_path / "job.json")
    assert job.world_size == 2 and [r.meta.rank for r in job.ranks] == [0, 1], result.stdout
    assert {r.meta.job_id for r in job.ranks} == {"slurm:4242.0"}, result.stdout
    assert [r.meta.node_rank for r in job.ranks] == [0, 1] and len(job.cluster.nodes) == 2, result.stdout
    assert job.cluster.straggler is not None and job.cluster.straggler.rank == 1, result.stdout
    assert job.verdict.bound == "data", (job.verdict, result.stdout)


def test_a_shared_folder_that_cannot_be_read_back_keeps_this_nodes_ranks(tmp_path, capsys):
    # Another node (or a cleanup job) emptied the shared --out folder before this node merged: the figures this
    # node measured are still the summary, with a note, rather than a traceback after the training ran.
    from stepscope.instrument.launch import _job_ranks

    own = RunSummary()
    own.meta.job_id, own.meta.rank, own.meta.world_size = "job-1", 0, 2
    ranks, notes = _job_ranks(tmp_path, [own], wait_s=0)
    assert ranks == [own]
    assert len(notes) == 1 and notes[0].startswith("this node's ranks only: no stepscope summary could be read"), notes
    assert "rank(s) 0, 1 of the job wrote no final summary" in capsys.readouterr().err
