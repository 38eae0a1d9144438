"""End to end: ``stepscope params`` audits the parameters of unmodified scripts (tests/scripts/params_*.py).

The scripts' ground truth is known by construction (see each script's docstring):
params_train.py: ``aux_head`` never called, ``tok`` frozen and tied to ``out.weight``, ``odd`` used on odd steps,
``gate.scale`` reached with an all-zero gradient; params_ddp.py adds ``rank0_only`` (used on rank 0 only).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from run_helpers import SCRIPTS, cli_here, run_env, script

ITEM_KEYS = {"name", "module", "numel", "aliases", "reached_steps"}
HEADERS = ("UNUSED", "ZERO-GRAD", "FROZEN", "CONDITIONAL")

# params_train.py's tensors: name -> (module, numel).
TRAIN_TENSORS = {
    "tok.weight": ("tok", 512),
    "body.weight": ("body", 256),
    "body.bias": ("body", 16),
    "gate.scale": ("gate", 16),
    "odd.weight": ("odd", 256),
    "odd.bias": ("odd", 16),
    "aux_head.weight": ("aux_head", 64),
    "aux_head.bias": ("aux_head", 4),
    "out.bias": ("out", 32),
}
DDP_TENSORS = {**TRAIN_TENSORS, "rank0_only.weight": ("rank0_only", 256), "rank0_only.bias": ("rank0_only", 16)}
COMPILED_TENSORS = {
    "stem.weight": ("stem", 128),
    "stem.bias": ("stem", 16),
    "body.weight": ("body", 256),
    "body.bias": ("body", 16),
    "head.weight": ("head", 64),
    "head.bias": ("head", 4),
    "aux_head.weight": ("aux_head", 48),
    "aux_head.bias": ("aux_head", 3),
}


@dataclass
class ParamsResult:
    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str
    json_path: Path | None

    @property
    def data(self) -> dict[str, Any]:
        assert self.json_path is not None and self.json_path.exists(), f"no audit JSON written\n{self.describe()}"
        return json.loads(self.json_path.read_text())

    def describe(self) -> str:
        return (
            f"command: {' '.join(self.cmd)}\nexit code: {self.returncode}\n"
            f"--- stdout ---\n{self.stdout[-6000:]}\n--- stderr ---\n{self.stderr[-6000:]}"
        )


def stepscope_params(
    tmp_path: Path,
    *args: str,
    steps: int | None = None,
    zero_grad: bool = False,
    json_out: bool = True,
    timeout: float = 180,
    pythonpath: tuple[str, ...] = (),
) -> ParamsResult:
    """``python -m stepscope.cli params [--steps N] [--include-zero-grad] [--json tmp_path/params.json] ARGS...``; a
    script's training process runs in this one (``cli_here``), a module's or a launcher's in processes of their own."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    json_path = tmp_path / "params.json" if json_out else None
    cmd = [sys.executable, "-m", "stepscope.cli", "params"]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if zero_grad:
        cmd.append("--include-zero-grad")
    if json_path is not None:
        cmd += ["--json", str(json_path)]
    cmd += list(args)
    if args[0] not in ("--", "-m"):
        return ParamsResult(cmd, *cli_here(tmp_path, cmd), json_path)
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=run_env(pythonpath=pythonpath), capture_output=True, text=True, timeout=timeout
    )
    return ParamsResult(cmd, proc.returncode, proc.stdout, proc.stderr, json_path)


# -- reading the output -------------------------------------------------------------------------------------------


def names(items: list[dict[str, Any]]) -> list[str]:
    return sorted(item["name"] for item in items)


def by_name(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in items}


def check_items(data: dict[str, Any], tensors: dict[str, tuple[str, int]], r: ParamsResult) -> None:
    """Every listed item has the documented keys, a clean name, and the module and numel of the real tensor."""
    audits = [data, *data.get("models", [])]
    for audit in audits:
        for key in ("unused", "zero_grad", "frozen", "conditional"):
            for item in audit.get(key, []):
                assert set(item) >= ITEM_KEYS, f"{key} item {item} lacks {ITEM_KEYS - set(item)}\n{r.describe()}"
                name = item["name"]
                assert not name.startswith(("module.", "_orig_mod.")), f"wrapper prefix left in {name!r}"
                assert "._orig_mod." not in name and ".module." not in name, f"wrapper prefix left in {name!r}"
                if audit is data or audit.get("model") == data.get("model"):
                    assert name in tensors, f"unexpected tensor {name!r} in {key}\n{r.describe()}"
                    assert (item["module"], item["numel"]) == tensors[name], f"{item}\n{r.describe()}"


def section(stdout: str, title: str) -> list[str] | None:
    """The lines of the section headed ``title`` (up to the next section header or the tip), None if absent."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(rf"\s*{re.escape(title)}\b", line)), None)
    if start is None:
        return None
    body = []
    for line in lines[start + 1 :]:
        stripped = line.strip()
        if stripped.startswith("tip:") or any(re.match(rf"{re.escape(h)}\b", stripped) for h in HEADERS):
            break
        body.append(line)
    return body


def has_token(line: str, token: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(token)}(?![\w.])", line) is not None


def check_section(
    r: ParamsResult, title: str, expected: list[str], tensors: dict[str, tuple[str, int]], absent: list[str]
) -> None:
    """Section ``title`` lists each expected tensor on a line with its name, module and numel, and none of ``absent``
    (or says "(none)" when nothing is expected)."""
    body = section(r.stdout, title)
    assert body is not None, f"no {title} section\n{r.describe()}"
    text = "\n".join(body)
    if not expected:
        assert "(none)" in text, f"{title} is empty but has no '(none)' line\n{r.describe()}"
    for name in expected:
        module, numel = tensors[name]
        rows = [line for line in body if has_token(line, name)]
        assert rows, f"{name} not listed under {title}\n{r.describe()}"
        assert any(has_token(row, module) and has_token(row, f"{numel:,}") for row in rows), (
            f"{name} is listed under {title} without its module {module!r} and numel {numel} on its line: {rows}\n"
            f"{r.describe()}"
        )
    for name in absent:
        assert not any(has_token(line, name) for line in body), f"{name} wrongly listed under {title}\n{r.describe()}"


def tip(r: ParamsResult) -> str:
    """The tip line and what follows it (a tip may wrap onto the next line)."""
    lines = r.stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("tip:")), None)
    assert start is not None, f"no 'tip:' line\n{r.describe()}"
    return " ".join(line.strip() for line in lines[start : start + 3])


def says_script_sets_find_unused_true(r: ParamsResult) -> bool:
    """A line other than the tip says the script sets find_unused_parameters=True."""
    return any(
        "find_unused_parameters=True" in line and not line.lstrip().startswith("tip:") for line in r.stdout.splitlines()
    )


def rank_audits(data: dict[str, Any], r: ParamsResult) -> list[dict[str, Any]]:
    ranks = data.get("ranks")
    assert ranks, f"no per-rank audits in the JSON\n{r.describe()}"
    return list(ranks.values()) if isinstance(ranks, dict) else list(ranks)


# -- a single process -----------------------------------------------------------------------------------------------


def test_plain_script_every_class(tmp_path):
    r = stepscope_params(tmp_path, script("params_train.py"), steps=4)
    assert r.returncode == 0, r.describe()
    assert "params_train: start" in r.stdout, r.describe()
    assert "params_train: done" not in r.stdout, f"not stopped after 4 backward passes\n{r.describe()}"
    assert "Traceback" not in r.stderr, r.describe()

    d = r.data
    check_items(d, TRAIN_TENSORS, r)
    assert d["model"] == "Net", r.describe()
    assert d["steps"] == 4, r.describe()
    assert len(d["models"]) == 1, r.describe()
    assert d["models"][0]["model"] == "Net"
    assert names(d["unused"]) == ["aux_head.bias", "aux_head.weight"], r.describe()
    assert names(d["frozen"]) == ["tok.weight"], r.describe()
    assert d["frozen"][0]["aliases"] == ["out.weight"], r.describe()
    assert names(d["conditional"]) == ["odd.bias", "odd.weight"], r.describe()
    assert [item["reached_steps"] for item in d["conditional"]] == [2, 2], r.describe()
    assert d["zero_grad"] == [], r.describe()  # not checked without --include-zero-grad: gate.scale is used
    assert d["used_count"] == 4, r.describe()  # body.weight, body.bias, gate.scale, out.bias
    assert d["ddp_find_unused"] is None, r.describe()
    # The tied out.weight is one tensor with tok.weight, never an entry of its own.
    every = [i["name"] for k in ("unused", "zero_grad", "frozen", "conditional") for i in d[k]]
    assert "out.weight" not in every, r.describe()

    check_section(r, "UNUSED", ["aux_head.weight", "aux_head.bias"], TRAIN_TENSORS, ["body.weight", "tok.weight"])
    check_section(r, "FROZEN", ["tok.weight"], TRAIN_TENSORS, ["aux_head.weight", "body.weight", "odd.weight"])
    assert section(r.stdout, "ZERO-GRAD") is None, f"ZERO-GRAD listed without --include-zero-grad\n{r.describe()}"
    advice = tip(r)
    assert "find_unused_parameters=False is safe" not in advice, r.describe()
    assert "aux_head" in advice, f"the tip does not say what to fix\n{r.describe()}"
    assert not says_script_sets_find_unused_true(r), r.describe()


def test_include_zero_grad_and_a_second_model(tmp_path):
    r = stepscope_params(tmp_path, script("params_train.py"), "--calibrate", steps=4, zero_grad=True)
    assert r.returncode == 0, r.describe()
    assert "params_train: done" not in r.stdout, r.describe()
    d = r.data
    check_items(d, TRAIN_TENSORS, r)
    # Net has 9 parameter tensors, the Calibrator 1: Net is the primary model.
    assert d["model"] == "Net", r.describe()
    assert sorted(m["model"] for m in d["models"]) == ["Calibrator", "Net"], r.describe()
    calibrator = next(m for m in d["models"] if m["model"] == "Calibrator")
    assert calibrator["unused"] == [] and calibrator["frozen"] == [] and calibrator["zero_grad"] == [], calibrator
    assert calibrator["conditional"] == [], calibrator
    assert calibrator["used_count"] == 1, calibrator
    assert calibrator["steps"] == 4, calibrator

    assert names(d["zero_grad"]) == ["gate.scale"], r.describe()
    assert names(d["unused"]) == ["aux_head.bias", "aux_head.weight"], r.describe()
    assert names(d["conditional"]) == ["odd.bias", "odd.weight"], r.describe()
    assert names(d["frozen"]) == ["tok.weight"], r.describe()
    assert d["used_count"] == 3, r.describe()
    check_section(r, "ZERO-GRAD", ["gate.scale"], TRAIN_TENSORS, ["body.weight", "aux_head.weight", "tok.weight"])
    check_section(r, "UNUSED", ["aux_head.weight", "aux_head.bias"], TRAIN_TENSORS, ["gate.scale"])
    check_section(r, "FROZEN", ["tok.weight"], TRAIN_TENSORS, ["gate.scale"])
    order = [r.stdout.find(f"\n{h}") for h in ("UNUSED", "ZERO-GRAD", "FROZEN")]
    assert all(i >= 0 for i in order) and order == sorted(order), f"sections out of order {order}\n{r.describe()}"


def test_fully_used_model_as_module_is_safe(tmp_path):
    # -m MODULE, with the scripts folder on PYTHONPATH; every trainable tensor is reached on every step.
    r = stepscope_params(tmp_path, "-m", "params_train", "--clean", steps=2, pythonpath=(str(SCRIPTS),))
    assert r.returncode == 0, r.describe()
    assert "params_train: done" not in r.stdout, r.describe()
    d = r.data
    check_items(d, TRAIN_TENSORS, r)
    assert d["steps"] == 2, r.describe()
    assert d["unused"] == [] and d["conditional"] == [] and d["zero_grad"] == [], r.describe()
    assert names(d["frozen"]) == ["tok.weight"], r.describe()
    assert d["used_count"] == 6, r.describe()  # body.*, gate.scale, odd.*, out.bias
    check_section(r, "UNUSED", [], TRAIN_TENSORS, ["body.weight", "odd.weight", "tok.weight"])
    check_section(r, "FROZEN", ["tok.weight"], TRAIN_TENSORS, ["body.weight"])
    assert "UNUSED is empty: find_unused_parameters=False is safe" in tip(r), r.describe()


def test_default_is_one_backward_pass(tmp_path):
    r = stepscope_params(tmp_path, script("params_train.py"))
    assert r.returncode == 0, r.describe()
    d = r.data
    assert d["steps"] == 1, r.describe()
    # Step 0 skips the odd branch: in one pass it is not reached at all.
    assert names(d["unused"]) == ["aux_head.bias", "aux_head.weight", "odd.bias", "odd.weight"], r.describe()
    assert d["conditional"] == [], r.describe()


def test_compiled_model(tmp_path):
    r = stepscope_params(tmp_path, script("params_compiled.py"), steps=1)
    assert r.returncode == 0, r.describe()
    assert "params_compiled: done" not in r.stdout, r.describe()
    d = r.data
    check_items(d, COMPILED_TENSORS, r)
    assert d["model"] == "Small", r.describe()
    assert d["steps"] == 1, r.describe()
    assert names(d["unused"]) == ["aux_head.bias", "aux_head.weight"], r.describe()
    assert names(d["frozen"]) == ["stem.bias", "stem.weight"], r.describe()
    assert d["conditional"] == [] and d["zero_grad"] == [], r.describe()
    assert d["used_count"] == 4, r.describe()
    assert d["ddp_find_unused"] is None, r.describe()
    assert "_orig_mod" not in r.stdout, r.describe()
    check_section(r, "UNUSED", ["aux_head.weight", "aux_head.bias"], COMPILED_TENSORS, ["head.weight", "body.weight"])
    check_section(r, "FROZEN", ["stem.weight", "stem.bias"], COMPILED_TENSORS, ["head.weight"])


# -- several ranks -----------------------------------------------------------------------------------------------


def test_torchrun_ddp_two_ranks(tmp_path):
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *("--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"),
        script("params_ddp.py"),
    ]
    r = stepscope_params(tmp_path, "--", *launcher, steps=4, timeout=240)
    assert r.returncode == 0, r.describe()
    assert "params_ddp: rank" not in r.stdout, f"not stopped after 4 backward passes\n{r.describe()}"
    d = r.data
    check_items(d, DDP_TENSORS, r)
    assert d["model"] == "Net", r.describe()  # the user's class, not DistributedDataParallel
    assert d["steps"] == 4, r.describe()
    assert d["ddp_find_unused"] is True, r.describe()
    # rank0_only is reached on rank 0 only: unused on rank 1 is unused for DDP, so the union lists it.
    expected_unused = ["aux_head.bias", "aux_head.weight", "rank0_only.bias", "rank0_only.weight"]
    assert names(d["unused"]) == expected_unused, r.describe()
    assert names(d["frozen"]) == ["tok.weight"], r.describe()
    assert d["frozen"][0]["aliases"] == ["out.weight"], r.describe()
    assert names(d["conditional"]) == ["odd.bias", "odd.weight"], r.describe()
    assert [item["reached_steps"] for item in d["conditional"]] == [2, 2], r.describe()
    assert d["zero_grad"] == [], r.describe()
    assert d["used_count"] == 4, r.describe()  # body.weight, body.bias, gate.scale, out.bias

    ranks = rank_audits(d, r)
    assert len(ranks) == 2, r.describe()
    per_rank = sorted(names(audit["unused"]) for audit in ranks)
    assert per_rank == [["aux_head.bias", "aux_head.weight"], expected_unused], per_rank
    for audit in ranks:
        assert audit["ddp_find_unused"] is True, audit
        assert audit["steps"] == 4, audit
        assert names(audit["frozen"]) == ["tok.weight"], audit
        assert names(audit["conditional"]) == ["odd.bias", "odd.weight"], audit
        for key in ("unused", "frozen", "conditional"):
            for item in audit[key]:
                assert not item["name"].startswith("module."), item

    check_section(r, "UNUSED", expected_unused, DDP_TENSORS, ["body.weight", "tok.weight"])
    check_section(r, "FROZEN", ["tok.weight"], DDP_TENSORS, ["rank0_only.weight", "aux_head.weight"])
    assert not re.search(r"(?<![\w.])module\.", r.stdout), f"a DDP prefix is left in the output\n{r.describe()}"
    advice = tip(r)
    assert "find_unused_parameters=False is safe" not in advice, r.describe()
    assert says_script_sets_find_unused_true(r), f"does not say the script sets it\n{r.describe()}"


# -- bad input ------------------------------------------------------------------------------------------------------


def test_script_without_backward(tmp_path):
    r = stepscope_params(tmp_path, script("params_no_backward.py"), "--exit-code", "3", json_out=False)
    assert r.returncode == 3, r.describe()
    assert "params_no_backward: done" in r.stdout, r.describe()
    assert "Traceback" not in r.stderr, r.describe()
    assert re.search(r"no backward pass", r.stdout, re.IGNORECASE), r.describe()
    tensors = {"stem.weight": ("stem", 128), "stem.bias": ("stem", 16), "head.weight": ("head", 64)}
    check_section(r, "FROZEN", ["stem.weight", "stem.bias"], tensors, ["head.weight"])
    # Nothing can be told unused without a backward pass: head.* must not be listed as UNUSED.
    unused = section(r.stdout, "UNUSED")
    assert unused is None or not any(has_token(line, "head.weight") for line in unused), r.describe()
    assert "find_unused_parameters=False is safe" not in r.stdout, r.describe()


def test_script_without_backward_exit_zero(tmp_path):
    r = stepscope_params(tmp_path, script("params_no_backward.py"))
    assert r.returncode == 0, r.describe()
    assert re.search(r"no backward pass", r.stdout, re.IGNORECASE), r.describe()
    check_section(r, "FROZEN", ["stem.weight"], {"stem.weight": ("stem", 128)}, [])


def test_no_model_at_all(tmp_path):
    r = stepscope_params(tmp_path, script("params_no_params.py"), "--mode", "none", steps=2)
    assert r.returncode == 0, r.describe()
    assert "Traceback" not in r.stderr, r.describe()
    assert re.search(r"no model|nothing to audit", r.stdout, re.IGNORECASE), r.describe()
    assert section(r.stdout, "UNUSED") is None, r.describe()


def test_model_without_parameters(tmp_path):
    r = stepscope_params(tmp_path, script("params_no_params.py"), "--mode", "empty", steps=2)
    assert r.returncode == 0, r.describe()
    assert "Traceback" not in r.stderr, r.describe()
    assert re.search(r"no model|no parameters|nothing to audit", r.stdout, re.IGNORECASE), r.describe()
    assert section(r.stdout, "UNUSED") is None, r.describe()


def test_missing_script(tmp_path):
    missing = tmp_path / "no_such_script.py"
    r = stepscope_params(tmp_path, str(missing))
    assert r.returncode == 2, r.describe()
    assert "stepscope:" in r.stderr, r.describe()
    assert "no_such_script.py" in r.stderr, r.describe()
    assert "Traceback" not in r.stderr, r.describe()
    assert not (tmp_path / "params.json").exists()


def test_steps_must_be_positive(tmp_path):
    r = stepscope_params(tmp_path, script("params_train.py"), steps=0)
    assert r.returncode == 2, r.describe()
    assert "params_train: start" not in r.stdout, r.describe()
