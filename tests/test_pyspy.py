"""py-spy: ``stepscope run --py-spy`` flame graphs and ``stepscope dump`` on real processes (tests/scripts/stuck.py).

Two kinds of tests. Those on live processes need py-spy to read a process it did not start (``py-spy dump --pid``):
they skip, saying why and how to fix it, where ptrace is not permitted. The others run everywhere: recording (py-spy
starts the command, so it needs no such permission), and the parser and classifier on real dumps kept in
tests/data/pyspy/, which ``PYTHONPATH=src python tests/test_pyspy.py`` captures anew from live processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import site
import stat
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from run_helpers import REPO, SCRIPTS, free_port, run_env, script, stepscope_cmd, stepscope_run, torchrun

from stepscope.instrument.pyspy import PtraceFacts, PySpyError, find_pyspy, is_permission_error, permission_message
from stepscope.instrument.stackdump import Samples, blocked_in, classify, format_report, parse_dump, sample
from stepscope.summary import RunSummary

DATA = Path(__file__).resolve().parent / "data" / "pyspy"
STUCK = str(SCRIPTS / "stuck.py")
# What py-spy 0.4.3 printed on stderr, run as uid 65534 against a root process (see test_real_eperm_text below).
PYSPY_EPERM = "Permission Denied: Try running again with elevated permissions by going 'sudo env \"PATH=$PATH\" !!'\n"

try:
    PYSPY = find_pyspy()
except PySpyError as missing:
    pytest.skip(str(missing), allow_module_level=True)


# -- live processes ------------------------------------------------------------------------------------------------


def start_stuck(mode: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, STUCK, mode], env=run_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@contextmanager
def ready(*procs: subprocess.Popen[str]) -> Iterator[None]:
    """Once every process said it is about to block (or spin); they are killed afterwards."""
    try:
        for proc in procs:
            line = proc.stdout.readline()
            assert line == "stuck: ready\n", f"{proc.args}: {line!r}, exit code {proc.poll()}"
        time.sleep(0.3)  # from the print to the blocking call
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@contextmanager
def stuck(mode: str) -> Iterator[subprocess.Popen[str]]:
    """``stuck.py MODE`` running, once it said it is about to block (or spin)."""
    proc = start_stuck(mode)
    with ready(proc):
        yield proc


@contextmanager
def stuck_barrier() -> Iterator[int]:
    """Two gloo ranks: rank 0 in dist.barrier(), rank 1 asleep and never coming; yields rank 0's pid."""
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    ranks = [start_stuck("barrier", {**rendezvous, "RANK": str(rank)}) for rank in (0, 1)]
    with ready(*ranks):
        yield ranks[0].pid


@pytest.fixture(scope="module")
def ptrace() -> None:
    """Skip, with the reason and the fix, where py-spy may not read a process that is not its descendant."""
    with stuck("recv") as proc:
        done = subprocess.run([PYSPY, "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=60)
    if is_permission_error(done.stderr):
        pytest.skip(f"ptrace not permitted here: {permission_message(proc.pid, PtraceFacts.here())}")
    assert done.returncode == 0, done.stderr


def capture(pid: int) -> Samples:
    """Three dumps 0.2 s apart (and a native one where a thread blocks), as tests/data/pyspy keeps them."""
    return sample(pid, samples=3, interval_s=0.2)


CASES = {
    # name: (verdict, kind of wait of the main thread, the user's line the headline names)
    "busy": ("busy", "", "spin_forever"),
    "lock": ("hung", "lock", "wait_for_lock (stuck.py:40): lock.acquire()"),
    "recv": ("hung", "socket", "wait_for_bytes (stuck.py:46): mine.recv(1024)"),
    "barrier": ("hung", "collective", "wait_at_barrier (stuck.py:55): dist.barrier()"),
}


def check(report, name: str) -> None:
    verdict, kind, where = CASES[name]
    text = format_report(report)
    assert report.verdict == verdict, text
    main = report.processes[0].main()
    assert main is not None, text
    assert main.wait_kind == kind, text
    if verdict == "hung":
        assert report.headline.startswith("looks hung: "), text
        assert where in report.headline, text
    else:
        assert report.headline.startswith("busy: "), text
        assert where in text, text


@pytest.mark.parametrize("name", ["busy", "lock", "recv"])
def test_dump_classifies_a_live_process(ptrace, name):
    with stuck(name) as proc:
        report = classify(capture(proc.pid))
    check(report, name)


def test_dump_finds_the_rank_stuck_in_a_gloo_barrier(ptrace):
    with stuck_barrier() as rank0:
        report = classify(capture(rank0))
    check(report, "barrier")
    assert report.processes[0].command.startswith("[rank 0] "), report.processes[0].command
    assert report.seconds >= 0.4, report


def test_dump_command_exit_code_text_and_json(ptrace, tmp_path):
    out = tmp_path / "dump.json"
    with stuck("lock") as proc:
        cmd = [sys.executable, "-m", "stepscope.cli", "dump", str(proc.pid), "--samples", "3", "--interval-s", "0.2"]
        done = subprocess.run([*cmd, "--json", str(out)], env=run_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr  # 1: looks hung
    assert "thread 'MainThread': blocked in a lock acquire" in done.stdout, done.stdout
    assert "thread 'holder': blocked in time.sleep" in done.stdout, done.stdout
    saved = json.loads(out.read_text())
    assert saved["verdict"] == "hung" and saved["samples"] == 3, saved
    assert [t["wait_kind"] for t in saved["processes"][0]["threads"]] == ["sleep", "lock"], saved


def test_dump_of_a_busy_process_exits_0(ptrace):
    with stuck("busy") as proc:
        cmd = [sys.executable, "-m", "stepscope.cli", "dump", str(proc.pid), "--samples", "2", "--interval-s", "0.1"]
        done = subprocess.run(cmd, env=run_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("busy: "), done.stdout


def test_dump_of_no_such_process():
    done = subprocess.run(
        [sys.executable, "-m", "stepscope.cli", "dump", "999999999"], env=run_env(), capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "stepscope: no process 999999999" in done.stderr, done.stderr


# -- real dumps kept in tests/data/pyspy ---------------------------------------------------------------------------


def stored(name: str, native: bool = True) -> Samples:
    """A capture kept by ``python tests/test_pyspy.py``; the script's path is the one of this checkout."""
    raw = json.loads((DATA / f"{name}.json").read_text().replace("{SCRIPTS}", str(SCRIPTS)))
    return Samples(
        pid=raw["pid"],
        commands={int(p): c for p, c in raw["commands"].items()},
        seconds=raw["seconds"],
        rounds=[{int(p): text for p, text in round_.items()} for round_ in raw["rounds"]],
        native={int(p): text for p, text in raw["native"].items()} if native else {},
        errors={int(p): text for p, text in raw["errors"].items()},
    )


@pytest.mark.parametrize("name", list(CASES))
def test_classifier_on_real_dumps(name):
    check(classify(stored(name)), name)


@pytest.mark.parametrize("name", ["lock", "recv", "barrier"])
def test_without_native_frames_the_python_stack_and_source_line_tell(name):
    # py-spy cannot read native stacks everywhere (--native is Linux/Windows only): the innermost Python frame's
    # file and function, or its source line ("lock.acquire()"), still say where it blocks.
    report = classify(stored(name, native=False))
    check(report, name)
    assert not any(f.native for f in report.processes[0].main().frames)


def test_parser_reads_every_field_of_a_real_dump():
    found = stored("lock")
    (pid,) = found.commands
    threads = parse_dump(found.native[pid])
    assert {t.name for t in threads} == {"MainThread", "holder"}
    main = next(t for t in threads if t.name == "MainThread")
    assert main.pid == pid and main.os_thread_id == pid and not main.active
    python = [f for f in main.frames if not f.native]
    assert [(f.name, f.file, f.line) for f in python] == [
        ("wait_for_lock", "stuck.py", 40),
        ("<module>", "stuck.py", 62),
    ]
    assert python[0].code == "lock.acquire()" and python[0].path == STUCK
    native = [f.name for f in main.frames if f.native]
    assert "PyThread_acquire_lock_timed" in native, native
    assert blocked_in(main.frames).kind == "lock"


def test_a_busy_thread_is_active_and_its_stack_moves():
    found = stored("busy")
    (pid,) = found.commands
    samples = [parse_dump(round_[pid])[0] for round_ in found.rounds]
    assert any(t.active for t in samples), samples
    assert not found.native, "nothing blocked: no native dump"


# -- recording a run -----------------------------------------------------------------------------------------------


def svg_titles(path: Path) -> list[str]:
    """The <title> of every frame of a py-spy flame graph (it must parse as XML)."""
    tree = ET.parse(path)
    return [t.text or "" for t in tree.iter("{http://www.w3.org/2000/svg}title")]


def towers(titles: list[str]) -> list[str]:
    """The root and process frames of a flame graph: what a failure message shows (all frames are thousands)."""
    return [t for t in titles if t.startswith(("stepscope run (", "process ", "rank "))]


def test_run_records_a_flame_graph_and_keeps_the_exit_code(tmp_path):
    svg = tmp_path / "graphs" / "out.svg"
    # py-spy reads a process's command line once, when it first sees it: beside busy cores that can be before or
    # during the holder's exec of the script (then the holder's, or empty), so stepscope names the script's tower
    # itself. "two words" tells its name (shlex.join quotes them) from py-spy's (joined with spaces).
    args = ["--iters", "300", "--tag", "two words", "--exit-code", "3"]
    r = stepscope_run(tmp_path, "--no-stop", "--py-spy", str(svg), script("basic.py"), *args)
    assert r.returncode == 3, r.describe()
    assert "basic: done after 300 steps" in r.stdout, r.describe()
    assert "basic: a line on stderr" in r.stderr, r.describe()  # the script's streams are still its own
    assert "py-spy>" not in r.stdout + r.stderr, r.describe()  # py-spy's chatter stays in its log
    assert f"stepscope: py-spy flame graph written to {svg} (" in r.stderr, r.describe()
    titles = svg_titles(svg)
    found = towers(titles)
    assert any(t.startswith("stepscope run (") and t.endswith(", 100.00%)") for t in found), found
    tower = f'process {r.summary.meta.pid}:"{shlex.join([sys.executable, script("basic.py"), *args])}" ('
    assert any(t.startswith(tower) for t in found), f"no frame {tower!r}...; the graph's processes: {found}"
    # main() runs for as long as its imports (the optimizer's) and 300 steps take in wall time: under load longer
    # still, and py-spy samples wall time. Not a sample there means the script's own stack went unsampled.
    own = [t for t in titles if t.startswith("main (basic.py:")]
    assert own, f"no sample in basic.py's main(); the graph's processes: {found}"
    assert r.summary.exit.code == 3, r.describe()
    assert r.summary.steps.measured == 297, r.describe()  # still the script's own run: found and measured


def test_torchrun_ranks_are_named_in_one_graph(tmp_path):
    svg = tmp_path / "ddp.svg"
    launcher = [
        *torchrun(),
        script("ddp.py"),
    ]
    r = stepscope_run(tmp_path, "--py-spy", str(svg), "--", *launcher, warmup=2, steps=5, timeout=180)
    assert r.returncode == 0, r.describe()
    assert len(r.summary.ranks) == 2, r.describe()
    roots = [t for t in svg_titles(svg) if t.startswith(("rank ", "process "))]
    for rank in (0, 1):
        assert any(t.startswith(f"rank {rank} (pid ") and "ddp.py" in t for t in roots), roots
    assert any(t.startswith("process ") and "torch.distributed.run" in t for t in roots), roots


@contextmanager
def sleepy_run(tmp_path: Path, svg: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """``stepscope run --py-spy`` of a script that trains forever; yields the run and the script's pid once ready."""
    cmd = stepscope_cmd(tmp_path / "s.json", "--py-spy", str(svg), script("sleepy_forever.py"), warmup=2, steps=10**6)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("READY"):
            line = proc.stdout.readline()
            assert line, f"no READY line; exit code {proc.poll()}"
        yield proc, int(line.split()[1])
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def end_with_sigterm(proc: subprocess.Popen[str]) -> tuple[str, str]:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    return out, err


def test_sigterm_reaches_the_script_and_the_graph_is_written(tmp_path):
    svg = tmp_path / "out.svg"
    with sleepy_run(tmp_path, svg) as (proc, script_pid):
        time.sleep(0.5)
        assert psutil.Process(script_pid).parent().name() != "py-spy"  # the holder sits between them
        _, err = end_with_sigterm(proc)
    summary = RunSummary.from_json(tmp_path / "s.json")
    assert summary.exit.reason == "terminated", (summary.exit, err)
    assert proc.returncode == summary.exit.code, err
    assert any(t.startswith("main (sleepy_forever.py:") for t in svg_titles(svg)), err
    assert not psutil.pid_exists(script_pid) or psutil.Process(script_pid).status() == psutil.STATUS_ZOMBIE


def test_py_spy_dying_mid_run_does_not_touch_the_run(tmp_path):
    svg = tmp_path / "out.svg"
    with sleepy_run(tmp_path, svg) as (proc, script_pid):
        (pyspy,) = [p for p in psutil.Process(proc.pid).children() if p.name() == "py-spy"]
        pyspy.kill()  # py-spy dies without killing what it started
        time.sleep(0.5)
        assert psutil.Process(script_pid).status() != psutil.STATUS_ZOMBIE, "the script went down with py-spy"
        _, err = end_with_sigterm(proc)
    summary = RunSummary.from_json(tmp_path / "s.json")
    assert summary.exit.reason == "terminated", (summary.exit, err)
    assert proc.returncode == summary.exit.code, err
    warning = "stepscope: no flame graph was written (py-spy stopped before the command ended (killed by signal 9)); "
    assert warning + "the run itself went on.\n" in err, err


def venv_without_py_spy(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A Python with no py-spy beside it nor on PATH (a virtual environment on this one's packages), and its env.

    ``--system-site-packages`` would give the *base* interpreter's packages, which need not include stepscope's
    dependencies (a fresh machine's has none): a ``.pth`` file puts this environment's site-packages on its path."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site_dir,) = venv.glob("lib/python*/site-packages")
    (site_dir / "stepscope-test.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return venv / "bin", run_env({"PATH": f"{venv / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin"})


def test_a_missing_py_spy_names_the_extra(tmp_path):
    bin_dir, env = venv_without_py_spy(tmp_path)
    cmd = [str(bin_dir / "python"), "-m", "stepscope.cli", "run", "--py-spy", "x.svg", script("basic.py")]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "pip install 'stepscope[pyspy]'" in done.stderr, done.stderr
    assert "basic:" not in done.stdout  # refused before the script started


def test_a_broken_py_spy_install_does_not_stop_the_run(tmp_path):
    bin_dir, env = venv_without_py_spy(tmp_path)
    broken = bin_dir / "py-spy"
    broken.write_bytes(b"\x7fELF truncated download")
    broken.chmod(0o755)
    cmd = [str(bin_dir / "python"), "-m", "stepscope.cli", "run", "--warmup", "2", "--steps", "5"]
    done = subprocess.run(
        [*cmd, "--py-spy", "x.svg", script("basic.py")], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "stopped after 5 measured steps" in done.stdout, done.stdout
    assert "stepscope: no flame graph was written (py-spy could not start (Exec format error))" in done.stderr


def test_a_folder_is_no_flame_graph_path(tmp_path):
    r = stepscope_run(tmp_path, "--py-spy", str(tmp_path), script("basic.py"))
    assert r.returncode == 2, r.describe()
    assert "--py-spy" in r.stderr and "Traceback" not in r.stderr, r.describe()


# -- ptrace permission ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run py-spy as another user (uid 65534)")
def test_real_eperm_text(tmp_path):
    # py-spy as uid 65534 against a root process: the kernel refuses, py-spy says so.
    folder = Path(tempfile.mkdtemp())  # pytest's tmp_path is private to root
    try:
        folder.chmod(0o755)
        binary = folder / "py-spy"
        shutil.copy(PYSPY, binary)
        binary.chmod(binary.stat().st_mode | stat.S_IXOTH | stat.S_IROTH)
        with stuck("recv") as proc:
            done = subprocess.run(
                [str(binary), "dump", "--pid", str(proc.pid)], user=65534, capture_output=True, text=True, timeout=60
            )
    finally:
        shutil.rmtree(folder)
    assert done.returncode == 1
    assert is_permission_error(done.stderr), done.stderr
    assert done.stderr == PYSPY_EPERM or "Permission" in done.stderr


def test_eperm_is_told_from_other_errors():
    assert is_permission_error(PYSPY_EPERM)
    other = "Error: Failed to find python version from target process\n"
    assert not is_permission_error(other)
    gone = (
        "Error: Failed to get process executable name.\n\nCaused by:\n    0: No such file or directory (os error 2)\n"
    )
    assert not is_permission_error(gone)
    assert is_permission_error(
        gone.replace("No such file or directory (os error 2)", "Permission denied (os error 13)")
    )


@pytest.mark.parametrize(
    ("facts", "says"),
    [
        (PtraceFacts(1, cap_sys_ptrace=False, root=False, container=False), "ptrace_scope is 1"),
        (PtraceFacts(2, cap_sys_ptrace=False, root=True, container=True), "ptrace_scope is 2"),
        (PtraceFacts(None, cap_sys_ptrace=False, root=True, container=True), "this container lacks CAP_SYS_PTRACE"),
        (PtraceFacts(0, cap_sys_ptrace=False, root=False, container=False), "belongs to another user"),
    ],
)
def test_the_message_says_why_and_every_fix(facts, says):
    message = permission_message(4242, facts)
    assert message.startswith("py-spy may not read process 4242's memory (")
    assert says in message
    assert "--cap-add SYS_PTRACE" in message and "echo 0 | sudo tee /proc/sys/kernel/yama/ptrace_scope" in message
    assert ('sudo env "PATH=$PATH" stepscope' in message) is not facts.root, message  # root already


def test_scope_3_needs_a_reboot():
    message = permission_message(1, PtraceFacts(3, cap_sys_ptrace=True, root=True, container=False))
    assert "until the next reboot" in message and "--cap-add" not in message


def test_the_facts_of_this_machine():
    facts = PtraceFacts.here()
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    assert facts.yama_scope == (int(scope.read_text()) if scope.exists() else None)
    assert facts.root == (os.geteuid() == 0)


# -- capturing tests/data/pyspy anew -------------------------------------------------------------------------------


def _store(name: str, found: Samples) -> None:
    text = json.dumps(dataclasses.asdict(found), indent=1).replace(str(SCRIPTS), "{SCRIPTS}")
    (DATA / f"{name}.json").write_text(text + "\n")


if __name__ == "__main__":
    # python tests/test_pyspy.py: capture the real dumps the classifier tests read (needs ptrace, see the docstring).
    DATA.mkdir(parents=True, exist_ok=True)
    os.chdir(REPO)
    for case in ("busy", "lock", "recv"):
        with stuck(case) as live:
            _store(case, capture(live.pid))
    with stuck_barrier() as rank0_pid:
        _store("barrier", capture(rank0_pid))
    print(f"captured {', '.join(CASES)} into {DATA}")
