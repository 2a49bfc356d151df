"""Notebook → torchrun-safe Python script.

Vocabulary and contract:

- **cell index**: the 0-based position of a cell in ``nb.cells``, markdown and raw cells counted
  (what JupyterLab's ``activeCellIndex`` and nbformat's list use). The ``cells`` argument speaks
  in indexes: ``"all"``, an ``int`` (every cell up to and including that index) or a list of
  indexes (exactly those cells, in notebook order).
- **cell number** ``#n``: the 1-based position, ``#n == index + 1``. Every message, the generated
  header and tracebacks speak in numbers ("cell #4 uses %pip (line 2)"), so a user can count cells
  down the notebook. Line numbers are 1-based within the cell.
- Only code cells run; a cell whose ``metadata.tags`` holds ``skip-distributed`` is always left
  out, even when selected.
- **Magics and shell escapes** are rewritten by IPython's own ``TransformerManager`` and then
  judged, because the rewritten calls need ``get_ipython()``, which does not exist under torchrun:
  a small allow-list of line magics that only tune the interactive session is dropped (the line
  becomes ``pass  # gpupool: dropped %...``, so line numbers stay put):
  ``%matplotlib``, ``%config``, ``%autoreload``, ``%aimport``, ``%load_ext autoreload`` and
  ``%reload_ext autoreload``. Everything else (``%pip``, ``%time``, ``%%bash``, ``!cmd``,
  ``x = !cmd``, ``obj?``, …) is refused with a :class:`ConversionError` listing every offending
  cell and line. An explicit ``get_ipython()`` in the user's own code is left alone (it may be
  guarded).
- A cell that does not compile (after the rewrite) is refused the same way.

The generated script only *defines* things at import; all work happens in ``main()``, which runs
the cells one by one with ``exec`` in the module's own global namespace. So cell code keeps its
notebook meaning exactly (top-level names are module globals, ``global``/``import *`` work),
functions and classes defined in cells are ordinary ``__main__`` attributes that pickle by
reference (DataLoader workers, ``torch.save``), and tracebacks name the cell and show its lines:
``File "train.ipynb, cell #4", line 7``. A multiprocessing child started with *spawn* or
*forkserver* imports the script as ``__mp_main__``; it then replays only the cells' top-level
imports, functions, classes and literal constants, as a hand-written script with a
``__main__`` guard would, so those functions unpickle there too. ``display`` is provided as
``print`` unless a cell defines it (the last expression of a cell is not shown, as in any script).
"""

from __future__ import annotations

import ast
import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import nbformat
from IPython.core.inputtransformer2 import TransformerManager

__all__ = ["SKIP_TAG", "ConversionError", "Problem", "notebook_to_script"]

SKIP_TAG = "skip-distributed"

#: line magics dropped harmlessly (they only tune the interactive session); value: the allowed
#: first argument, or None for any arguments
DROPPED_MAGICS: dict[str, str | None] = {
    "matplotlib": None,
    "config": None,
    "autoreload": None,
    "aimport": None,
    "load_ext": "autoreload",
    "reload_ext": "autoreload",
}

Cells = Literal["all"] | int | Sequence[int]


@dataclass(frozen=True)
class Problem:
    """One refused spot: a 1-based cell number, a 1-based line in that cell, and what is wrong."""

    cell: int
    line: int
    what: str
    fix: str = f"remove it or tag the cell {SKIP_TAG}"

    def __str__(self) -> str:
        return f"cell #{self.cell} {self.what} (line {self.line}): {self.fix}"


class ConversionError(ValueError):
    """The notebook cannot run under torchrun as it is; ``problems`` lists every refused spot."""

    def __init__(self, message: str, problems: Sequence[Problem] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems)


@dataclass(frozen=True)
class _Cell:
    number: int
    source: str
    dropped: tuple[str, ...]


def notebook_to_script(
    nb: nbformat.NotebookNode | str | Path,
    *,
    cells: Cells = "all",
    name: str | None = None,
) -> str:
    """Return the source of a torchrun-safe script that runs the notebook's code cells.

    ``nb`` is a notebook node, a path, or notebook JSON text (a ``str`` starting with ``{``).
    ``name`` names the source in the header and in tracebacks (default: the file name, or
    "notebook"). Raises :class:`ConversionError` (a ``ValueError``) naming every refused cell.
    """
    notebook, default_name = _load(nb)
    name = name or default_name
    chosen = _choose(notebook, cells)
    converted: list[_Cell] = []
    skipped: list[int] = []
    problems: list[Problem] = []
    for index in chosen:
        cell = notebook.cells[index]
        if cell.get("cell_type") != "code":
            continue
        if SKIP_TAG in (cell.get("metadata", {}).get("tags") or []):
            skipped.append(index + 1)
            continue
        result = _convert_cell(index + 1, _source(cell))
        if isinstance(result, _Cell):
            if result.source.strip():
                converted.append(result)
        else:
            problems.extend(result)
    if problems:
        raise ConversionError("\n".join(map(str, problems)), problems)
    if not converted:
        raise ConversionError(f"{name}: no code cells to run (after {SKIP_TAG} and selection)")
    return _render(name, converted, skipped)


# -- input ----------------------------------------------------------------------------------------


def _load(nb: nbformat.NotebookNode | str | Path) -> tuple[nbformat.NotebookNode, str]:
    if isinstance(nb, Path) or (isinstance(nb, str) and not nb.lstrip().startswith("{")):
        path = Path(nb)
        try:
            return nbformat.read(path, as_version=4), path.name
        except OSError as exc:
            raise ConversionError(f"cannot read notebook {path}: {exc.strerror or exc}") from exc
        except Exception as exc:  # nbformat's JSON and validation errors
            raise ConversionError(f"{path} is not a readable notebook: {exc}") from exc
    if isinstance(nb, str):
        try:
            return nbformat.reads(nb, as_version=4), "notebook"
        except Exception as exc:
            raise ConversionError(f"not a readable notebook: {exc}") from exc
    node: nbformat.NotebookNode = nbformat.from_dict(nb)  # a plain dict works too
    if node.get("nbformat", 4) != 4:
        node = nbformat.convert(node, 4)
    return node, "notebook"


def _choose(notebook: nbformat.NotebookNode, cells: Cells) -> list[int]:
    count = len(notebook.cells)
    if cells == "all":
        return list(range(count))
    if isinstance(cells, bool | str):
        raise ConversionError(f'cells must be "all", an index or a list of indexes, not {cells!r}')
    if isinstance(cells, int):
        if not 0 <= cells < count:
            raise ConversionError(f"cell index {cells} is out of range: the notebook has {count}")
        return list(range(cells + 1))
    chosen = sorted(set(cells))
    bad = [i for i in chosen if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count]
    if bad:
        raise ConversionError(f"cell indexes {bad} are out of range: the notebook has {count}")
    return chosen


def _source(cell: nbformat.NotebookNode) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else str(source)


# -- one cell -------------------------------------------------------------------------------------


def _convert_cell(number: int, original: str) -> _Cell | list[Problem]:
    try:
        transformed = TransformerManager().transform_cell(original)
    except Exception as exc:  # IPython gives up on some malformed input
        return [Problem(number, 1, f"cannot be read by IPython ({exc})", "fix it")]
    # IPython drops leading blank lines; put them back so line numbers match the cell
    transformed = "\n" * (_leading_blank(original) - _leading_blank(transformed)) + transformed
    mapping = _line_map(original, transformed)
    try:
        tree = ast.parse(transformed)
    except SyntaxError as exc:
        return [_syntax_problem(number, exc, mapping)]
    lines, original_lines = _lines(transformed), _lines(original)
    drops: dict[int, str] = {}
    problems: list[Problem] = []
    magic_calls = _magic_calls(tree)
    for stmt in _statements(tree):
        call = _droppable(stmt)
        if call is not None and stmt.lineno == stmt.end_lineno and mapping[stmt.lineno][1]:
            text = original_lines[mapping[stmt.lineno][0] - 1].strip()
            drops[stmt.lineno] = text
            magic_calls.pop(id(call), None)
    for call in sorted(magic_calls.values(), key=lambda c: (c.lineno, c.col_offset)):
        line, rewritten = mapping.get(call.lineno, (call.lineno, False))
        if rewritten:
            problems.append(Problem(number, line, f"uses {_describe(call)}"))
    if problems:
        return problems
    for lineno, text in drops.items():
        indent = re.match(r"\s*", lines[lineno - 1])
        lines[lineno - 1] = f"{indent.group(0) if indent else ''}pass  # gpupool: dropped {text}"
    source = "\n".join(lines) + "\n"
    try:  # the compiler proper also refuses `await`, `return` and `yield` outside a function
        compile(source, f"cell #{number}", "exec", dont_inherit=True)
    except SyntaxError as exc:
        return [_syntax_problem(number, exc, mapping)]
    return _Cell(number, source, tuple(drops.values()))


def _syntax_problem(number: int, exc: SyntaxError, mapping: dict[int, tuple[int, bool]]) -> Problem:
    line = mapping.get(exc.lineno or 1, (exc.lineno or 1, False))[0]
    return Problem(number, line, f"has a syntax error: {exc.msg}", "fix it")


def _lines(text: str) -> list[str]:
    """Lines as Python's tokenizer sees them (``str.splitlines`` also splits at \\f, \\v, …)."""
    return text.removesuffix("\n").split("\n") if text else []


def _leading_blank(text: str) -> int:
    lines = _lines(text)
    return next((i for i, line in enumerate(lines) if line.strip()), len(lines))


def _line_map(original: str, transformed: str) -> dict[int, tuple[int, bool]]:
    """Map each 1-based transformed line to (original line, whether IPython rewrote it)."""
    before, after = _lines(original), _lines(transformed)
    mapping: dict[int, tuple[int, bool]] = {}
    matcher = difflib.SequenceMatcher(a=before, b=after, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        for j in range(j1, j2):
            i = min(i1 + (j - j1), max(i2 - 1, i1))
            mapping[j + 1] = (min(i, max(len(before) - 1, 0)) + 1, tag != "equal")
    return mapping


def _statements(tree: ast.AST) -> list[ast.stmt]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.stmt)]


def _is_ipython_call(node: ast.AST) -> bool:
    """``get_ipython().<method>(...)``, the shape every IPython rewrite takes."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Call)
        and isinstance(node.func.value.func, ast.Name)
        and node.func.value.func.id == "get_ipython"
    )


def _magic_calls(tree: ast.AST) -> dict[int, ast.Call]:
    return {id(n): n for n in ast.walk(tree) if isinstance(n, ast.Call) and _is_ipython_call(n)}


def _literal_args(call: ast.Call) -> list[str]:
    return [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]


def _droppable(stmt: ast.stmt) -> ast.Call | None:
    """The allow-listed line magic this statement consists of, if it is exactly one."""
    if not (isinstance(stmt, ast.Expr) and _is_ipython_call(stmt.value)):
        return None
    call = stmt.value
    assert isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
    args = _literal_args(call)
    if call.func.attr != "run_line_magic" or len(args) != 2 or args[0] not in DROPPED_MAGICS:
        return None
    required = DROPPED_MAGICS[args[0]]
    if required is not None and args[1].split() != [required]:
        return None
    return call


def _describe(call: ast.Call) -> str:
    assert isinstance(call.func, ast.Attribute)
    method, args = call.func.attr, _literal_args(call)
    if method == "run_line_magic" and args:
        if args[0] in ("pinfo", "pinfo2", "psearch"):
            return f"IPython help ?{(args[1:] or [''])[0]}".rstrip()
        return _short(f"%{args[0]} {' '.join(args[1:2])}".rstrip())
    if method == "run_cell_magic" and args:
        return _short(f"%%{args[0]} {' '.join(args[1:2])}".rstrip())
    if method in ("system", "getoutput") and args:
        return _short(f"a shell escape !{args[0]}")
    return f"get_ipython().{method}()"


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# -- output ---------------------------------------------------------------------------------------

_RUNTIME = '''

def _gpupool_run_cell(number, source):
    """Run one cell in this module's namespace; tracebacks show the cell's own lines."""
    filename = f"{NOTEBOOK}, cell #{number}"
    lines = [line + "\\n" for line in source.split("\\n")]
    linecache.cache[filename] = (len(source), None, lines, filename)
    exec(compile(source, filename, "exec"), globals())


def _gpupool_define_only():
    """For a spawn/forkserver child: replay top-level imports, defs, classes and literals."""
    import ast

    definitions = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for number, source in _GPUPOOL_CELLS:
        filename = f"{NOTEBOOK}, cell #{number}"
        for node in ast.parse(source, filename).body:
            if isinstance(node, ast.Assign):
                try:
                    ast.literal_eval(node.value)
                except Exception:
                    continue
            elif not isinstance(node, definitions):
                continue
            try:
                exec(compile(ast.Module([node], []), filename, "exec"), globals())
            except Exception:
                pass  # best effort: what cannot be defined here fails to unpickle, by name


def main():
    """Run the notebook's cells in order, as the notebook would."""
    cells, run_cell = list(_GPUPOOL_CELLS), _gpupool_run_cell
    globals().setdefault("display", print)
    for number, source in cells:
        run_cell(number, source)


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":
    _gpupool_define_only()
'''


def _render(name: str, cells: list[_Cell], skipped: list[int]) -> str:
    numbers = ", ".join(f"#{c.number}" for c in cells)
    header = [
        f"# Generated by gpupool from {name!r}: edit the notebook, not this file.",
        "# Cells are numbered from 1 in notebook order, markdown cells counted.",
        f"# Cells included: {numbers}",
    ]
    if skipped:
        header.append(f"# Left out (tagged {SKIP_TAG}): " + ", ".join(f"#{n}" for n in skipped))
    for cell in cells:
        for text in cell.dropped:
            header.append(f"# Dropped from cell #{cell.number}: {text}")
    body = [
        '"""A notebook as a torchrun-safe script: importing it only defines; main() runs."""',
        "",
        "import linecache",
        "",
        f"NOTEBOOK = {name!r}",
        "",
        "_GPUPOOL_CELLS = [",
    ]
    for cell in cells:
        body.append(f"    # ---- cell #{cell.number} ----")
        body.append(f"    ({cell.number}, {_literal(cell.source)}),")
    body.append("]")
    return "\n".join(header) + "\n" + "\n".join(body) + "\n" + _RUNTIME


def _literal(source: str) -> str:
    """A readable string literal for a cell: a raw triple-quoted block when that is exact."""
    if "'''" not in source and all(ch in "\n\t" or ch.isprintable() for ch in source):
        candidate = "r'''\n" + source + "'''[1:]"
        try:
            if ast.literal_eval(candidate.removesuffix("[1:]"))[1:] == source:
                return candidate
        except (SyntaxError, ValueError):
            pass
    return repr(source)
