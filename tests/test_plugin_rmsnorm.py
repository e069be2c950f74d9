"""The example third-party plugin ``plugins/ipubuild-rmsnorm`` from the project's side: the
tutorial's code blocks against the plugin's files, and whole builds in a copy of the tree (with,
without and with a broken plugin; the target it ships). The plugin's own tests —
``plugins/ipubuild-rmsnorm/tests``, written with ``ipubuild.testing`` — run in the same pytest
session (``testpaths``)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLUGIN_DIR = ROOT / "plugins" / "ipubuild-rmsnorm"
DOCS = ROOT / "docs" / "plugins.md"

IGNORE = shutil.ignore_patterns(".ipubuild", "artifacts", ".doit.db*", ".git", "__pycache__",
                                "*.egg-info", "build", ".pytest_cache", ".hypothesis")


def _copy_tree(tmp_path: Path, targets=None) -> Path:
    dst = tmp_path / "tree"
    shutil.copytree(ROOT, dst, ignore=IGNORE)
    if targets is not None:
        for p in (dst / "targets").glob("*.toml"):
            if p.stem not in targets:
                p.unlink()
    return dst


def _env(**extra) -> dict:
    """No installed third-party plugin (``IPUBUILD_DISABLE_PLUGIN_AUTOLOAD``): a test names the
    plugins it builds with in ``IPUBUILD_PLUGINS``, so what it checks holds whatever is installed."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("IPUBUILD_PLUGINS", "IPUBUILD_CACHE_DIR", "IPUBUILD_VERBOSE", "PYTHONPATH")}
    env.update(IPUBUILD_CONSOLE="tasks", IPUBUILD_LOG="debug",     # the per-task lines and the log
               IPUBUILD_DISABLE_PLUGIN_AUTOLOAD="1")
    env.update(extra)
    return env


def _with_plugin(tree: Path, **extra) -> dict:
    return _env(IPUBUILD_PLUGINS="ipubuild_rmsnorm.plugin", PYTHONPATH=str(tree / "plugins" / "ipubuild-rmsnorm"),
                **extra)


def _error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("error:")]


# the tutorial ----------------------------------------------------------------------------------
def test_docs_code_blocks_are_verbatim_plugin_code():
    text = DOCS.read_text()
    blocks = re.findall(r"^```(python|c|toml)[ \t]*\n(.*?)^```[ \t]*$", text, re.M | re.S)
    assert len(blocks) >= 8, "the tutorial should show the plugin's actual code"
    assert {lang for lang, _ in blocks} == {"python", "c", "toml"}
    files = [p for p in PLUGIN_DIR.rglob("*") if p.is_file() and p.suffix in (".py", ".c", ".toml")
             and "build" not in p.relative_to(PLUGIN_DIR).parts]
    files.append(ROOT / "targets" / "vit_rms.toml")
    sources = {p: p.read_text() for p in files}
    for lang, body in blocks:
        body = body.rstrip("\n")
        assert body.strip(), "empty code block"
        assert any(body in s for s in sources.values()), (
            f"this {lang} block of docs/plugins.md is not verbatim in the plugin's files:\n{body}")


# whole builds in a copy of the tree ----------------------------------------------------------
@pytest.mark.slow
def test_build_vit_rms_end_to_end(tmp_path):
    tree = _copy_tree(tmp_path)
    env = _with_plugin(tree)
    where = subprocess.run([sys.executable, "-c", "import ipubuild, ipubuild_rmsnorm.plugin as p; "
                            "print(ipubuild.__file__); print(p.__file__)"], cwd=tree, env=env,
                           capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert all(Path(w).resolve().is_relative_to(tree.resolve()) for w in where), where  # the copy's code
    proc = subprocess.run([sys.executable, "-m", "doit", "build:vit_rms"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "numericalTest=PASS" in out
    assert "deviceTest=PASS" in out
    assert "compiled kernel variant variant=rmsnorm_f32" in out
    assert re.search(r'screened local search round .*rmsnorm_follow="proposed=\d+ fit=', out)
    assert (tree / "artifacts" / "vit_rms" / "vit_rms.ipuexe").is_file()


def test_build_vit_rms_without_the_plugin_is_a_one_line_error(tmp_path):
    tree = _copy_tree(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "doit", "build:vit_rms"], cwd=tree,
                          env=_env(), capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Traceback" not in out
    (line,) = _error_lines(out)
    assert "model.family" in line and "'vit_rms'" in line and "known: onnx, vit" in line, line


BROKEN = '''\
from ipubuild import hookimpl


@hookimpl
def ipubuild_operators():
    raise RuntimeError("boom from a broken plugin")
'''


def _broken_build(tmp_path, tree):
    (tmp_path / "broken_rms_plugin.py").write_text(BROKEN)
    env = _env(IPUBUILD_PLUGINS="broken_rms_plugin", PYTHONPATH=str(tmp_path))
    return subprocess.run([sys.executable, "-m", "doit", "build:vit_fp8"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=600)


def test_broken_plugin_is_named_in_a_one_line_error(tmp_path):
    # one target in the tree (see the xfail below for two)
    proc = _broken_build(tmp_path, _copy_tree(tmp_path, targets={"vit_fp8"}))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Traceback" not in out
    (line,) = _error_lines(out)
    assert "broken_rms_plugin" in line and "ipubuild_operators" in line and "boom" in line, line


def test_broken_plugin_is_named_with_two_targets(tmp_path):
    # two of the tree's targets (not vit_b16_fp8: a ViT-B/16 on 1472 tiles is minutes and GBs to derive)
    proc = _broken_build(tmp_path, _copy_tree(tmp_path, targets={"vit_fp8", "vit_rms"}))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out
    (line,) = _error_lines(out)
    assert "broken_rms_plugin" in line and "ipubuild_operators" in line, line
