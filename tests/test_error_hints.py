"""Every hint says what a user types (`imageops export ...`), never a Python function or module.

The hints are read from the source: each call of an ImageOpsError subclass in app/, flows/, tasks/
and models/ and its hint (the second argument, or ``hint=``), with the text of the variables,
helper functions and f-strings it is made of. A person reading ``what to do:`` runs commands; a
name like ``tasks.inference.export.export_onnx`` or ``open_run()`` is no use to them.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "flows", "tasks", "models")

# What a Python name looks like in prose; CLI text (`imageops train --open-run`, models:/m@a,
# params.yaml, max_top1_drop, precision='fp32', `python -m json.tool`) matches none of these.
PYTHON_NAMES = re.compile(
    r"\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+\("  # a dotted call: launch.train(
    r"|\b[A-Za-z]\w*_\w*\("  # a snake_case call: export_onnx(
    r"|\b[A-Za-z_]\w*\(\)"  # any call with no arguments: train()
    r"|\b(?:app|flows|tasks|models|bench|tests)\.[a-z_]\w*"  # our modules: tasks.inference.export
    r"|\b(?:app|flows|tasks|models|bench|tests)/[\w/]*\w\.py\b"  # our source files: app/cli.py
)


def error_classes(trees: list[ast.Module]) -> set[str]:
    """ImageOpsError and every class that derives from it, by name, across ``trees``."""
    bases: dict[str, set[str]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {ast.unparse(b).rpartition(".")[2] for b in node.bases}
    found = {"ImageOpsError"}
    while more := {name for name, parents in bases.items() if parents & found} - found:
        found |= more
    return found


def hints(tree: ast.Module, errors: set[str]) -> Iterator[tuple[int, str]]:
    """``(line, text)`` of the hint of every call of an error class in ``tree``."""
    functions = {
        node.name: node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    assigned: dict[str, list[ast.expr]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    assigned.setdefault(target.id, []).append(node.value)

    def text(expr: ast.expr | None, depth: int = 0) -> str:
        """The static text of ``expr``; what is known only at run time reads ``{}``."""
        if expr is None or depth > 5:
            return ""
        if isinstance(expr, ast.Constant):
            return expr.value if isinstance(expr.value, str) else ""
        if isinstance(expr, ast.JoinedStr):
            return "".join(text(part, depth) for part in expr.values)
        if isinstance(expr, ast.FormattedValue):  # only helpers are followed into f-strings
            return text(expr.value, depth) if isinstance(expr.value, ast.Call) else "{}"
        if isinstance(expr, ast.BinOp):
            return text(expr.left, depth + 1) + text(expr.right, depth + 1)
        if isinstance(expr, ast.IfExp):
            return f"{text(expr.body, depth + 1)} | {text(expr.orelse, depth + 1)}"
        if isinstance(expr, ast.Name):
            return " | ".join(text(value, depth + 1) for value in assigned.get(expr.id, []))
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name):
            helper = functions.get(expr.func.id)
            if helper is not None:
                returns = [n.value for n in ast.walk(helper) if isinstance(n, ast.Return)]
                return " | ".join(text(value, depth + 1) for value in returns)
        return "{}"

    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func).rpartition(".")[2]
        if name not in errors:
            continue
        hint = node.args[1] if len(node.args) > 1 else None
        hint = next((k.value for k in node.keywords if k.arg == "hint"), hint)
        if hint is not None:
            yield node.lineno, text(hint)


def python_names_in_hints(sources: dict[str, str]) -> list[str]:
    """``file:line: name in "hint"`` for every Python name in a hint of ``sources``."""
    trees = {path: ast.parse(source) for path, source in sources.items()}
    errors = error_classes(list(trees.values()))
    found = []
    for path, tree in trees.items():
        for line, hint in hints(tree, errors):
            for match in PYTHON_NAMES.finditer(hint):
                found.append(f"{path}:{line}: {match.group()!r} in {hint!r}")
    return found


def _sources() -> dict[str, str]:
    return {
        str(path.relative_to(REPO)): path.read_text()
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
    }


def test_no_hint_names_a_python_function_or_module() -> None:
    sources = _sources()
    assert len(sources) > 50  # the packages were found
    assert python_names_in_hints(sources) == []


def test_the_scan_reads_every_hint() -> None:
    """The scan sees the real hints: one spelled out, one from a helper, one from a variable."""
    sources = _sources()
    trees = {path: ast.parse(source) for path, source in sources.items()}
    errors = error_classes(list(trees.values()))
    assert {"NotLabeledDatasetError", "PretrainedWeightsMissingError"} <= errors
    assert "RegistryUnreachableError" in errors  # a subclass of a subclass
    found = {path: [text for _, text in hints(tree, errors)] for path, tree in trees.items()}
    assert sum(len(texts) for texts in found.values()) > 150
    assert any("`imageops convert SOURCE DEST`" in t for t in found["tasks/data/imagedir.py"])
    assert any("--no-pretrained" in t for t in found["models/pretrained.py"])  # via a helper
    assert any("`imageops train` wrote" in t for t in found["models/directory.py"])  # via `hint`


PLANTED = """
from tasks.shared.errors import ImageOpsError, InvalidDatasetError

class SplitError(InvalidDatasetError):
    pass

_HINT = "Call tasks.data.split.split on the data."

def _advice(path):
    return f"Run export_onnx({path}) first."

def refuse(path, quantized):
    raise InvalidDatasetError("bad", _HINT)
    raise SplitError("bad", hint=_advice(path))
    raise ImageOpsError("bad", "Run the quantize step." if quantized else "Call train() again.")
    raise ImageOpsError("bad", f"See app/cli.py near {path}.")
    raise ImageOpsError("bad", "Run `imageops export MODEL`; see models:/m@champion, "
                        "max_top1_drop, precision='fp32', `python -m json.tool f.json`, model(s).")
    raise ValueError("not ours", "tasks.x.y()")
"""


def test_the_scan_finds_planted_python_names() -> None:
    errors_py = {p: (REPO / p).read_text() for p in ("models/errors.py", "tasks/shared/errors.py")}
    found = python_names_in_hints({**errors_py, "planted.py": PLANTED})
    names = [line.split(": ", 1)[1].split(" in ", 1)[0] for line in found]
    assert names == ["'tasks.data'", "'export_onnx('", "'train()'", "'app/cli.py'"], found


@pytest.mark.parametrize(
    "hint",
    [
        "Run `imageops export data/model` first.",
        "Open the run once with `imageops train ... --open-run` and pass its id with --run-id.",
        "Use models:/<name>@<alias> (e.g. models:/imageops-classifier@champion).",
        "Set `pretrained: false` under `model` in params.yaml, or raise max_top1_drop.",
        "Use precision='auto' or 'fp32'; allow more time with rdzv_timeout_s (--rdzv-timeout).",
        "Fix the JSON there (`python -m json.tool labels.json` shows where it breaks).",
        "Check the model(s) and the transform.json (e.g. center_crop_size).",
    ],
)
def test_cli_text_is_not_taken_for_a_python_name(hint: str) -> None:
    source = f"from models.errors import ImageOpsError\nraise ImageOpsError('bad', {hint!r})\n"
    assert python_names_in_hints({"ok.py": source}) == []
