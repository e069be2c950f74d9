"""The planner's and the simulator's C helpers (ipubuild/compiler/planning/native.py): compiled
once per source and compiler, whoever asks first."""
import ctypes
import shutil
import subprocess
import tempfile
import threading
import time

import pytest

from ipubuild.compiler.planning import native

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def test_threads_asking_for_a_new_library_at_once_compile_it_once(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))      # a machine that has none yet
    compiles, real = [], subprocess.run

    def run(cmd, *args, **kwargs):
        if "-shared" in cmd:
            compiles.append(cmd)
            time.sleep(0.2)           # long enough for every thread to ask while it compiles
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", run)
    name = f"test_once_{id(tmp_path)}"
    got = []
    ask = lambda: got.append(native.library(name, "int answer(void) { return 42; }\n",
                                            {"answer": (ctypes.c_int, [])}, nice=native.BACKGROUND_NICE))
    threads = [threading.Thread(target=ask) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(got) == 4 and got[0] is not None and all(lib is got[0] for lib in got)
        assert got[0].answer() == 42
        assert len(compiles) == 1                                   # once, at the niceness asked
        assert compiles[0][:3] == ["nice", "-n", str(native.BACKGROUND_NICE)] or not shutil.which("nice")
        assert len(list(tmp_path.glob(f"ipubuild-native-*/{name}-*.so"))) == 1
    finally:
        native._loaded.pop(name, None)
