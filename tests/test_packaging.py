"""`pip install .` adds only `bdcore` and `bdstack` to site-packages: the wheel built from a copy of the
checkout has no top-level `train`, `inference`, `data` or `benchmark`, and its console scripts find them."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

FILES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "NOTICE")
FOLDERS = ("bdcore", "bdstack", "train", "inference", "data", "benchmark")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel pip builds from the tracked layout (copied, so the checkout gets no build/ folder)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in FILES:
        shutil.copy(REPO / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "cache")
    for name in FOLDERS:
        shutil.copytree(REPO / name, src / name, ignore=skip)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    (path,) = out.glob("bdstack-*.whl")
    return path


def test_wheel_has_no_generic_top_level_names(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"bdcore", "bdstack"}, sorted(top)
    for path in (
        "bdstack/_src/train/main.py",
        "bdstack/_src/inference/serve.py",
        "bdstack/_src/data/make_demo.py",
        "bdstack/_src/inference/sglang_backend/configs/sdar.yaml",
        "bdcore/decode/__init__.py",
    ):
        assert path in names, path
    (entry,) = [n for n in names if n.endswith("entry_points.txt")]
    scripts = zipfile.ZipFile(wheel).read(entry).decode()
    for script in ("bdstack-train = bdstack.launch:train", "bdstack-serve = bdstack.launch:serve"):
        assert script in scripts, scripts


def test_installed_layout_imports_only_after_enable(wheel, tmp_path):
    """Unpacked as site-packages would hold it, in an interpreter that sees nothing else (-I -S):
    `import data` fails until bdstack.enable(), which makes the programs' modules the wheel's own."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        f"import sys; sys.path.insert(0, {str(site)!r})\n"
        "import importlib.util as u, os, bdstack\n"
        "print('before', [m for m in bdstack.APPS if u.find_spec(m) is not None])\n"
        "root = bdstack.enable()\n"
        "import train.cli, data\n"
        "print('root', root)\nprint('train', train.cli.__file__)\nprint('data', data.__file__)\n"
        "print('env', os.environ['PYTHONPATH'].split(os.pathsep)[0])\n"
    )
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    root = site / "bdstack" / "_src"
    assert lines["before"] == "[]"
    assert Path(lines["root"]) == root and Path(lines["env"]) == root
    assert Path(lines["train"]) == root / "train" / "cli.py" and Path(lines["data"]) == root / "data" / "__init__.py"


def test_a_checkout_is_its_own_source_root():
    import bdstack

    assert bdstack.source_root() == REPO


@pytest.mark.parametrize("script", ["serve.py", "eval.py"])
def test_a_checkout_script_imports_its_own_packages(script, tmp_path):
    """`python inference/serve.py` needs no install: the script puts its checkout's root on the path first."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{script!r}, '--help']\n"
        f"try:\n    runpy.run_path({str(REPO / 'inference' / script)!r}, run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print(sys.modules['inference'].__file__)"
    )
    out = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert Path(out.stdout.splitlines()[-1]) == REPO / "inference" / "__init__.py"
