"""The repository's shape: layering contract, self-contained tests, deprecated aliases."""

import importlib
import os
import pathlib
import re
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    """Each folder is one layer and imports point down only (import-linter, pyproject.toml)."""
    from importlinter.cli import lint_imports

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert lint_imports(config_filename=str(ROOT / "pyproject.toml")) == 0
    finally:
        os.chdir(cwd)


def _tracked_text_files():
    for folder in ("src", "tests", "benchmarks", "experiments", "docs"):
        for p in (ROOT / folder).rglob("*"):
            if p.suffix in {".py", ".md", ".toml"} and ".egg-info" not in str(p):
                yield p
    yield ROOT / "README.md"


def test_nothing_points_outside_the_repository():
    """Tests, code and docs never read or cite files beside the checkout."""
    outside = re.compile(r"\.\./shared|DESIGN\.md|CLASSIC\.md|RLCLUSTER\.md")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in _tracked_text_files()
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if outside.search(line) and p.name != "test_layout.py"]
    assert hits == []


@pytest.mark.parametrize("old,new,name", [
    ("libratio_jax.rewards.text", "libratio_jax.text.codec", "parse_plan"),
    ("libratio_jax.rewards.hf", "libratio_jax.integrations.trl", "make_reward_funcs"),
    ("libratio_jax.rewards.hf", "libratio_jax.text.judge", "ScenarioBank"),
    ("libratio_jax.rewards.grpo", "libratio_jax.agents.grpo", "group_advantages"),
    ("libratio_jax.env.scenarios", "libratio_jax.scenarios", "Generator"),
    ("libratio_jax.env.policies", "libratio_jax.agents.policies", "greedy_plan"),
    ("libratio_jax.env.plan_space", "libratio_jax.agents.plan_space", "sample"),
    ("libratio_jax.env.search", "libratio_jax.agents.search", "cem"),
    ("libratio_jax.env.classic_rules", "libratio_jax.env.classic.rules", "PRECISIONS"),
])
def test_old_paths_forward_with_a_warning(old, new, name):
    mod = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        value = getattr(mod, name)
    assert value is getattr(importlib.import_module(new), name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError):
            mod.no_such_name  # noqa: B018


def test_old_classic_path_is_the_package():
    from libratio_jax.env.classic import replay_scores
    from libratio_jax.env.classic.replay import replay_scores as new

    assert replay_scores is new


def test_import_from_the_folder_that_holds_a_clone_named_like_the_package(tmp_path):
    """A clone folder named ``libratio_jax`` next to the working directory must not shadow the
    installed package (the src layout keeps the package one level down)."""
    import subprocess
    import sys

    (tmp_path / "libratio_jax").symlink_to(ROOT, target_is_directory=True)
    out = subprocess.run([sys.executable, "-c", "import libratio_jax as lj; "
                          "print(lj.ClusterSpec.__name__, lj.__file__)"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    name, path = out.stdout.split()
    assert name == "ClusterSpec" and path.endswith(os.path.join("libratio_jax", "__init__.py"))


def test_package_metadata_license_typing_changelog():
    """The license pyproject declares is shipped, the package is marked typed (PEP 561) and
    the changelog names the current version's changes."""
    from importlib import resources

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    import libratio_jax

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert meta["license"] == "Apache-2.0" and "LICENSE" in meta["license-files"]
    assert "Apache License" in (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert resources.files("libratio_jax").joinpath("py.typed").is_file()
    assert meta["version"] == libratio_jax.__version__
    assert "## 0.2.0" in (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
