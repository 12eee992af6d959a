"""The package's shape (docs/architecture.md): what a run imports, what stays light, how big a module may grow.

    .venv/bin/python -m pytest tests/test_layout.py
"""

import ast
import functools
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
     "harness.data.mixing", "harness.hardware", "harness.state", "harness.stopping", "harness.speed", "harness.moe",
     "harness.speed.compiling",
     "harness.observe"],
    # 2: the run's parts: processes, model, samples and loaders, losses, the objective, checkpoints, the output folder
    ["harness.distributed", "harness.model", "harness.lora", "harness.speed.float8", "harness.speed.buckets",
     "harness.losses", "harness.chunked_loss", "harness.optim",
     "harness.objective",
     "harness.evaluation", "harness.encode", "harness.auto_batch", "harness.data.samples", "harness.data.loaders", "harness.data.streaming",
     "harness.data.vision",
     "harness.data.stream_sources",
     "harness.checkpoint", "harness.rundir", "harness.observe.reporting", "harness.data.pairs",
     "harness.preference", "harness.rl", "harness.distill", "harness.modes", "harness.rft.tasks", "harness.rft.engine",
     "harness.rft.stats", "harness.rft.decode", "harness.rft.contract", "harness.rft.scheduler", "harness.rft.runner",
     "harness.rft.slots"],
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


def api_face(name: str) -> range:
    """The lines of the package file's `__getattr__`, which hands out `harness.train` (the Python API) when a user
    asks for it: an entry point, as a `__main__.py` is a program, not an import the modules below read through the
    package file (they import `harness` for IGNORE_INDEX); its import is no edge of the graphs here."""
    if name != "harness":
        return range(0)
    fn = next((n for n in ast.parse(MODULES[name].read_text()).body
               if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"), None)
    return range(fn.lineno, fn.end_lineno + 1) if fn else range(0)


def imports_of(name: str) -> set[str]:
    """The harness modules `name` imports, anywhere in its file (`from harness.x import y` counts as harness.x.y when
    that is a module, else as harness.x)."""
    path, out = MODULES[name], set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    face = api_face(name)
    for node in ast.walk(ast.parse(path.read_text())):
        if getattr(node, "lineno", 0) in face:
            continue
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
# the loss modes' builds (harness/modes/: `build(cfg, parts)`) assemble their part of the run as build.py does
WHOLE_CONFIG_PLACES = ("harness/build.py", "harness/train.py", "harness/config/", "harness/modes/")


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


# ----------------------------------------------------------------------------------------------- the engine's shape

ENGINE_PARTS = ("model", "cache", "step", "runner", "slots", "ring", "last_ids")  # what only harness/rft/ touches


def engine_reaches() -> list[str]:
    """Outside harness/rft/: each read of `last_ids` (the sampled ids as a side attribute, gone: they are the
    completions), and each assignment to an engine's parts (`<...>.engine.model = ...`, `engine.cache = ...`:
    a caller hands the engine a model with `serving(model)`)."""
    out = []
    for name, path in MODULES.items():
        rel = str(path.relative_to(ROOT))
        if rel.startswith("harness/rft/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "last_ids":
                out.append(f"{rel}:{node.lineno} reads last_ids")
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                owner = t.value if isinstance(t, ast.Attribute) else None
                owner = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if isinstance(t, ast.Attribute) and owner.endswith("engine") and t.attr in ENGINE_PARTS:
                    out.append(f"{rel}:{node.lineno} sets {ast.unparse(t)}")
    return out


def test_no_caller_reads_the_engines_side_attributes_or_sets_its_parts():
    """Issue 70: loss.mode=rl read the sampled ids from `engine.last_ids` and set `engine.model` and `engine.cache`
    from outside. The engine takes ids and gives completions (harness/rft/contract.py), and serves another model
    within `serving(model)`."""
    assert engine_reaches() == []


def test_the_continuous_engines_generate_is_a_short_loop_over_steps():
    """Issue 70: `ContinuousEngine.generate` was 92 lines, its scheduler in six local variables shared with two
    closures and `_admit` (12 parameters). Split as a small engine is (scheduler.py, slots.py, runner.py,
    decode.Picker), it is a loop over steps of at most 30 lines (docstring included), and no function of
    harness/rft/engine.py takes more than 4 parameters besides self except the engine's constructor."""
    tree = ast.parse((PACKAGE / "rft" / "engine.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ContinuousEngine")
    methods = {n.name: n for n in engine.body if isinstance(n, ast.FunctionDef)}
    generate = methods["generate"]
    assert generate.end_lineno - generate.lineno + 1 <= 30, generate.end_lineno - generate.lineno + 1
    wide = [name for name, n in methods.items() if name != "__init__" and len(n.args.args + n.args.kwonlyargs) > 5]
    assert wide == []


def test_every_engine_takes_ids_and_gives_completions_behind_one_interface():
    """The continuous, static, transformers and vllm engines' generate() and serving() have the signatures of
    contract.Engine (prompt ids, n, one Sampling, on_done -> completions; the model to serve)."""
    import inspect

    from harness.rft.contract import Engine
    from harness.rft.engine import ContinuousEngine
    from harness.rft.hf_engine import TransformersEngine
    from harness.rft.sampling import StaticEngine
    from harness.rft.vllm_engine import VllmEngine

    for method in ("generate", "serving"):
        want = inspect.signature(getattr(Engine, method))
        for cls in (ContinuousEngine, StaticEngine, TransformersEngine, VllmEngine):
            got = inspect.signature(inspect.unwrap(getattr(cls, method)))
            assert [(p.name, p.default) for p in got.parameters.values()] == \
                [(p.name, p.default) for p in want.parameters.values()], (cls.__name__, method, got)
    assert inspect.signature(Engine.generate).parameters["prompts"].annotation == "list[list[int]]"


# ------------------------------------------------------------------------- the folders' graph, lazy imports included

# The units of the folders' graph: each folder of harness/ (harness.data, harness.rft, ...) and each top-level module
# (harness.train, ...); the package file is `harness`. A `__main__.py` is a program that nothing imports: its own unit.
MAX_LAZY = 20  # imports of harness modules inside functions, each with its reason (`# lazy: ...`)


def unit_of(name: str) -> str:
    parts = name.split(".")
    return name if parts[-1] == "__main__" else ".".join(parts[:2])


@functools.lru_cache(maxsize=None)
def import_sites(name: str) -> list[tuple[int, str, bool]]:
    """(line, imported harness module, inside a function) for every import statement of module `name`, resolved as
    `imports_of` resolves them."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((child.lineno, a.name, in_function) for a in child.names if a.name in MODULES)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in child.names}
                out.extend((child.lineno, t, in_function) for t in sorted(targets) if t in MODULES)
            walk(child, inner)

    walk(ast.parse(path.read_text()), False)
    return [s for s in out if s[1] != name and s[0] not in api_face(name)]


def folder_graph() -> dict[str, dict[str, list[str]]]:
    """unit -> {unit it imports: ["harness/x.py:12 imports harness.y.z", ...]} (function-level imports included)."""
    graph: dict[str, dict[str, list[str]]] = {}
    for name, path in MODULES.items():
        edges = graph.setdefault(unit_of(name), {})
        for line, target, _ in import_sites(name):
            if unit_of(target) != unit_of(name):
                edges.setdefault(unit_of(target), []).append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    return graph


def folder_cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """One cycle through each group of units that reach each other (Tarjan's strongly connected components)."""
    index, low, stack, on, groups = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on.discard(group[-1])
            if len(group) > 1:
                groups.append(set(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for group in groups:  # the shortest way back from the group's first unit to itself, inside the group
        start = min(group)
        paths, seen = [[start]], set()
        while paths:
            path = paths.pop(0)
            nxt = [w for w in sorted(graph[path[-1]]) if w in group]
            if start in nxt:
                cycles.append(path + [start])
                break
            for w in nxt:
                if w not in seen:
                    seen.add(w)
                    paths.append(path + [w])
    return cycles


def folder_layers(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The units by layer: 0 imports no other unit; each other unit sits one above the highest unit it imports (the
    longest path from the bottom)."""
    level: dict[str, int] = {}

    def of(v: str) -> int:
        if v not in level:
            level[v] = 1 + max((of(w) for w in graph[v]), default=-1)
        return level[v]

    for v in graph:
        of(v)
    return [sorted(v for v in graph if level[v] == i) for i in range(max(level.values()) + 1)]


def test_no_import_cycle_between_folders():
    """Between harness/'s folders and top-level modules the imports point one way (function-level imports count: an
    import inside a function is still a dependency). A cycle fails, naming the imports on it."""
    graph = folder_graph()
    report = []
    for cycle in folder_cycles(graph):
        report.append(" -> ".join(cycle))
        report += [f"    {site}" for a, b in zip(cycle, cycle[1:]) for site in graph[a][b]]
    assert report == [], "import cycle between folders:\n" + "\n".join(report)


def lazy_imports() -> list[tuple[str, int, str, str]]:
    """(file, line, imported module, the reason) of every import of a harness module inside a function; the reason is
    a `# lazy: ...` comment on the import's line or on the line above."""
    out = []
    for name, path in MODULES.items():
        lines = path.read_text().splitlines()
        for line in sorted({line for line, _, inner in import_sites(name) if inner}):
            near = [lines[line - 1]] + ([lines[line - 2]] if line > 1 else [])
            why = next((t.split("# lazy:", 1)[1].strip() for t in near if "# lazy:" in t), "")
            out.append((str(path.relative_to(ROOT)), line, lines[line - 1].strip(), why))
    return sorted(out)


def test_few_function_level_imports_each_with_its_reason():
    """At most MAX_LAZY imports of harness modules sit inside functions, each with its reason on its line or the line
    above (`# lazy: start-up time`, `# lazy: torch-free config`, ...): the rest are at the top, where a reader sees
    what a module depends on."""
    found = lazy_imports()
    assert len(found) <= MAX_LAZY, f"{len(found)} function-level imports:\n" + "\n".join(
        f"{f}:{n} {text}" for f, n, text, _ in found)
    assert [f"{f}:{n} {text}" for f, n, text, why in found if not why] == []


def documented_layers() -> list[list[str]]:
    """The `layers` block of docs/architecture.md: one line per layer, lowest first, `N: unit unit ...`."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("```layers\n", 1)[1].split("```", 1)[0]
    return [line.split(":", 1)[1].split() for line in block.strip().splitlines()]


def test_architecture_doc_shows_the_layers_as_they_are():
    """docs/architecture.md's layer list is the one the folders' graph gives (regenerate the block from
    `python tests/test_layout.py`)."""
    assert documented_layers() == folder_layers(folder_graph())


if __name__ == "__main__":  # print the layers block for docs/architecture.md
    print("```layers")
    for i, layer in enumerate(folder_layers(folder_graph())):
        print(f"{i}: {' '.join(layer)}")
    print("```")


# ----------------------------------------------------------------------------------------------- the loss modes

MODE_PLACES = ("harness/config/", "harness/modes/")  # the facts table and the registry read a mode's name
# the comparisons of a loss mode's name that remain outside them, each named (<= 10): the planners' arithmetic and
# the checkpoint's compared settings of the shipped modes
MODE_COMPARISONS_LEFT = {
    "harness/tools/bench.py:run_bench", "harness/tools/bench_loops.py:_build_common",  # the bench compares generative
    "harness/tools/planner.py:calibrate", "harness/tools/planner.py:main", "harness/tools/planner.py:make_plan",
    "harness/tools/zero_plan.py:plan",  # rl: the plans count the generation's seconds and its KV cache beside training
}


def _mode_expression(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id.endswith("mode") and node.id != "compile_mode"
    if isinstance(node, ast.Attribute):
        return node.attr == "mode" or node.attr == "loss_mode"
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "mode"
    return False


def _strings(node: ast.AST) -> set:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def mode_comparisons() -> list[str]:
    """Comparisons of a loss mode's name with a string outside config/ and the registry (compile modes aside:
    only the shipped modes' names count), as 'file:function:line'."""
    from harness.config.modes import MODES

    names, out = set(MODES), []

    def visit(node: ast.AST, rel: str, fn: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            fn = node.name
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_strings(s) & names for s in sides) and any(_mode_expression(s) for s in sides):
                out.append(f"{rel}:{fn}:{node.lineno}")
        for child in ast.iter_child_nodes(node):
            visit(child, rel, fn)

    for path in MODULES.values():
        rel = str(path.relative_to(ROOT))
        if not rel.startswith(MODE_PLACES):
            visit(ast.parse(path.read_text()), rel, "<module>")
    return sorted(out)


def test_the_loss_mode_is_read_in_few_places():
    """A loss mode is a component (harness/modes/): its name is compared with a string in config/ (the facts table,
    the checks) and the registry; anywhere else at most 10 times, each named here. objective.py imports no specific
    mode; train.py names none; nothing reaches into `objective.rl`."""
    found = mode_comparisons()
    assert len(found) <= 10, "\n".join(found)
    assert {f.rsplit(":", 1)[0] for f in found} <= MODE_COMPARISONS_LEFT, "\n".join(found)
    objective = imports_of("harness.objective")
    assert not {m for m in objective if m.startswith(("harness.rl", "harness.preference", "harness.modes"))}, objective
    # the loop, the build and the generic objective name no mode: they call the mode's object, whatever it is
    assert not [f for f in found if f.startswith(("harness/train.py", "harness/build.py", "harness/objective.py"))]
    assert not [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if "objective.rl" in p.read_text()]


def wide_functions(least: int = 8) -> list[str]:
    """Functions of harness/ taking `least` or more parameters (self and cls not counted; *args and **kwargs count
    one each), as 'file:function'."""
    out = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                n = len([p for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")])
                if n + bool(a.vararg) + bool(a.kwarg) >= least:
                    out.append(f"{path.relative_to(ROOT)}:{node.name}")
    return sorted(out)


def test_few_functions_take_eight_parameters_or_more():
    """A wide signature is narrowed where a split gives its arguments a home (a mode's Parts, the sampling settings,
    GRPO's settings, zero-plan's Budget): at most 12 functions take 8 or more parameters (23 before the modes
    became components). Those left are mostly tensor kernels with transformers' or torch's signatures and engine
    constructors."""
    wide = wide_functions()
    assert len(wide) <= 12, "\n".join(wide)
