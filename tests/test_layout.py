"""The package's shape (docs/architecture.md): what a run imports, what stays light, how big a module may grow.

    .venv/bin/python -m pytest tests/test_layout.py
"""

import ast
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
    """At most 20 modules at harness/'s top level, the rest in sub-packages by concern; no module over 400 lines."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 20, top
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


# ----------------------------------------------------------------------------------------------- the import graph

# The layers, lowest first: a module imports only modules of its own layer or lower ones (imports inside functions
# count too). A module matches its longest prefix here ("harness" only itself); a module no prefix matches fails the
# test (place it).
LAYERS = [
    # 0: what everything may use: errors, atomic files, the tests' fault hooks, the report's record
    ["harness", "harness.errors", "harness.files", "harness.faults", "harness.observe.record",
     "harness.config.yaml_loader", "harness.distributed.collectives"],
    # 1: the config and what it checks values against (reading rows, chat templates), plain facts and records
    ["harness.config", "harness.data", "harness.data.formats", "harness.data.sources", "harness.data.readers",
     "harness.data.chat",
     "harness.data.mixing", "harness.hardware", "harness.state", "harness.stopping", "harness.speed",
     "harness.speed.compiling",
     "harness.observe"],
    # 2: the run's parts: processes, model, samples and loaders, losses, the objective, checkpoints, the output folder
    ["harness.distributed", "harness.model", "harness.lora", "harness.speed.float8", "harness.speed.buckets",
     "harness.losses", "harness.chunked_loss", "harness.optim",
     "harness.objective",
     "harness.evaluation", "harness.encode", "harness.auto_batch", "harness.data.samples", "harness.data.loaders", "harness.data.streaming",
     "harness.data.stream_sources",
     "harness.checkpoint", "harness.rundir", "harness.observe.reporting", "harness.data.pairs",
     "harness.preference", "harness.rl", "harness.rft.tasks", "harness.rft.engine",
     "harness.rft.decode"],
    # 3: the build; 4: the run
    ["harness.build"],
    ["harness.train"],
    # 5: entry points and command tools (the run never imports them: test_the_run_loads_no_command_tool)
    ["harness.cli", "harness.rft", "harness.tools"],
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str) -> set[str]:
    """The harness modules `name` imports, anywhere in its file (`from harness.x import y` counts as harness.x.y when
    that is a module, else as harness.x)."""
    path, out = MODULES[name], set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
    return {m for m in out if m in MODULES and m != name}


def layer_of(name: str) -> int:
    best = max(((len(prefix), i) for i, layer in enumerate(LAYERS) for prefix in layer
                if name == prefix or (prefix != "harness" and name.startswith(prefix + "."))), default=None)
    assert best is not None, f"{name} has no layer in tests/test_layout.py LAYERS"
    return best[1]


def test_collectives_know_nothing_of_the_run_config():
    """harness/distributed/ holds process setup (processes.py) and the collectives every part calls (collectives.py);
    the collectives import no harness module but errors, and nothing of the run's config."""
    assert imports_of("harness.distributed.collectives") <= {"harness", "harness.errors"}
    assert "Config" not in MODULES["harness.distributed.collectives"].read_text()
    assert "def " not in MODULES["harness.distributed"].read_text()  # the package's __init__ is only its map


def test_no_import_cycle():
    """No two harness modules import each other, directly or through others (lazy imports included)."""
    graph = {m: imports_of(m) for m in MODULES}
    cycles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(path[path.index(n):] + [n] if n in path else [m, n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_no_import_from_a_lower_layer_to_a_higher_one():
    upward = sorted(f"{m} ({layer_of(m)}) imports {n} ({layer_of(n)})" for m in MODULES for n in imports_of(m)
                    if layer_of(n) > layer_of(m))
    assert upward == []


def checkpoint_names(name: str) -> set[str]:
    """The names of harness.checkpoint that module `name` uses: those it imports from it, and the attributes it
    reads of the checkpoint modules it imports."""
    tree = ast.parse(MODULES[name].read_text())
    used, modules = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("harness.checkpoint"):
            for a in node.names:
                bound = a.asname or a.name
                (modules.add(bound) if f"{node.module}.{a.name}" in MODULES else used.add(a.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            used.add(node.attr)
    return used


def test_build_and_train_use_few_checkpoint_names():
    """Resume is one module's business: the build and the loop use at most 6 names of harness.checkpoint."""
    used = checkpoint_names("harness.build") | checkpoint_names("harness.train")
    assert len(used) <= 6, sorted(used)


def test_the_job_is_built_once():
    """build.Job is frozen (no field assigned after construction), and built in one place, from what the build steps
    return."""
    import dataclasses

    from harness.build import Job

    assert Job.__dataclass_params__.frozen
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               for f in dataclasses.fields(Job)), "placeholder fields"
    calls = [n for m in MODULES for n in ast.walk(ast.parse(MODULES[m].read_text()))
             if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Job"]
    assert len(calls) == 1


# Where the whole run config may be taken: the run's assembly and checks; elsewhere a function takes its sections.
WHOLE_CONFIG_PLACES = ("harness/build.py", "harness/train.py", "harness/config/")


def whole_config_takers() -> list[str]:
    """Functions outside WHOLE_CONFIG_PLACES with a parameter annotated `Config`, or a parameter named `cfg` without an
    annotation (the name the code gives the whole config; a section is annotated or named for its section)."""
    out = []
    for name, path in MODULES.items():
        rel = str(path.relative_to(ROOT))
        if rel.startswith(WHOLE_CONFIG_PLACES):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                if any((p.annotation is not None and ast.unparse(p.annotation).strip("'\"").split(".")[-1] == "Config")
                       or (p.arg == "cfg" and p.annotation is None) for p in a.posonlyargs + a.args + a.kwonlyargs):
                    out.append((rel, node.lineno, node.name))
    return [f"{rel}:{line} {fn}" for rel, line, fn in sorted(out)]


def test_few_functions_take_the_whole_config():
    """The whole `Config` is taken where the run is assembled or checked (build.py, train.py, config/) and by the
    command tools' entry points; everywhere else a function takes the section it reads (`cfg.train`, `cfg.data`, ...)
    or plain values: at most 20 functions outside build.py, train.py and config/ take the whole Config."""
    takers = whole_config_takers()
    assert len(takers) <= 20, f"{len(takers)} functions take the whole Config:\n" + "\n".join(takers)
