"""The package's shape (docs/architecture.md): what a run imports, what stays light, how big a module may grow.

    .venv/bin/python -m pytest tests/test_layout.py
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "harness"


def loaded_after(statement: str) -> list[str]:
    """The modules a fresh interpreter has loaded after `statement`."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_run_loads_no_command_tool():
    """harness.train (what `accelerate launch harness/train.py` runs) imports none of harness/tools/ (bench, plan,
    zero-plan, chat, push) and not the command line's parser either."""
    loaded = loaded_after("import harness.train")
    assert "harness.train" in loaded
    assert [m for m in loaded if m.startswith("harness.tools") or m == "harness.cli"] == []


def test_the_config_imports_no_torch():
    """Loading and validating a recipe needs no torch: launch/common.sh and `--help-config` stay fast."""
    loaded = loaded_after("from harness.config import load_config; load_config('configs/default.yaml')")
    assert "harness.config.checks" in loaded
    assert [m for m in loaded if m.split(".")[0] in ("torch", "transformers", "accelerate")] == []


def test_package_shape():
    """At most 20 modules at harness/'s top level, the rest in sub-packages by concern; no module over 500 lines."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 20, top
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}
