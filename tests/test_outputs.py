"""Outputs are never lost: every --json/--html target is checked before anything runs, and a write that still fails
after the run (a full disk) is one sentence while the other outputs are written and the exit code stays the
script's. Also the terminal-facing odds and ends of issue 18: control characters, sizes, help texts, the user's
own sitecustomize."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kineto import Kineto
from run_helpers import run_env, script, stepscope_cmd

from stepscope.cli import build_parser, main
from stepscope.summary import Exit, RunSummary

HAS_DEV_FULL = os.path.exists("/dev/full")


@pytest.fixture
def marker_script(tmp_path) -> tuple[Path, Path]:
    """A script that only leaves a marker file: if it ran, the check came too late."""
    marker = tmp_path / "ran"
    path = tmp_path / "mark.py"
    path.write_text(f"open({str(marker)!r}, 'w').close()\n")
    return path, marker


def _bad_targets(tmp_path: Path, locked: Path) -> dict[str, tuple[str, str]]:
    """Output paths that cannot be written, each with the end of the sentence that must say why (``locked``: a
    folder this process cannot write, root included: the ``locked_folder`` fixture)."""
    (tmp_path / "a_file").write_text("")
    return {
        "folder": (str(tmp_path), f"it is a folder (give a file name, e.g. {tmp_path / 'stepscope.'}"),
        "under a file": (str(tmp_path / "a_file" / "out.x"), f"{tmp_path / 'a_file'} is a file, not a folder."),
        "locked folder": (str(locked / "out.x"), "no write permission."),
    }


@pytest.mark.parametrize(
    ("verb", "option", "what"),
    [
        ("run", "--json", "summary"),
        ("run", "--html", "report"),
        ("doctor", "--json", "summary"),
        ("doctor", "--html", "report"),
        ("params", "--json", "audit"),
        ("dataloader", "--json", "loader figures"),
    ],
)
def test_an_unwritable_output_stops_the_verb_before_the_script_starts(
    tmp_path, locked_folder, marker_script, capsys, verb, option, what
):
    path, marker = marker_script
    for kind, (target, why) in _bad_targets(tmp_path, locked_folder).items():
        assert main([verb, option, target, str(path)]) == 2, kind
        err = capsys.readouterr().err
        assert err.startswith(f"stepscope: {option} {target}: cannot write the {what}: {why}"), (kind, err)
        assert len(err.splitlines()) == 1, err
        assert not marker.exists(), f"{kind}: the script ran before the check"


def test_ab_and_trace_check_their_json_before_they_start(tmp_path, locked_folder, marker_script, capsys):
    path, marker = marker_script
    trace = tmp_path / "rank0.json"
    Kineto(rank=0).write(trace)
    for kind, (target, why) in _bad_targets(tmp_path, locked_folder).items():
        argv = ["ab", "--json", target, "--variant", f"a=python {path}", "--variant", f"b=python {path}"]
        assert main(argv) == 2, kind
        assert capsys.readouterr().err.startswith(f"stepscope: --json {target}: cannot write the A/B results: {why}")
        assert not marker.exists(), f"{kind}: a variant ran before the check"
        assert main(["trace", str(trace), "--json", target, "--jobs", "1"]) == 2, kind
        captured = capsys.readouterr()
        assert captured.err.startswith(f"stepscope: --json {target}: cannot write the trace analysis: {why}")
        assert captured.out == "", "the traces were analysed before the check"


def test_a_missing_parent_folder_is_created_and_written(tmp_path, capsys):
    source = tmp_path / "run.json"
    RunSummary().to_json(source)
    target = tmp_path / "new" / "deeper" / "r.html"
    assert main(["report", str(source), "--html", str(target)]) == 0
    assert target.read_text().startswith("<!")
    assert capsys.readouterr().out == f"report written to {target}\n"


@pytest.mark.skipif(not HAS_DEV_FULL, reason="needs /dev/full")
def test_a_full_disk_after_the_run_loses_one_output_not_the_other_nor_the_exit_code(tmp_path):
    html = tmp_path / "r.html"
    # basic.py ends on its own after 6 steps with exit code 3, before the 50 steps stepscope would measure
    args = ("--json", "/dev/full", "--html", str(html), script("basic.py"), "--iters", "6", "--exit-code", "3")
    cmd = stepscope_cmd(None, *args, warmup=1, steps=50)
    done = subprocess.run(cmd, cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "stepscope: --json /dev/full: could not write the summary (No space left on device)." in done.stderr
    assert html.read_text(encoding="utf-8").startswith("<!"), "the HTML report was lost with the JSON"
    assert f"report written to {html}" in done.stdout


@pytest.mark.parametrize("verb", ["run", "doctor"])
def test_a_stdout_closed_early_loses_neither_the_files_nor_the_exit_code(tmp_path, verb):
    # `stepscope run --json X train.py | head -1`: the reader goes after one line. Before, the JSON was written after
    # the report, rich's broken pipe ended stepscope with exit 1 and nothing on stderr, and X was never written.
    out, html = tmp_path / "s.json", tmp_path / "r.html"
    quiet = tmp_path / "quiet.py"  # trains 8 steps, prints nothing, exits 3
    quiet.write_text(
        "import sys, torch\n"
        "model = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(8):\n"
        "    model(torch.randn(2, 4)).sum().backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
        "sys.exit(3)\n"
    )
    args = ("--json", str(out), "--html", str(html), str(quiet))
    cmd = stepscope_cmd(None, *args, warmup=1, steps=50, verb=verb)
    head = subprocess.Popen(["head", "-1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    done = subprocess.run(cmd, cwd=tmp_path, env=run_env(), stdout=head.stdin, stderr=subprocess.PIPE, text=True,
                          timeout=180)  # fmt: skip
    head.stdin.close()
    first = head.stdout.read().decode()
    head.wait(timeout=30)
    assert first.startswith("stepscope"), first  # head read the report's first line and left
    assert done.returncode == 3, done.stderr  # the script's own code
    assert "Traceback" not in done.stderr and "Broken pipe" not in done.stderr, done.stderr
    assert RunSummary.from_json(out).steps.measured > 0
    assert html.read_text(encoding="utf-8").startswith("<!")


@pytest.mark.skipif(not HAS_DEV_FULL, reason="needs /dev/full")
def test_trace_json_on_a_full_disk_is_one_sentence_and_the_report_stands(tmp_path, capsys):
    trace = Kineto(rank=0)
    trace.step(1, 0, 1000)
    trace.kernel("gemm", 100, 800)
    trace.write(tmp_path / "rank0.json")
    assert main(["trace", str(tmp_path), "--json", "/dev/full", "--jobs", "1"]) == 0
    captured = capsys.readouterr()
    assert "bound: " in captured.out
    assert (
        captured.err == "stepscope: --json /dev/full: could not write the trace analysis (No space left on device).\n"
    )


def test_trace_of_only_missing_paths_names_them_and_nothing_blank(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert main(["trace", str(missing)]) == 1
    captured = capsys.readouterr()
    assert captured.err == f"stepscope: {missing}: no such file or folder\n"
    assert "found in \n" not in captured.out and "found in  " not in captured.out


def test_the_measuring_verbs_have_a_description_and_say_why_sample_hz_differs():
    parser = build_parser()
    verbs = parser._subparsers._group_actions[0].choices  # argparse keeps the sub-parsers there
    for verb in ("run", "doctor"):
        assert verbs[verb].description, f"{verb} --help has no description"
    run_help = " ".join(verbs["run"].format_help().split())
    doctor_help = " ".join(verbs["doctor"].format_help().split())
    assert "(default 1; doctor samples at 4 Hz" in run_help
    assert "(default 4; run samples at 1 Hz" in doctor_help


def test_a_failed_dataloader_run_does_not_offer_no_stop(capsys):
    from stepscope.report.terminal import print_loader

    summary = RunSummary(exit=Exit(reason="stopped", code=0))
    result = {"ranks": [{"rank": 0, "index": 0, "dataset": "Broken", "error": "ValueError: bad sample"}]}
    out = io.StringIO()
    print_loader(result, summary, file=out)
    assert "--no-stop" not in out.getvalue() and "exit code 0" not in out.getvalue()
    assert "rank 0: the loader could not be measured: ValueError: bad sample" in out.getvalue()


def test_the_users_sitecustomize_is_the_one_in_sys_modules(tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("MARK = 'the user'\n")
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sys\nimport sitecustomize\nprint('mark:', sys.modules['sitecustomize'].MARK, sitecustomize.MARK)\n"
    )
    cmd = [sys.executable, "-m", "stepscope.cli", "run", str(probe)]
    env = run_env(pythonpath=(str(own),))
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "mark: the user the user" in done.stdout, done.stdout + done.stderr


def test_control_characters_from_a_run_never_reach_the_terminal_raw():
    from stepscope.report.terminal import print_summary, terminal_safe

    assert terminal_safe("a\x1b[2Jb\nc\rd\te\x07\u202e") == "a\\x1b[2Jb\\nc\\rd\\te\\x07\\u202e"
    assert terminal_safe("naïve · µs ×") == "naïve · µs ×"  # printable Unicode stays as it is
    summary = RunSummary(exit=Exit(reason="error", code=1, error="ValueError: bad\n\x1b[31mforged line"))
    summary.meta.command = "train.py --tag \x1b]0;title\x07"
    summary.notes = ["two\nlines"]
    out = io.StringIO()
    print_summary(summary, file=out)
    text = out.getvalue()
    assert "\x1b" not in text and "\x07" not in text
    assert text.splitlines() == [
        "stepscope · train.py --tag \\x1b]0;title\\x07 · cpu · timing: host clock",
        "the script failed: ValueError: bad\\n\\x1b[31mforged line (exit code 1); the figures are from the steps "
        "before the failure",
        "note: two\\nlines",
    ]


def test_a_trace_file_name_with_control_characters_is_printed_escaped(tmp_path, capsys):
    (tmp_path / "evil\x1b[31m\nname.json").write_text("not json")
    assert main(["trace", str(tmp_path), "--jobs", "1"]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert f"skipped {tmp_path}/evil\\x1b[31m\\nname.json: the file is not JSON" in out, out


def test_trace_sizes_are_given_in_the_unit_that_shows_them():
    from stepscope.instrument.profile import file_size

    assert file_size(24_000) == "24.0 KB"
    assert [file_size(n) for n in (0, 999, 1_000, 3_140_000, 1_200_000_000)] == [
        "0 B", "999 B", "1.0 KB", "3.1 MB", "1.20 GB"
    ]  # fmt: skip
