"""notebook_to_script: cell choice, magics, and the shape of the generated script.

Generated scripts are run for real: in a subprocess where the test is about a clean interpreter
(importing does nothing, pickling across spawn/forkserver children), otherwise loaded in-process
as a module registered in ``sys.modules``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import pickle
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from gpupool_lab.convert import SKIP_TAG, ConversionError, notebook_to_script


def skip(source: str) -> nbformat.NotebookNode:
    return new_code_cell(source, metadata={"tags": [SKIP_TAG]})


@pytest.fixture
def load(tmp_path: Path) -> Iterator[object]:
    """Import generated source as a fresh module; returns the module (its cells not yet run)."""
    names: list[str] = []

    def _load(source: str) -> ModuleType:
        name = f"gpupool_generated_{len(names)}_{abs(hash(str(tmp_path)))}"
        path = tmp_path / f"{name}.py"
        path.write_text(source, encoding="utf-8")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        names.append(name)
        spec.loader.exec_module(module)
        return module

    yield _load
    for name in names:
        sys.modules.pop(name, None)


def run_script(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "job.py"
    script.write_text(source, encoding="utf-8")
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )


# -- cell choice ----------------------------------------------------------------------------------


def test_code_cells_run_in_order_markdown_and_skipped_cells_left_out(tmp_path: Path) -> None:
    nb = new_notebook(
        cells=[
            new_markdown_cell("# Title"),
            new_code_cell("order = ['first']"),
            skip("raise RuntimeError('interactive only')"),
            new_code_cell("order.append('second')"),
            new_code_cell(""),
            new_code_cell("order.append('third')\nprint(json.dumps(order))", metadata={"tags": []}),
        ]
    )
    nb.cells.insert(1, new_code_cell("import json"))
    source = notebook_to_script(nb, name="order.ipynb")
    result = run_script(tmp_path, source)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ["first", "second", "third"]
    header = [line for line in source.splitlines() if line.startswith("#")][:5]
    assert "'order.ipynb'" in header[0]
    assert "# Cells included: #2, #3, #5, #7" in header
    assert f"# Left out (tagged {SKIP_TAG}): #4" in header


def test_cells_up_to_an_index_and_selected_indexes(load) -> None:
    nb = new_notebook(
        cells=[
            new_code_cell("ran = [0]"),
            new_markdown_cell("text"),
            new_code_cell("ran.append(2)"),
            skip("ran.append(3)"),
            new_code_cell("ran.append(4)"),
        ]
    )
    upto = load(notebook_to_script(nb, cells=2))
    upto.main()
    assert upto.ran == [0, 2]
    selected = load(notebook_to_script(nb, cells=[4, 0, 3]))
    selected.main()
    assert selected.ran == [0, 4]  # notebook order; the skip tag wins over selection
    assert "# Cells included: #1, #5" in notebook_to_script(nb, cells=[4, 0, 3])


@pytest.mark.parametrize(
    ("cells", "message"),
    [
        (5, "cell index 5 is out of range: the notebook has 2"),
        ([0, 7], "cell indexes [7] are out of range"),
        (-1, "out of range"),
        ("some", "cells must be"),
        ([1], "no code cells to run"),
    ],
)
def test_bad_cell_choices_are_refused(cells: object, message: str) -> None:
    nb = new_notebook(cells=[new_code_cell("x = 1"), new_markdown_cell("m")])
    with pytest.raises(ConversionError, match=message.replace("[", r"\[").replace("]", r"\]")):
        notebook_to_script(nb, cells=cells)  # type: ignore[arg-type]


def test_reads_paths_json_text_and_nodes(tmp_path: Path) -> None:
    nb = new_notebook(cells=[new_code_cell("x = 41 + 1")])
    path = tmp_path / "answer.ipynb"
    nbformat.write(nb, path)
    from_path = notebook_to_script(path)
    assert "'answer.ipynb'" in from_path.splitlines()[0]
    assert notebook_to_script(str(path)) == from_path
    assert "x = 41 + 1" in notebook_to_script(nbformat.writes(nb))
    with pytest.raises(ConversionError, match="cannot read notebook"):
        notebook_to_script(tmp_path / "missing.ipynb")
    (tmp_path / "broken.ipynb").write_text("{not json", encoding="utf-8")
    with pytest.raises(ConversionError, match="not a readable notebook"):
        notebook_to_script(tmp_path / "broken.ipynb")


# -- magics ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "what", "line"),
    [
        ("import os\n%pip install torch", "%pip install torch", 2),
        ("!nvidia-smi", "a shell escape !nvidia-smi", 1),
        ("x = 1\nfiles = !ls -l", "a shell escape !ls -l", 2),
        ("%%bash\necho hi", "%%bash", 1),
        ("%%time\nx = 1", "%%time", 1),
        ("x = %time 1 + 1", "%time 1 + 1", 1),
        ("%time train()", "%time train()", 1),
        ("len?", "IPython help ?len", 1),
        ("def f():\n    %cd /tmp\n    return 1", "%cd /tmp", 2),
        ("%load_ext tensorboard", "%load_ext tensorboard", 1),
        ("%matplotlib inline\n%pip install x", "%pip install x", 2),
    ],
)
def test_magics_and_shell_escapes_are_refused_naming_cell_and_line(
    source: str, what: str, line: int
) -> None:
    nb = new_notebook(
        cells=[new_markdown_cell("m"), new_code_cell("ok = 1"), new_code_cell(source)]
    )
    with pytest.raises(ConversionError) as info:
        notebook_to_script(nb)
    message = str(info.value)
    assert message == f"cell #3 uses {what} (line {line}): remove it or tag the cell {SKIP_TAG}"
    assert [(p.cell, p.line) for p in info.value.problems] == [(3, line)]
    assert isinstance(info.value, ValueError)


def test_every_refused_spot_is_listed_once() -> None:
    nb = new_notebook(
        cells=[new_code_cell("!ls\n%env A=1"), skip("%pip install x"), new_code_cell("%%bash\nls")]
    )
    with pytest.raises(ConversionError) as info:
        notebook_to_script(nb)
    assert str(info.value).splitlines() == [
        f"cell #1 uses a shell escape !ls (line 1): remove it or tag the cell {SKIP_TAG}",
        f"cell #1 uses %env A=1 (line 2): remove it or tag the cell {SKIP_TAG}",
        f"cell #3 uses %%bash (line 1): remove it or tag the cell {SKIP_TAG}",
    ]


def test_line_numbers_follow_the_cell_after_a_continued_magic() -> None:
    nb = new_notebook(cells=[new_code_cell("%matplotlib \\\ninline\nx = 1\n!ls")])
    with pytest.raises(ConversionError, match=r"cell #1 uses a shell escape !ls \(line 4\)"):
        notebook_to_script(nb)


def test_allowed_magics_are_dropped_and_lines_keep_their_numbers(load) -> None:
    cell = (
        "%matplotlib inline\n"
        "%config InlineBackend.figure_format = 'svg'\n"
        "%load_ext autoreload\n"
        "%autoreload 2\n"
        "def f():\n"
        "    %matplotlib inline\n"
        "    raise ValueError('from line 7')\n"
    )
    source = notebook_to_script(new_notebook(cells=[new_code_cell(cell), new_code_cell("f()")]))
    assert "get_ipython" not in source
    assert "# Dropped from cell #1: %matplotlib inline" in source
    assert "# Dropped from cell #1: %autoreload 2" in source
    module = load(source)
    with pytest.raises(ValueError, match="from line 7") as info:
        module.main()
    frames = traceback.extract_tb(info.value.__traceback__)
    assert (frames[-1].filename, frames[-1].lineno) == ("notebook, cell #1", 7)
    assert frames[-1].line == "raise ValueError('from line 7')"
    assert (frames[-2].filename, frames[-2].lineno, frames[-2].line) == (
        "notebook, cell #2",
        1,
        "f()",
    )


def test_users_own_get_ipython_is_left_alone(load) -> None:
    cell = "try:\n    shell = get_ipython()\nexcept NameError:\n    shell = None"
    module = load(notebook_to_script(new_notebook(cells=[new_code_cell(cell)])))
    module.main()
    assert module.shell is None


def test_syntax_errors_name_the_cell_and_line() -> None:
    nb = new_notebook(cells=[new_code_cell("x = 1"), new_code_cell("y = 2\nif y\n    pass")])
    with pytest.raises(ConversionError, match=r"cell #2 has a syntax error: .* \(line 2\): fix it"):
        notebook_to_script(nb)
    top_level_await = new_notebook(cells=[new_code_cell("import asyncio\nawait asyncio.sleep(0)")])
    with pytest.raises(ConversionError, match=r"cell #1 has a syntax error: .*await.* \(line 2\)"):
        notebook_to_script(top_level_await)


# -- the generated script -------------------------------------------------------------------------


TRICKY = [
    "s = '''triple'''\nprint(s)",
    'path = r"C:\\temp\\new"\nx = "tab\\there"\ny = 1 + \\\n    2',
    "name = 'naïve — ✓'",
    "form = '\x0c'",
    "ends_with_quote = 'it'",
    "\n\nblank_lines_first = 1",
]


def test_output_compiles_and_keeps_each_cell_exactly(load) -> None:
    nb = new_notebook(cells=[new_code_cell(s) for s in TRICKY])
    source = notebook_to_script(nb)
    ast.parse(source)
    module = load(source)
    assert [s for _, s in module._GPUPOOL_CELLS] == [s + "\n" for s in TRICKY]
    module.main()
    assert (module.y, module.name, module.blank_lines_first) == (3, "naïve — ✓", 1)


def test_importing_the_generated_module_does_nothing(tmp_path: Path) -> None:
    nb = new_notebook(
        cells=[
            new_code_cell("import torch\nprint('cell ran')"),
            new_code_cell("torch.cuda.is_available()\nopen('touched', 'w').close()"),
        ]
    )
    (tmp_path / "generated_mod.py").write_text(notebook_to_script(nb), encoding="utf-8")
    probe = (
        "import sys\n"
        "sys.path.insert(0, '.')\n"
        "import generated_mod\n"
        "assert callable(generated_mod.main)\n"
        "heavy = ('torch', 'IPython', 'nbformat')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert (result.stdout, result.stderr) == ("[]\n", "")
    assert not (tmp_path / "touched").exists()


def test_cell_functions_and_classes_are_module_globals_and_pickle(load) -> None:
    nb = new_notebook(
        cells=[
            new_code_cell("SCALE = 3\ndef scale(x):\n    return SCALE * x"),
            new_code_cell(
                "class Point:\n    def __init__(self, x):\n        self.x = x\n"
                "    def scaled(self):\n        return Point(scale(self.x))"
            ),
            new_code_cell("counter = 0\ndef bump():\n    global counter\n    counter += 1\nbump()"),
        ]
    )
    module = load(notebook_to_script(nb))
    module.main()
    assert module.scale.__qualname__ == "scale" and module.scale.__module__ == module.__name__
    assert pickle.loads(pickle.dumps(module.scale))(2) == 6
    point = pickle.loads(pickle.dumps(module.Point(2)))
    assert isinstance(point, module.Point) and point.scaled().x == 6
    assert module.counter == 1


SPAWN_CELLS = [
    "import multiprocessing as mp\nimport sys\nOFFSET = 10",
    "def shift(x, offset=OFFSET):\n    return x + offset",
    "class Doubler:\n    def __call__(self, x):\n        return 2 * shift(x)",
    "if __name__ == '__main__':\n    print('main guard ran')\n",
    "for method in sys.argv[1:]:\n"
    "    with mp.get_context(method).Pool(1) as pool:\n"
    "        print(method, pool.map(Doubler(), [1, 2]))",
]


def test_functions_unpickle_in_spawn_and_forkserver_children(tmp_path: Path) -> None:
    source = notebook_to_script(new_notebook(cells=[new_code_cell(s) for s in SPAWN_CELLS]))
    result = run_script(tmp_path, source, "fork", "spawn", "forkserver")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "main guard ran",
        "fork [22, 24]",
        "spawn [22, 24]",
        "forkserver [22, 24]",
    ]


def test_a_notebook_with_its_own_main_and_display(tmp_path: Path) -> None:
    nb = new_notebook(
        cells=[
            new_code_cell("def main():\n    print('users main')\n    display({'a': 1})"),
            new_code_cell("if __name__ == '__main__':\n    main()"),
            new_code_cell("print('after', __name__)\ndisplay('shown')"),
        ]
    )
    result = run_script(tmp_path, notebook_to_script(nb))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["users main", "{'a': 1}", "after __main__", "shown"]
