"""The images install what the operator runs in them.

No container engine runs here, so each image is modelled by what its Dockerfile installs: the
packtrain extras it names, hence a set of allowed distributions (their dependency closure).
Then, for every command the operator puts in a pod of that image:
- at run time: the command starts, up to its argument parser accepting the whole command line,
  in a fresh interpreter whose imports of any other distribution fail, as in the image;
- statically: every import reachable from the image's packtrain subpackages, lazy ones included,
  resolves to the standard library, packtrain, or an allowed distribution.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from support.images_scripts import images_script
from support.import_graph import PACKAGE_DIRS, imports_of, module_file

from packtrain.operator import builders
from packtrain.operator.api import PackJobSpec, SFTJobSpec
from packtrain.operator.commands import PACK_STAGES, pack_stage_command, train_command
from packtrain.operator.settings import OperatorDefaults

from .helm import REPO, render

IMAGES = REPO / "images"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# The `packtrain` dispatcher imports each subcommand inside a function, only when it is chosen:
# its lazy imports belong to other images.
DISPATCHER = "packtrain.operator.cli"
# The packtrain subpackages each image must be able to import completely.
IMAGE_PACKAGES = {
    "operator": ["packtrain.operator"],
    "packer": ["packtrain.packer"],
    "trainer": ["packtrain.trainer"],
}

# Imports an image may lack, with the reason no pod reaches them.
NOT_IN_PODS: dict[str, dict[str, str]] = {
    "packer": {
        "matplotlib": "`packtrain pack inspect --plot` (plot extra) is a workstation tool",
        "torch": "packer.pixels calls torchvision's resize only where torch is already loaded (the trainer)",
        "torchvision": "packer.pixels calls torchvision's resize only where torch is already loaded",
    },
}


# --- Dockerfiles ------------------------------------------------------------------------------


def instructions(image: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = (IMAGES / image / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def lock_module() -> Any:
    """images/lock.py, the one source of which extras each image installs."""
    return images_script("lock")


def lock_layers_module() -> Any:
    """images/lock_layers.py, which splits a lock into the layers a Dockerfile installs."""
    return images_script("lock_layers")


def installed_extras(image: str) -> set[str]:
    """Extras of the project install: the image installs its hash-locked requirements (made from
    pyproject with these extras) and the packtrain wheel with --no-deps."""
    runs = [a for w, a in instructions(image) if w == "RUN"]
    copies = [a for w, a in instructions(image) if w == "COPY"]
    assert any(a.startswith(f"images/{image}/requirements.txt ") for a in copies), (
        f"{image}: its lock is not copied"
    )
    whole = [a for a in runs if "--require-hashes" in a and "-r /opt/packtrain/requirements.txt" in a]
    layered = [a for a in runs if f"lock_layers.py /opt/packtrain/requirements.txt {image} " in a]
    assert all("--require-hashes" in a and "-r /tmp/layer.txt" in a for a in layered), image
    layers = len(lock_layers_module().split(lock_module().lock_path(image).read_text(), image))
    # The lock goes in whole in one RUN, or one RUN per layer of images/lock_layers.py.
    assert (len(whole), len(layered)) in {(1, 0), (0, layers)}, (image, len(whole), len(layered), layers)
    assert sum("--no-deps" in a and "packtrain-*.whl" in a for a in runs) == 1, image
    return set(lock_module().IMAGE_EXTRAS[image])


def entrypoint(image: str) -> list[str]:
    (args,) = [a for w, a in instructions(image) if w == "ENTRYPOINT"]
    parsed: list[str] = json.loads(args)
    return parsed


@pytest.mark.parametrize("image", sorted(IMAGE_PACKAGES))
def test_dockerfile_is_multistage_pinned_and_non_root(image: str) -> None:
    steps = instructions(image)
    args = {a.split("=", 1)[0]: a.split("=", 1)[1].strip('"') for w, a in steps if w == "ARG" and "=" in a}
    froms = [a.split() for w, a in steps if w == "FROM"]
    assert len(froms) >= 2, "multi-stage: a builder and a runtime stage"
    stages = {f[2] for f in froms if len(f) == 3 and f[1].upper() == "AS"}
    bases = [f[0] for f in froms if f[0] not in stages]  # a stage built on an earlier one is no base
    for base in bases:
        ref = args.get(base.strip("${}"), base)
        name, _, tag = ref.partition(":")
        # An exact version in the tag, never a moving one.
        assert re.match(r"^\d+\.\d+\.\d+", tag), f"{image}: base {ref} is not pinned to a version"
    (user,) = [a for w, a in steps if w == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "runAsNonRoot needs a numeric non-root USER"
    if image == "operator":
        deployment = next(o for o in render() if o["kind"] == "Deployment")
        assert int(uid) == deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    # The context is the repository root: everything is ignored but what the COPY lines read.
    ignore = [
        ln
        for ln in (IMAGES / image / "Dockerfile.dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert ignore[0] == "*"
    copied = {src for w, a in steps if w == "COPY" and "--from" not in a for src in a.split()[:-1]}
    assert copied and {f"!{src}" for src in copied} <= set(ignore), copied


def test_images_install_the_issue_extras() -> None:
    assert installed_extras("operator") == {"operator"}
    assert installed_extras("packer") == set()
    # flash-attn has no wheel on PyPI and is imported lazily: the trainer image runs without it.
    assert installed_extras("trainer") == {"trainer"}


# --- which distributions an image has ---------------------------------------------------------


def _wanted(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": e}) for e in extras | {""})


@cache
def allowed_distributions(extras: frozenset[str], omit: frozenset[str] = frozenset()) -> frozenset[str]:
    """packtrain's dependencies with `extras` (less the core ones in `omit`), and theirs, as installed
    here."""
    project = PYPROJECT["project"]
    todo = [
        Requirement(r) for r in project["dependencies"] if canonicalize_name(Requirement(r).name) not in omit
    ]
    for extra in extras:
        todo += [Requirement(r) for r in project["optional-dependencies"][extra]]
    seen: set[tuple[str, frozenset[str]]] = set()
    names: set[str] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        key = (name, frozenset(req.extras))
        if key in seen or name == "packtrain":
            continue
        seen.add(key)
        names.add(name)
        try:
            requires = md.distribution(req.name).requires or []
        except md.PackageNotFoundError:
            continue  # e.g. flash-attn, GPU-only: allowed, and nothing here imports it
        todo += [r for r in map(Requirement, requires) if _wanted(r, set(req.extras))]
    return frozenset(names)


def image_distributions(image: str) -> frozenset[str]:
    """What the image's lock installs: its extras, less the core dependencies it omits."""
    omit = frozenset(canonicalize_name(n) for n in lock_module().IMAGE_OMITS.get(image, {}))
    return allowed_distributions(frozenset(installed_extras(image)), omit)


@cache
def module_distributions() -> dict[str, set[str]]:
    return {top: {canonicalize_name(d) for d in dists} for top, dists in md.packages_distributions().items()}


def third_party_problem(module: str, allowed: frozenset[str]) -> str | None:
    top = module.partition(".")[0]
    if top in sys.stdlib_module_names or top == "packtrain":
        return None
    dists = module_distributions().get(top)
    if not dists:
        return f"{module}: no installed distribution provides it"
    if dists & allowed:
        return None
    return f"{module}: from {sorted(dists)}, not installed in the image"


# --- static: the import graph of packtrain's modules ----------------------------------------


def package_modules(package: str) -> list[str]:
    """Every module of `package`, subpackages included."""
    folder = REPO / PACKAGE_DIRS[package]
    found = []
    for path in folder.rglob("*.py"):
        parts = path.relative_to(folder).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found.append(".".join((package, *parts)))
    return sorted(found)


def static_problems(
    roots: list[str], allowed: frozenset[str], exempt: frozenset[str] = frozenset()
) -> list[str]:
    problems: list[str] = []
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = module_file(module)
        if path is None:
            if module.startswith("packtrain"):
                problems.append(f"{module}: no such packtrain module")
            continue
        for imported in imports_of(module, path, lazy=module != DISPATCHER):
            if imported.startswith("packtrain"):
                todo.append(imported)
                # Importing a submodule runs its parents' __init__ first.
                todo += [".".join(imported.split(".")[:i]) for i in range(2, imported.count(".") + 1)]
            elif imported.partition(".")[0] in exempt:
                continue
            elif (problem := third_party_problem(imported, allowed)) is not None:
                problems.append(f"{problem} (imported by {module})")
    return sorted(set(problems))


@pytest.mark.parametrize("image", sorted(IMAGE_PACKAGES))
def test_image_packages_import_only_what_the_image_installs(image: str) -> None:
    allowed = image_distributions(image)
    roots = [m for package in IMAGE_PACKAGES[image] for m in package_modules(package)]
    assert roots
    exempt = frozenset(NOT_IN_PODS.get(image, {}))
    assert static_problems(roots, allowed, exempt) == []
    # An exemption that no longer matches anything must go.
    unexempted = static_problems(roots, allowed)
    for name in exempt:
        assert any(p.startswith(f"{name}:") or p.startswith(f"{name}.") for p in unexempted), name


def test_static_check_sees_lazy_and_ignores_optional_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nimport json\n"
        "if TYPE_CHECKING:\n    import torch\n"
        "try:\n    import flash_attn\nexcept ImportError:\n    flash_attn = None\n"
        "def f():\n    import kopf\n    from .sibling import x\n"
    )
    assert imports_of("packtrain.packer.m", source, lazy=True) == {
        "typing",
        "json",
        "kopf",
        "packtrain.packer.sibling",
    }
    assert imports_of("packtrain.packer.m", source, lazy=False) == {"typing", "json"}
    core = allowed_distributions(frozenset())
    assert third_party_problem("kopf", core) is not None
    assert third_party_problem("torch.nn", core) is not None
    assert third_party_problem("pyarrow.parquet", core) is None
    assert "kopf" in allowed_distributions(frozenset({"operator"}))


# --- run time: the commands the operator builds ----------------------------------------------

RUNNER = r"""
import argparse, importlib.abc, importlib.metadata as md, json, runpy, sys
from packaging.utils import canonicalize_name

allowed = set(json.loads(sys.argv[1]))
argvs = json.loads(sys.argv[2])
owners = md.packages_distributions()


class NotInImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        dists = {canonicalize_name(d) for d in owners.get(top, ())}
        if top in sys.stdlib_module_names or top == "packtrain" or not dists or dists & allowed:
            return None
        raise ModuleNotFoundError(f"No module named {name!r} (its distribution is not in the image)",
        name=name)


sys.meta_path.insert(0, NotInImage())


def console_script(name):
    (ep,) = [e for e in md.entry_points(group="console_scripts") if e.name == name]
    dist = canonicalize_name(ep.dist.name)
    assert dist == "packtrain" or dist in allowed, f"{name} comes from {dist}, not installed in the image"
    return ep


# Raised once the command's argument parser accepted the whole command line.
class Parsed(Exception):
    pass


real_parse_args = argparse.ArgumentParser.parse_args


def parse_args_then_stop(self, args=None, namespace=None):
    real_parse_args(self, args, namespace)  # exits 2 on unknown or missing arguments
    raise Parsed(self.prog)


def run(program, args):
    if program == "torchrun":
        console_script("torchrun")
        from torch.distributed.run import parse_args

        parsed = parse_args(args)
        assert parsed.module, "the operator runs a module under torchrun"
        argparse.ArgumentParser.parse_args = parse_args_then_stop
        sys.argv = [parsed.training_script, *parsed.training_script_args]
        runpy.run_module(parsed.training_script, run_name="__main__", alter_sys=True)
    else:
        main = console_script(program).load()
        argparse.ArgumentParser.parse_args = parse_args_then_stop
        sys.argv = [program, *args]
        main(args)


for argv in argvs:
    try:
        run(argv[0], argv[1:])
    except Parsed:
        pass
    else:
        sys.exit(f"{argv}: ran without parsing its arguments")
    finally:
        argparse.ArgumentParser.parse_args = real_parse_args
print(json.dumps(sorted(m for m in sys.modules if m.startswith("packtrain"))))
"""


def run_in_image(image: str, argvs: list[list[str]]) -> list[str]:
    """Start each command as the image would (one interpreter), up to its parsed arguments;
    returns the packtrain modules loaded."""
    allowed = sorted(image_distributions(image))
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(allowed), json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, f"{image}: {argvs} failed:\n{proc.stderr[-3000:]}"
    loaded: list[str] = json.loads(proc.stdout.strip().splitlines()[-1])
    return loaded


def _container_commands(obj: Any) -> list[list[str]]:
    """Every `command` of a container in a built object (Job, PyTorchJob, TrainJob)."""
    found: list[list[str]] = []
    if isinstance(obj, dict):
        if isinstance(obj.get("command"), list) and "image" in obj:
            found.append(obj["command"])
        for value in obj.values():
            found += _container_commands(value)
    elif isinstance(obj, list):
        for value in obj:
            found += _container_commands(value)
    return found


def _pack_commands() -> list[list[str]]:
    spec = PackJobSpec.model_validate(
        {
            "source": {"paths": ["/data/in.jsonl"]},
            "model": {"path": "/models/m"},
            "output": {"claimName": "out"},
        }
    )
    commands = []
    for stage in PACK_STAGES:
        commands += _container_commands(builders.pack_job("p", "ml", spec, stage, OperatorDefaults()))
    return commands


def _train_commands() -> list[list[str]]:
    commands = []
    for backend in ("pytorchjob", "trainjob"):
        spec = SFTJobSpec.model_validate(
            {
                "data": {"path": "/data/pack"},
                "model": {"path": "/models/m"},
                "backend": backend,
                "resources": {"nodes": 2, "gpusPerNode": 8},
                "volumes": {"data": {"claimName": "data"}, "checkpoints": {"claimName": "ckpt"}},
            }
        )
        job = builders.training_job(
            "t", "ml", spec, builders.data_source(spec, None, None), OperatorDefaults()
        )
        commands += _container_commands(job)
    return commands


def test_builders_use_the_command_functions() -> None:
    pack = _pack_commands()
    assert {tuple(c[:3]) for c in pack} == {("packtrain", "pack", s) for s in PACK_STAGES}
    assert pack[0][:3] == pack_stage_command("convert", "c", "o")[:3]
    train = _train_commands()
    assert train and all(c[0] == train_command("c", "d", "o", 1)[0] for c in train)


def test_pack_commands_run_in_the_packer_image() -> None:
    loaded = run_in_image("packer", _pack_commands())
    assert "packtrain.packer.cli" in loaded and "packtrain.trainer.model.build" not in loaded


def test_train_commands_run_in_the_trainer_image() -> None:
    extra = [train_command("c", "d", "o", 0), train_command("c", "d", "o", 8, nnodes=4, max_steps=10)]
    loaded = run_in_image("trainer", _train_commands() + extra)
    assert "packtrain.trainer.cli" in loaded


def test_operator_deployment_command_runs_in_the_operator_image() -> None:
    commands = []
    for values in ({}, {"rbac": {"scope": "namespace"}, "operator": {"verbose": True}}):
        deployment = next(o for o in render(values) if o["kind"] == "Deployment")
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert "command" not in container, "the image's ENTRYPOINT is the command"
        commands.append(entrypoint("operator") + container["args"])
    run_in_image("operator", commands)


def test_runner_refuses_what_the_image_lacks() -> None:
    """The run-time check can fail: torch is not in the packer image."""
    allowed = sorted(allowed_distributions(frozenset()))
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            RUNNER,
            json.dumps(allowed),
            json.dumps([["torchrun", "--standalone", "-m", "packtrain.operator.cli", "train"]]),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode != 0 and "not installed in the image" in proc.stderr
