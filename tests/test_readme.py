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
