"""Every child process that runs as another account is started through
:func:`gpupool.usercode.become` (its uid, its primary group and exactly its supplementary groups):
``subprocess`` / ``asyncio`` calls with ``user=`` and not ``extra_groups=`` keep the parent's
groups, so a child of a root hub or test kept group root and what it reaches (read off the
source of every Python file in the repository, so such a call cannot come back)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("hub", "spawner", "labextension/gpupool_lab", "tests", "benchmarks", "scripts")
STARTERS = {
    "run", "Popen", "call", "check_call", "check_output", "create_subprocess_exec",
    "create_subprocess_shell",
}  # fmt: skip


def python_files() -> list[Path]:
    files = [ROOT / "jupyterhub_config.py"]
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and "node_modules" not in path.parts and is_python(path):
                files.append(path)
    return files


def is_python(path: Path) -> bool:
    """A ``.py`` file, or a script without a suffix whose ``#!`` line names Python."""
    if path.suffix:
        return path.suffix == ".py"
    with path.open("rb") as f:
        first = f.readline()
    return first.startswith(b"#!") and b"python" in first


def callee(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def keeps_parent_groups(tree: ast.AST) -> list[int]:
    """Lines of calls that start a child as another account with the parent's groups."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and callee(node) in STARTERS:
            keywords = {k.arg for k in node.keywords}
            if "user" in keywords and "extra_groups" not in keywords:
                lines.append(node.lineno)
    return lines


def test_the_scan_finds_a_child_started_with_user_alone() -> None:
    bad = (
        "subprocess.run(['id'], user='gpupool-demo')\nasyncio.create_subprocess_exec('id', user=1)"
    )
    good = "subprocess.run(['id'], **become(a))\nsubprocess.run(['id'], user=1, extra_groups=[])"
    assert keeps_parent_groups(ast.parse(bad)) == [1, 2]
    assert keeps_parent_groups(ast.parse(good)) == []


def test_no_child_runs_as_another_account_with_the_parents_groups() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in python_files()
        for line in keeps_parent_groups(ast.parse(path.read_text(), str(path)))
    ]
    assert not found, f"start these through gpupool.usercode.become(account): {found}"
