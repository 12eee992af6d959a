"""Docs that cannot drift: the commands in README.md and docs/*.md are checked against the code.

* Every fenced block whose info string is `bash offline-cpu` runs (bash -euo pipefail) in a fresh copy of the
  repository's tracked files, with the test's virtualenv on PATH (and `.venv` pointing at it), offline, on the CPU;
  the blocks of one document run in order in one copy, so a later block may read an earlier block's run folder.
  It must exit 0. Mark only what runs offline on a CPU in seconds.
* Every command in any `bash` block (marked or not: GPU and hub quickstarts too) is checked without running it:
  `harness SUBCOMMAND` must exist, a `configs/*.yaml`, `scripts/*` or `launch/*` path must exist, and a recipe with
  `section.key=value` overrides given to `harness train`, `launch/train.sh`, `harness data-check --config`,
  `harness plan`, `harness zero-plan` or `harness.train --config` must load and pass the config checks.
* Every `harness ...` and `python -m harness.train` / `accelerate launch harness/train.py` command is parsed by the
  command's own argument parser (nothing runs): a documented command that no longer parses fails.
* A `launch/*.sh` command in a plain `bash` block runs with `--dry-run` on this machine (no GPU: the CPU fallback) and
  must exit 0. A block that needs a GPU box or the hub says so in its info string, `bash gpu` or `bash hub`; its
  launch commands get the checks above only. Those four (`bash`, `bash offline-cpu`, `bash gpu`, `bash hub`) are
  the only info strings a block with a harness or launch command may have.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.config import load_config
from harness.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)```(.*)$")
OVERRIDE = re.compile(r"^[a-z_]+\.[A-Za-z0-9_.]+=")
RECIPE_COMMANDS = ("train", "data-check", "plan", "zero-plan")


def blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line number of the opening fence, info string, text) of every fenced block."""
    out, info, start, body = [], None, 0, []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = FENCE.match(line)
        if m and info is None:
            info, start, body = m.group(2).strip(), n, []
        elif m and not m.group(2).strip():
            out.append((start, info, "\n".join(body)))
            info = None
        elif info is not None:
            body.append(line)
    return out


def commands(text: str) -> list[list[str]]:
    """The commands of a bash block: continuation lines joined, comments dropped, split on ;, && and |, with
    leading VAR=value assignments removed."""
    return [cmd for _, cmd in commands_with_env(text)]


def commands_with_env(text: str) -> list[tuple[dict, list[str]]]:
    """commands(), each with its leading VAR=value assignments."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        cmd: list[str] = []
        for w in [*words, ";"]:
            if w in (";", "&&", "||", "|"):
                env = {}
                while cmd and re.match(r"^[A-Z_][A-Z0-9_]*=", cmd[0]):
                    name, _, value = cmd.pop(0).partition("=")
                    env[name] = value
                if cmd:
                    out.append((env, cmd))
                cmd = []
            else:
                cmd.append(w)
    return out


def subcommands() -> set[str]:
    from harness import cli

    parser = cli.build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return set(action.choices)


def recipe_and_overrides(cmd: list[str]) -> tuple[str | None, list[str]]:
    """The recipe (configs/*.yaml or any .yaml argument) and section.key=value overrides of a command."""
    recipe = next((w for w in cmd if w.endswith((".yaml", ".yml")) and not w.startswith("accelerate_configs/")
                   and "=" not in w), None)
    return recipe, [w for w in cmd if OVERRIDE.match(w)]


def check_command(cmd: list[str], known: set[str]) -> list[str]:
    """What is wrong with one command (nothing run)."""
    problems = []
    prog = cmd[0]
    words = cmd[1:]
    for w in cmd:
        path = w.split("=", 1)[-1]
        if re.match(r"^(configs|scripts|launch|accelerate_configs|ds_configs)/[\w./-]+$", path) and \
                not (ROOT / path).exists():
            problems.append(f"no such file: {path}")
    name = os.path.basename(prog)
    asks_help = bool({"-h", "--help", "--help-config"} & set(words))  # prints help: nothing to validate
    is_harness = name == "harness"
    train_py = "harness/train.py" in words or (words[:2] == ["-m", "harness.train"])  # accelerate launch, python -m
    if name.startswith("python") and words[:2] == ["-m", "harness.cli"]:
        is_harness, words = True, words[2:]
    if train_py and name != "harness":
        if asks_help:
            return problems
        problems += parse_problems(["train", *words[words.index("harness/train.py" if "harness/train.py" in words
                                                               else "harness.train") + 1:]])
        recipe = words[words.index("--config") + 1] if "--config" in words[:-1] else None
        recipe = recipe if recipe and recipe.endswith((".yaml", ".yml")) else None  # not a placeholder (RECIPE)
        return problems + validate(recipe, recipe_and_overrides(words)[1])
    if is_harness:
        sub = next((w for w in words if not w.startswith("-")), None)
        if sub is None or sub not in known:
            return problems + [f"unknown subcommand: harness {sub} (known: {', '.join(sorted(known))})"]
        if not asks_help:
            problems += parse_problems(words)
        if sub in RECIPE_COMMANDS and not asks_help:
            recipe, overrides = recipe_and_overrides(words)
            if recipe is not None:
                problems += validate(recipe, overrides)
    elif prog.endswith("launch/train.sh") and not asks_help:
        recipe, overrides = recipe_and_overrides(words)
        problems += validate(recipe, overrides) if recipe else ["launch/train.sh without a recipe"]
    return problems


class _Parsed(Exception):
    """Raised by the first argument parser to finish: the command parsed, nothing more runs."""


def parse_problems(argv: list[str]) -> list[str]:
    """`harness ARGV` through the command's own argument parser, stopped once it has parsed (nothing runs): [] or
    the parser's complaint. harness train is parsed by harness.train's parser (the recipe rule included)."""
    import argparse
    import contextlib
    import io

    from harness import cli, train

    depth = [0]
    originals = {m: getattr(argparse.ArgumentParser, m) for m in ("parse_args", "parse_known_args",
                                                                  "parse_intermixed_args")}

    def stop_after(method):
        def parse(self, *a, **kw):
            depth[0] += 1
            try:
                result = originals[method](self, *a, **kw)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                raise _Parsed()
            return result
        return parse

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if argv[0] == "train":
                train.parse_args(argv[1:])
                return []
            with pytest.MonkeyPatch.context() as mp:
                for m in originals:
                    mp.setattr(argparse.ArgumentParser, m, stop_after(m))
                cli.main(argv)
        return [f"harness {argv[0]} ran past its argument parser (give it an argparse parser)"]
    except _Parsed:
        return []
    except SystemExit as e:
        if e.code:
            return [f"does not parse: harness {' '.join(argv)}: {err.getvalue().strip().splitlines()[-1:]}"]
    return []


def validate(recipe: str | None, overrides: list[str]) -> list[str]:
    if recipe is None:
        return []
    if not (ROOT / recipe).is_file():
        return [f"no such recipe: {recipe}"]
    try:
        load_config(ROOT / recipe, overrides)
    except ConfigError as e:
        return [f"{recipe} {' '.join(overrides)}: {e}"]
    return []


def test_every_documented_command_names_what_exists():
    known = subcommands()
    problems = []
    for doc in DOCS:
        for line, info, text in blocks(doc):
            if info.split(" ")[0] not in ("bash", "sh", "shell", "console"):
                continue
            for cmd in commands(text):
                problems += [f"{doc.relative_to(ROOT)}:{line}: {p}" for p in check_command(cmd, known)]
    assert not problems, "\n".join(problems)


MARKERS = ("bash", "bash offline-cpu", "bash gpu", "bash hub")


def is_ours(cmd: list[str]) -> bool:
    return (os.path.basename(cmd[0]) == "harness" or cmd[0].startswith("launch/") or "harness/train.py" in cmd
            or "harness.train" in cmd or "harness.cli" in cmd)


def test_every_block_with_a_harness_command_is_marked_as_it_is_checked():
    """A block with a harness or launch command is run (offline-cpu), dry-run / parsed (plain bash) or marked as
    needing a GPU box or the hub."""
    wrong = [f"{doc.relative_to(ROOT)}:{line}: ```{info}" for doc in DOCS for line, info, text in blocks(doc)
             if info.split(" ")[0] in ("bash", "sh", "shell", "console") and info not in MARKERS
             and any(is_ours(c) for c in commands(text))]
    assert not wrong, "mark these blocks with one of " + ", ".join(MARKERS) + ":\n" + "\n".join(wrong)


@pytest.mark.usefixtures("all_cpus")  # starts every dry run at once
def test_launch_commands_of_plain_blocks_dry_run(tmp_path):
    """Each launch/*.sh command of a plain `bash` block, with --dry-run, on this machine: exit 0 (all at once: each
    is a shell and a Python start-up)."""
    repo = repo_copy(tmp_path / "repo")
    env = {**{k: v for k, v in os.environ.items() if k not in ("NUM_GPUS", "GPU_MEM_GB", "NUM_NODES", "NODE_RANK")},
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1",
           "PYTHON": sys.executable, "PERSIST_DIR": "none", "CUDA_VISIBLE_DEVICES": ""}
    runs = []
    for doc in DOCS:
        for line, info, text in blocks(doc):
            if info != "bash":
                continue
            for extra, cmd in commands_with_env(text):
                if cmd[0].startswith("launch/"):
                    argv = [cmd[0], "--dry-run", *[w for w in cmd[1:] if w != "--dry-run"]]
                    runs.append((f"{doc.relative_to(ROOT)}:{line}", argv, subprocess.Popen(
                        ["bash", *argv], cwd=repo, env={**env, **extra}, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True)))
    assert len(runs) >= 10
    failed = []
    for where, argv, proc in runs:
        out, _ = proc.communicate(timeout=300)
        if proc.returncode:
            failed.append(f"{where}: {' '.join(argv)}: exit {proc.returncode}\n{out[-1500:]}")
    assert not failed, "\n".join(failed)
    assert not (repo / "runs").exists()  # a dry run starts nothing and writes nothing


def test_the_checker_catches_a_renamed_key_subcommand_and_recipe():
    """The checker itself: each of these is what a rename in the code leaves behind in the docs."""
    known = subcommands()
    assert check_command(["harness", "train", "configs/default.yaml", "train.max_steps=5"], known) == []
    assert "unknown subcommand" in check_command(["harness", "check-data", "data/"], known)[0]
    assert "train.max_step" in check_command(["harness", "train", "configs/default.yaml", "train.max_step=5"],
                                             known)[0]
    assert check_command(["launch/train.sh", "--dry-run", "configs/nope.yaml"], known) == [
        "no such file: configs/nope.yaml", "no such recipe: configs/nope.yaml"]
    assert "train.max_step" in check_command([".venv/bin/accelerate", "launch", "--config_file",
                                              "accelerate_configs/zero3.yaml", "harness/train.py", "--config",
                                              "configs/default.yaml", "train.max_step=5"], known)[0]
    assert "train.max_step" in check_command([".venv/bin/python", "-m", "harness.train", "--config",
                                              "configs/default.yaml", "train.max_step=5"], known)[0]
    assert check_command(["harness", "train", "--config", "configs/dpo-tiny.yaml", "train.max_steps=5"], known) == []
    assert check_command(["harness", "plan", "--config", "configs/default.yaml", "--hours", "1"], known) == []
    assert "does not parse" in check_command(["harness", "train", "--fast", "configs/default.yaml"], known)[0]
    assert "does not parse" in check_command(["harness", "plan", "configs/default.yaml", "--days", "1"], known)[0]
    assert "does not parse" in check_command(["harness", "rft", "generate", "configs/rft-tiny.yaml", "--stop", "x"],
                                             known)[0]
    assert "does not parse" in check_command([".venv/bin/python", "-m", "harness.train", "--cfg",
                                              "configs/default.yaml"], known)[0]
    assert commands("NUM_GPUS=1 launch/train.sh \\\n  --dry-run configs/default.yaml  # comment\nls | head") == [
        ["launch/train.sh", "--dry-run", "configs/default.yaml"], ["ls"], ["head"]]


def repo_copy(dest: Path) -> Path:
    """The tracked files (what a clone has), and .venv pointing at this test's virtualenv."""
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        names = [n for n in files.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: everything but outputs
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()
                 and not {".git", ".venv", "runs", "__pycache__"} & set(p.relative_to(ROOT).parts)]
    for name in names:
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    (dest / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    return dest


MARKED = [(doc, line, text) for doc in DOCS for line, info, text in blocks(doc) if info == "bash offline-cpu"]


@pytest.mark.slow
@pytest.mark.parametrize("doc", sorted({d for d, _, _ in MARKED}), ids=lambda d: str(d.relative_to(ROOT)))
@pytest.mark.usefixtures("all_cpus")  # the blocks launch runs of their own (train.sh, accelerate launch)
def test_offline_cpu_blocks_run(doc, tmp_path):
    repo = repo_copy(tmp_path / "repo")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "CUDA_VISIBLE_DEVICES": ""}
    for d, line, text in MARKED:
        if d != doc:
            continue
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, (f"{doc.relative_to(ROOT)}:{line}: exit {proc.returncode}\n{text}\n"
                                      f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")


def test_ci_runs_the_readme_commands_in_order():
    """.ci/run is what a new user does in a fresh clone: the README's command 1 (train the default job, which leaves a
    finished runs/default), then command 2 (the tests), in that order."""
    first = blocks(ROOT / "README.md")[0][2]
    readme = [" ".join(c) for c in commands(first)]
    ci = [" ".join(c) for c in commands((ROOT / ".ci" / "run").read_text())]
    steps = [ci.index(c, ci.index(readme[i - 1]) + 1 if i else 0) for i, c in enumerate(readme)]
    assert len(readme) == 4 and steps == sorted(steps), (readme, ci)


def test_readme_figures_are_the_default_jobs():
    """The README's figures of the default job are its report's (runs/default/report.json, which .ci/run's command 1
    leaves before the tests), within 0.1: "about" one decimal; a run on another CPU sums in another order (~1e-6)."""
    report = ROOT / "runs" / "default" / "report.json"
    if not report.is_file():
        pytest.skip("runs/default/report.json: made by the README's command 1 (.ci/run runs it before the tests)")
    r = json.loads(report.read_text())
    text = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(r"The held-out loss falls from about ([\d.]+) at step 0 to about ([\d.]+) at the end \(the "
                  r"training loss from about ([\d.]+) at step 1 to about ([\d.]+);", text)
    assert m, "the README's sentence with the default job's figures is gone"
    stated = [float(x) for x in m.groups()]
    measured = [r["eval_at_start"]["eval_loss"], r["eval"]["eval_loss"], r["first_loss"], r["final_loss"]]
    assert all(abs(a - b) <= 0.1 for a, b in zip(stated, measured)), (stated, measured)


def training_commands() -> list[tuple[str, int, str, tuple]]:
    """(doc, line, output_dir, (recipe, overrides)) of every documented command that trains (harness train, python -m
    harness.train, accelerate launch harness/train.py, launch/train.sh; not --dry-run or --help), its recipe a file."""
    out = []
    for doc in DOCS:
        for line, info, text in blocks(doc):
            if not info or info.split()[0] not in ("bash", "sh", "console"):
                continue
            for cmd in commands(text):
                name, words = os.path.basename(cmd[0]), cmd[1:]
                trains = (name == "harness" and words[:1] == ["train"]) or "harness/train.py" in words or \
                    words[:2] == ["-m", "harness.train"] or cmd[0].endswith("launch/train.sh")
                if not trains or {"-h", "--help", "--help-config", "--dry-run"} & set(words):
                    continue
                recipe, overrides = recipe_and_overrides(words)
                if "--config" in words[:-1]:
                    recipe = words[words.index("--config") + 1]
                if cmd[0].endswith("launch/train.sh") and "--sp" in words[:-1]:  # what --sp N sets
                    overrides = [*overrides, f"train.sequence_parallel={words[words.index('--sp') + 1]}"]
                if not recipe or not (ROOT / recipe).is_file():
                    continue
                out_dir = load_config(ROOT / recipe, overrides).train.output_dir
                run = (recipe, tuple(sorted(o for o in overrides if not o.startswith(("train.output_dir=",
                                                                                      "train.stop_at_step=")))))
                out.append((doc.name, line, out_dir, run))
    return out


def test_every_documented_training_command_writes_to_its_own_run_folder():
    """Two documented commands that train different runs (another recipe or other overrides) never share a run
    folder: the second would find the first's finished run ("nothing to do") or resume it with other settings. The
    same run shown twice (the README's quickstart again in a guide) may."""
    by_folder: dict[str, dict[tuple, list[str]]] = {}
    for doc, line, out_dir, run in training_commands():
        by_folder.setdefault(out_dir, {}).setdefault(run, []).append(f"{doc}:{line}")
    shared = {d: runs for d, runs in by_folder.items() if len(runs) > 1}
    assert not shared, "\n".join(f"{d}: " + "; ".join(f"{' '.join([r[0], *r[1]])} ({', '.join(w)})"
                                                      for r, w in runs.items()) for d, runs in shared.items())
