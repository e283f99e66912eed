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


def test_the_plot_of_the_committed_results_makes_its_folder(tmp_path, monkeypatch):
    """``python -m benchmarks --only plot`` on a fresh clone (no ``runs/benchmarks/`` yet):
    the plot of every committed ``evaluate_throughput_*.json`` is written as a PNG, its
    folder made (it raised FileNotFoundError before)."""
    import importlib.util
    import sys

    pytest.importorskip("matplotlib")
    # The runner imports the benchmarks' ``common`` and ``readme_tables`` by name; the
    # experiments' ``common`` (tests/test_experiments.py) may already hold that name.
    monkeypatch.setattr(sys, "path", list(sys.path))
    kept = {name: sys.modules.pop(name, None) for name in ("common", "readme_tables")}
    try:
        spec = importlib.util.spec_from_file_location(
            "benchmarks_main", ROOT / "benchmarks" / "__main__.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        for name, module in kept.items():
            sys.modules.pop(name, None)
            if module is not None:
                sys.modules[name] = module
    folder = tmp_path / "runs" / "benchmarks"  # (not made)
    path = bench.plot(str(folder))
    assert pathlib.Path(path) == folder / "plans_per_second.png"
    assert pathlib.Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # A local run of a device whose committed results have another file name (a run written
    # with --out, or a committed file of an older name): its series come from the local run
    # alone, the other devices' stay.
    import json

    committed = sorted((ROOT / "benchmarks" / "results").glob("evaluate_throughput_*.json"))
    by_file = {p.name: [r for r in json.loads(p.read_text()) if not r.get("host_memory")
                        and r.get("benchmark", "evaluate_throughput") == "evaluate_throughput"]
               for p in committed}  # (the batch records the plot draws)
    assert len(by_file) >= 2
    name, records = next((n, r) for n, r in by_file.items() if n.endswith("_cpu.json"))
    local = [{**r, "plans_per_second": 1.0} for r in records]  # (told apart by their rate)
    (folder / "evaluate_throughput_cpu.json").write_text(json.dumps(local))
    series, _ = bench.plot_series(str(folder))
    devices = {bench._device(r) for r in local}
    others = {bench._device(r) for recs in by_file.values() for r in recs} - devices
    assert others and others <= {key[0] for key in series}
    for key, points in series.items():
        if key[0] in devices:  # one point per batch, all the local run's
            assert len({b for b, _ in points}) == len(points)
            assert {rate for _, rate in points} == {1.0}, (name, key)
