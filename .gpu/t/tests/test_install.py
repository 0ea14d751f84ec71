"""README commands work from the repository root, where the source folder shadows the install.

`python -m`, `python -c`, a REPL or a notebook started at the root put the
root first on sys.path, so `import jax_flash` finds the source folder, which
`pip install .` never builds the extension into. jax_flash/__init__.py then
hands over to the installed copy; with no build anywhere, it says what to run.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import jax_flash

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCE = ROOT / "jax_flash"

# Which files the package, a submodule and the extension came from.
_WHERE = """
import json, jax_flash, jax_flash.bench
print(json.dumps(dict(package=jax_flash.__file__, path=list(jax_flash.__path__),
                      bench=jax_flash.bench.__file__, extension=jax_flash._jax_flash.__file__,
                      version=jax_flash.__version__, info=jax_flash.build_info()["version"])))
"""


def _python(*args, cwd):
  # A clean PYTHONPATH: what a user's shell has, not what the test runner added.
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                        text=True, timeout=120, check=False)


def _where(cwd) -> dict:
  result = _python("-c", _WHERE, cwd=cwd)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def _source_copy(tmp_path) -> pathlib.Path:
  """The source package, without any built extension, in a folder of its own."""
  checkout = tmp_path / "checkout"
  shutil.copytree(SOURCE, checkout / "jax_flash",
                  ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
  return checkout


@pytest.mark.skipif(not (SOURCE / "__init__.py").exists(), reason="no source checkout")
def test_python_c_and_python_m_from_the_repository_root():
  where = _where(ROOT)
  assert where["version"] == where["info"] == jax_flash.__version__
  # The package, its submodules and the extension come from one place: the
  # install, or the checkout itself where an editable install serves it.
  assert os.path.dirname(where["bench"]) in where["path"]
  assert os.path.dirname(where["package"]) in where["path"]
  result = _python("-m", "jax_flash.bench", "--help", cwd=ROOT)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith("usage: python -m jax_flash.bench")


def test_python_m_from_another_directory(tmp_path):
  result = _python("-m", "jax_flash.bench", "--help", cwd=tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "--preset" in result.stdout


def test_a_checkout_without_a_build_uses_the_installed_copy(tmp_path):
  checkout = _source_copy(tmp_path)
  where = _where(checkout)
  assert not where["package"].startswith(str(checkout)), where
  assert not where["extension"].startswith(str(checkout)), where
  assert os.path.dirname(where["bench"]) in where["path"]


# jax is imported first, then every way to find another jax_flash is removed:
# sys.path entries that hold one, and import hooks such as an editable
# install's finder. What is left is the bare checkout.
_NOTHING_INSTALLED = """
import importlib.machinery, sys
import jax
sys.path[:] = [p for p in sys.path
               if p == "" or importlib.machinery.PathFinder.find_spec("jax_flash", [p]) is None]
sys.meta_path[:] = [f for f in sys.meta_path
                    if getattr(f, "__module__", "").startswith("_frozen_importlib")]
try:
  import jax_flash
except ImportError as e:
  print(e)
else:
  print("imported", jax_flash.__file__)
"""


def test_a_checkout_with_no_build_anywhere_says_what_to_run(tmp_path):
  checkout = _source_copy(tmp_path)
  result = _python("-c", _NOTHING_INSTALLED, cwd=checkout)
  assert result.returncode == 0, result.stderr[-3000:]
  message = result.stdout
  assert "pip install ." in message and str(checkout) in message, message
  assert "circular" not in message


@pytest.mark.parametrize("value", ["sm70", "SM80", "75"])
def test_a_bad_force_path_is_named_on_import(value, tmp_path):
  # JAX_FLASH_FORCE_PATH (README "What runs where") is read by the CUDA
  # dispatch at each launch, where a bad value could only be ignored.
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["JAX_FLASH_FORCE_PATH"] = value
  result = subprocess.run([sys.executable, "-c", "import jax_flash"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode != 0
  assert "JAX_FLASH_FORCE_PATH" in result.stderr and repr(value) in result.stderr
