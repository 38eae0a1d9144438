"""One job's summaries from many places: rank identity from each launcher, gathering files and folders, refusing
summaries of different jobs, waiting for other nodes' ranks, and the per-node figures of a merged job."""

from __future__ import annotations

import os
import threading
import time

import pytest
from test_merge import rank

from stepscope.instrument.collect import MergeError, check_one_job, gather, wait_for_ranks
from stepscope.instrument.identity import identify, job_id, summary_name
from stepscope.instrument.merge import merge
from stepscope.summary import Exit, RunSummary


def on(summary: RunSummary, host: str, node: int | None = None, job: str | None = "slurm:7.0", pid: int | None = None):
    """``summary`` as written by a process on ``host`` (node index ``node``) of job ``job``."""
    meta = summary.meta
    meta.hostname, meta.node_rank, meta.job_id = host, node, job
    meta.pid = pid if pid is not None else 1000 + (meta.rank or 0)
    return summary


def job(world: int = 4, per_node: int = 2, slow: int | None = None) -> list[RunSummary]:
    """A job's ranks, ``per_node`` to a host; rank ``slow`` fetches 10 ms longer and the others wait for it."""
    ranks = []
    for r in range(world):
        phases = {"data_wait": 12.0, "forward": 5.0, "comms": 1.0} if r == slow else {"data_wait": 2.0, "forward": 5.0}
        if slow is not None and r != slow:
            phases["comms"] = 11.0
        ranks.append(on(rank(r, phases, world=world), f"gpu{r // per_node:02d}", node=r // per_node))
    return ranks


# -- identity ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "GROUP_RANK": "2"}, (5, 1, 8, 2)),
        ({"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NODEID": "1"}, (3, 1, 4, 1)),
        (
            {"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_SIZE": "8"},
            (6, 2, 8, None),
        ),
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}, (1, 1, 2, None)),
        # torchrun under srun (one task per node): SLURM_PROCID is the node's index, RANK the training rank.
        (
            {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2"},
            (6, 2, 8, None),
        ),
        ({}, (None, None, None, None)),
        ({"RANK": "x"}, (None, None, None, None)),
    ],
)
def test_rank_identity_from_each_launcher(env, expected):
    who = identify(env)
    assert (who.rank, who.local_rank, who.world_size, who.node_rank) == expected
    assert who.pid == os.getpid() and who.hostname


def test_job_id_from_the_scheduler_then_torchrun_then_the_rendezvous():
    rendezvous = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert (
        job_id({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3", "TORCHELASTIC_RUN_ID": "abc", **rendezvous}) == "slurm:77.3"
    )
    assert job_id({"TORCHELASTIC_RUN_ID": "abc", **rendezvous}) == "torchrun:abc"
    # torchrun's default --rdzv-id names nothing: every multi-node job would share it.
    assert job_id({"TORCHELASTIC_RUN_ID": "none", **rendezvous}) == "rendezvous:10.0.0.1:29500"
    assert job_id({}) is None


def test_summary_names_never_collide_across_nodes_and_sort_by_rank():
    a = identify({"RANK": "3"})
    names = {summary_name(a), summary_name(type(a)(**{**vars(a), "hostname": "other.cluster.org"}))}
    assert len(names) == 2 and all(n.startswith("rank00003-") and n.endswith(f"-pid{a.pid}.json") for n in names)
    assert sorted([summary_name(identify({"RANK": "10"})), summary_name(identify({"RANK": "9"}))])[0].startswith(
        "rank00009-"
    )


# -- gathering and checking ---------------------------------------------------------------------------------------


def write(summary: RunSummary, path) -> str:
    summary.to_json(path)
    return str(path)


def test_per_node_summaries_and_rank_files_merge_into_one_job_each_rank_once(tmp_path):
    ranks = job(slow=3)
    node0, node1 = merge(ranks[:2]), merge(ranks[2:])  # what `run --json` on each node writes
    write(node0, tmp_path / "node0.json")
    write(node1, tmp_path / "node1.json")
    (tmp_path / "out").mkdir()
    for r in ranks[2:]:  # the same processes again, as their rank files in a shared folder
        write(r, tmp_path / "out" / f"rank{r.meta.rank}-x-pid{r.meta.pid}.json")
    found = gather([tmp_path / "node0.json", tmp_path / "node1.json", tmp_path / "out"])
    assert [r.meta.rank for r in found.ranks] == [0, 1, 2, 3]
    assert check_one_job(found) == 4
    merged = merge(found.ranks, expected_world=4)
    assert merged.cluster.straggler.rank == 3 and merged.cluster.straggler.node == "gpu01 (node 1)"
    assert merged.cluster.straggler.waiting_ranks == [0, 1, 2]
    nodes = merged.cluster.nodes
    assert [(n["node"], n["ranks"]) for n in nodes] == [("gpu00 (node 0)", [0, 1]), ("gpu01 (node 1)", [2, 3])]
    assert nodes[1]["samples_per_s"] == pytest.approx(200.0) and nodes[0]["comms_ms"] == pytest.approx(11.0)
    assert nodes[1]["comms_ms"] == pytest.approx(6.0)  # rank 2 waits 11 ms, rank 3 (the straggler) 1 ms
    assert merged.meta.hostname == "2 nodes" and merged.cluster.missing_ranks == []


def test_a_final_summary_replaces_the_same_processes_checkpoint(tmp_path):
    checkpoint, final = job()[0], job()[0]
    checkpoint.exit, checkpoint.steps.measured = Exit(reason="running"), 5
    write(checkpoint, tmp_path / "a.json")
    write(final, tmp_path / "b.json")
    found = gather([tmp_path])
    assert len(found.ranks) == 1 and found.ranks[0].exit.reason == "stopped"


def test_summaries_of_different_jobs_are_refused_with_both_named(tmp_path):
    ranks = job()
    on(ranks[3], "gpu01", node=1, job="slurm:8.0")
    write(merge(ranks[:2]), tmp_path / "node0.json")
    write(merge(ranks[2:], expected_world=4), tmp_path / "node1.json")
    with pytest.raises(MergeError, match=r"2 different jobs: slurm:7\.0 \(3 rank\(s\).*slurm:8\.0 \(1 rank\(s\)"):
        check_one_job(gather([tmp_path]))


def test_merge_refusing_two_jobs_still_says_why_each_skipped_file_was_skipped(tmp_path, capsys):
    from stepscope.cli import main

    ranks = job()
    on(ranks[3], "gpu01", node=1, job="slurm:8.0")
    write(merge(ranks[:2]), tmp_path / "node0.json")
    write(merge(ranks[2:], expected_world=4), tmp_path / "node1.json")
    (tmp_path / "node2.json").write_text('{"steps": ')  # truncated
    assert main(["merge", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "node2.json was skipped" in err and "2 different jobs" in err, err


def test_different_world_sizes_and_one_rank_twice_are_refused(tmp_path):
    a, b = job(world=2), job(world=4)
    for r in a + b:
        r.meta.job_id = None  # nothing names the jobs: their shapes still tell them apart
    write(merge(a), tmp_path / "two.json")
    write(merge(b[2:], expected_world=4), tmp_path / "four.json")
    with pytest.raises(MergeError, match=r"world size \(2, 4\)"):
        check_one_job(gather([tmp_path / "two.json", tmp_path / "four.json"]))
    again = job(world=2)
    for r in again:
        r.meta.job_id, r.meta.pid = None, 5000 + (r.meta.rank or 0)  # two runs of one script: other processes
    write(merge(again), tmp_path / "again.json")
    with pytest.raises(MergeError, match=r"rank 0 was reported by two processes .*pid 1000 in .*two\.json.*pid 5000"):
        check_one_job(gather([tmp_path / "two.json", tmp_path / "again.json"]))


def test_unreadable_files_are_skipped_with_a_note_and_missing_paths_or_nothing_readable_are_errors(tmp_path):
    write(job()[0], tmp_path / "rank0.json")
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"hello": 1}')
    found = gather([tmp_path])
    assert len(found.ranks) == 1 and len(found.notes) == 2
    assert any("broken.json was skipped" in note for note in found.notes)
    with pytest.raises(MergeError, match=r"nope\.json: no such file or folder"):
        gather([tmp_path / "nope.json"])
    (tmp_path / "rank0.json").unlink()
    with pytest.raises(MergeError, match="no stepscope summary could be read"):
        gather([tmp_path])


def test_a_missing_rank_is_named_in_the_merged_job():
    merged = merge(job()[:3], expected_world=4)
    assert merged.cluster.missing_ranks == [3]
    assert any("rank(s) 3 wrote no summary" in note for note in merged.notes)


def test_one_node_of_a_multi_node_job_says_where_the_other_ranks_are():
    merged = merge(job()[:2])  # node 0 alone: world 4, ranks 0 and 1
    assert merged.cluster.missing_ranks == [2, 3] and merged.cluster.nodes == []
    assert any("ran on the job's other nodes" in note for note in merged.notes)


def test_waiting_for_other_nodes_ends_when_their_final_summaries_land(tmp_path):
    ranks = job(world=2)
    write(ranks[0], tmp_path / "rank00000-gpu00-pid1000.json")
    late = ranks[1]
    late.exit = Exit(reason="running")
    path = tmp_path / "rank00001-gpu00-pid1001.json"
    write(late, path)  # a checkpoint: that node is still running

    def finish() -> None:
        time.sleep(0.5)
        late.exit = Exit(reason="stopped")
        write(late, path)

    thread = threading.Thread(target=finish)
    started = time.monotonic()
    thread.start()
    assert wait_for_ranks(tmp_path, "slurm:7.0", 2, timeout_s=30, poll_s=0.05) == []
    thread.join()
    assert time.monotonic() - started < 20
    assert wait_for_ranks(tmp_path, "slurm:7.0", 3, timeout_s=0.2, poll_s=0.05) == [2]  # never comes: time out
    assert wait_for_ranks(tmp_path, "slurm:9.0", 2, timeout_s=0.1, poll_s=0.05) == [0, 1]  # another job's files


def test_a_large_jobs_tables_show_the_straggler_and_the_outliers_not_every_rank():
    import io

    from stepscope.report.terminal import RANK_ROWS, print_summary

    ranks = job(world=40, per_node=8, slow=37)
    ranks[5].phases["forward"].mean_ms += 3.0  # an outlier in another phase
    merged = merge(ranks)
    out = io.StringIO()
    print_summary(merged, file=out)
    text = out.getvalue()
    rows = [line.split()[0] for line in text.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert len(rows) == RANK_ROWS and "37" in rows and "5" in rows, text
    assert "ranks: 40 of 40 reported; the 16 farthest from the median shown" in text
    assert "straggler: rank 37 on gpu04 (node 4), data_wait +10.0 ms" in text
    assert "5 nodes" not in text and text.count("(node ") >= 5 + RANK_ROWS  # the node table and the rank rows
