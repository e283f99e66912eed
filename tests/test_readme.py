"""Every Python block of the README runs verbatim (from the repository root, CPU only)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(encoding="utf-8"),
                    flags=re.S | re.M)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, monkeypatch):
    code = BLOCKS[index]
    if "from trl import" in code:
        pytest.importorskip("trl")
    monkeypatch.chdir(ROOT)
    exec(compile(code, f"README.md python block {index + 1}", "exec"), {"__name__": "readme"})


def test_result_tables_are_generated_from_the_results_files():
    """The README's tables equal what benchmarks/readme_tables.py builds from the committed
    results (run it after a --save-results run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "readme_tables", ROOT / "benchmarks" / "readme_tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert text.count("<!-- table: ") >= 8
    for path in tables.DOCUMENTS:
        text = pathlib.Path(path).read_text(encoding="utf-8")
        assert tables.render(text) == text, path
