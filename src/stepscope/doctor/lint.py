"""Static pass over a training script: settings that only the source shows, with their line numbers.

The runtime facts (facts.py) say what a setting *is*; the source says *where* it was set, which is what a user
needs to change it. A few things are only visible here: a ``gradcheck`` call, a ``.item()`` inside the loop body.
The pass reads the AST and never imports or runs the script.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

# method calls that wait for the device when made on a CUDA tensor
SYNC_METHODS = ("item", "cpu", "tolist", "numpy")
PROFILER_CALLS = ("profile", "emit_nvtx")


@dataclass
class LintHit:
    """One finding in the source: what it is, where, and the line as written."""

    kind: str
    line: int
    text: str

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "line": self.line, "text": self.text}


class LintError(ValueError):
    """The script cannot be read or parsed."""


def _dotted(node: ast.AST) -> str:
    """``torch.backends.cudnn.benchmark`` for an attribute chain; the last names that can be read."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local names bound by imports, to the dotted names they stand for (``DDP`` -> ``torch.nn.parallel.
    DistributedDataParallel``, ``profile`` -> ``torch.profiler.profile``), so calls read as their full names."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
    return names


class _Visitor(ast.NodeVisitor):
    def __init__(self, lines: list[str], aliases: dict[str, str]) -> None:
        self.lines = lines
        self.aliases = aliases
        self.hits: list[LintHit] = []
        self.loop_depth = 0

    def hit(self, kind: str, node: ast.AST) -> None:
        line = getattr(node, "lineno", 0)
        text = self.lines[line - 1].strip() if 0 < line <= len(self.lines) else ""
        self.hits.append(LintHit(kind, line, text))

    def visit_For(self, node: ast.For | ast.AsyncFor | ast.While) -> None:
        for child in (node.target, node.iter) if isinstance(node, (ast.For, ast.AsyncFor)) else (node.test,):
            self.visit(child)
        self.loop_depth += 1
        for child in node.body:
            self.visit(child)
        self.loop_depth -= 1
        for child in node.orelse:
            self.visit(child)

    visit_AsyncFor = visit_For
    visit_While = visit_For

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        # A function defined inside the loop does not run once per iteration because of where it is written.
        outer = self.loop_depth
        self.loop_depth = 0
        self.generic_visit(node)
        self.loop_depth = outer

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            name = _dotted(target)
            if name.endswith("cudnn.benchmark"):
                self.hit("cudnn_benchmark_on" if _is_true(node.value) else "cudnn_benchmark_off", node)
            elif name.endswith("cudnn.deterministic") and _is_true(node.value):
                self.hit("deterministic", node)
            elif name.endswith("matmul.allow_tf32") and isinstance(node.value, ast.Constant):
                self.hit("tf32_on" if node.value.value is True else "tf32_off", node)
        self.generic_visit(node)

    def resolve(self, name: str) -> str:
        head, _, rest = name.partition(".")
        full = self.aliases.get(head, head)
        return f"{full}.{rest}" if rest else full

    def visit_Call(self, node: ast.Call) -> None:
        name = self.resolve(_dotted(node.func))
        last = name.rsplit(".", 1)[-1]
        args = node.args
        if last == "detect_anomaly" or (last == "set_detect_anomaly" and args and _is_true(args[0])):
            self.hit("anomaly", node)
        elif last in ("gradcheck", "gradgradcheck"):
            self.hit("gradcheck", node)
        elif last in PROFILER_CALLS and "profiler" in name:
            self.hit("profiler", node)
        elif last == "use_deterministic_algorithms" and args and _is_true(args[0]):
            self.hit("deterministic", node)
        elif last == "DataLoader":
            workers = _keyword(node, "num_workers")
            unpacked = any(k.arg is None for k in node.keywords)  # DataLoader(ds, **kwargs): cannot tell
            if (workers is None and not unpacked) or (isinstance(workers, ast.Constant) and workers.value == 0):
                self.hit("num_workers_zero", node)
        elif last == "zero_grad":
            keep = _keyword(node, "set_to_none") or (args[0] if args else None)
            if isinstance(keep, ast.Constant) and keep.value is False:
                self.hit("zero_grad_keep", node)
        elif last == "DistributedDataParallel" and _is_true(_keyword(node, "find_unused_parameters")):
            self.hit("find_unused_parameters", node)
        elif last == "checkpoint" and "checkpoint" in name:
            self.hit("checkpoint", node)
        scalar_read = isinstance(node.func, ast.Attribute) and node.func.attr in SYNC_METHODS and not args
        if self.loop_depth and (scalar_read or name.endswith("cuda.synchronize")):
            self.hit("loop_sync", node)
        self.generic_visit(node)


def lint_source(source: str, filename: str = "<script>") -> list[LintHit]:
    """Findings in a script's source, in line order; raises LintError when it does not parse."""
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as error:
        raise LintError(f"{filename} does not parse (line {error.lineno}: {error.msg}).") from error
    visitor = _Visitor(source.splitlines(), _aliases(tree))
    visitor.visit(tree)
    return sorted(visitor.hits, key=lambda h: (h.line, h.kind))


def lint_file(path: str | Path) -> list[LintHit]:
    """Findings in a script file; raises LintError when it cannot be read or parsed."""
    path = Path(path)
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise LintError(f"cannot read {path}: {error}.") from error
    return lint_source(source, filename=str(path))
