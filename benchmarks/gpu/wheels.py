"""Which wheels the device call carries, chosen and checked here, with the package index at hand (prepare.sh runs it).

The GPU image has no network and packages of its own (image.txt). A carried wheel whose needs the image does not meet
fails there at import, after the machine has started: device time for nothing. transformers checks huggingface-hub,
tokenizers, safetensors and accelerate when it is imported, and 5.25.0 needs huggingface-hub >= 2.4.0 where the
image holds 1.33.0 (huggingface-hub 2.x would need httpx2, which the image lacks too). So each wanted package is
carried at the newest release, no newer than this environment's and within pyproject.toml's range, whose
Requires-Dist the image and the other carried wheels meet, at most --tries releases back; none: exit 1 with the
unmet need. A need on a package the image holds without a recorded version is printed as unchecked.

    python benchmarks/gpu/wheels.py --dest .whl transformers datasets dill multiprocess
"""
from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Callable

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


def read_image(path: Path = HERE / "image.txt") -> dict[str, str | None]:
    """{canonical name: version or None (present, version not read)}; `python` holds the interpreter's version."""
    held = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            held[canonicalize_name(name)] = version.strip() or None
    return held


def marker_environment(python: str) -> dict[str, str]:
    """The image's interpreter as environment markers see it (CPython on x86-64 Linux)."""
    return {"python_version": ".".join(python.split(".")[:2]), "python_full_version": python,
            "implementation_name": "cpython", "implementation_version": python,
            "platform_python_implementation": "CPython",
            "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix", "platform_machine": "x86_64",
            "extra": ""}


def needs(metadata: str, environment: dict[str, str]) -> list[Requirement]:
    """A wheel's Requires-Dist that apply there (markers evaluated; extras' needs left out)."""
    wanted = []
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist:"):
            requirement = Requirement(line.split(":", 1)[1].strip())
            if requirement.marker is None or requirement.marker.evaluate(environment):
                wanted.append(requirement)
    return wanted


def unmet(requirements: list[Requirement], provided: dict[str, str | None]) -> tuple[list[str], list[str]]:
    """(needs nothing there meets, needs on a package held at an unread version)."""
    problems, unchecked = [], []
    for requirement in requirements:
        name = canonicalize_name(requirement.name)
        if name not in provided:
            problems.append(f"{requirement} (the image lacks {requirement.name} and it is not carried)")
        elif provided[name] is None:
            if requirement.specifier:
                unchecked.append(f"{requirement} (the image's version is not recorded)")
        elif not requirement.specifier.contains(provided[name], prereleases=True):
            problems.append(f"{requirement} (there: {provided[name]})")
    return problems, unchecked


def project_range(name: str) -> Requirement | None:
    """pyproject.toml's requirement on `name`, if it names it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [Requirement(r) for r in project["dependencies"]]
    return next((r for r in found if canonicalize_name(r.name) == canonicalize_name(name)), None)


def pip_releases(name: str) -> list[str]:
    """The index's releases of `name`, as `pip index versions` lists them."""
    done = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name], capture_output=True, text=True)
    found = re.search(r"Available versions: (.*)", done.stdout)
    if done.returncode or not found:
        raise SystemExit(f"wheels.py: the package index did not list {name}'s releases: "
                         f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    return [v.strip() for v in found.group(1).split(",")]


def pip_download(name: str, version: str, dest: Path, python: str) -> Path:
    """The wheel of name==version for the image's interpreter, downloaded into dest."""
    before = set(dest.glob("*.whl"))
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               ".".join(python.split(".")[:2]), "--implementation", "cp", "-d", str(dest), f"{name}=={version}"]
    command += [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    done = subprocess.run(command, capture_output=True, text=True)
    new = set(dest.glob("*.whl")) - before
    if done.returncode or len(new) != 1:
        raise SystemExit(f"wheels.py: pip could not download {name}=={version} for Python {python}: "
                         f"{(done.stderr.strip().splitlines() or ['no wheel'])[-1]}")
    return new.pop()


def wheel_metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()


def candidates(name: str, newest: str, releases: list[str], tries: int) -> list[str]:
    """Releases to try, newest first: no newer than `newest`, no pre-release, inside pyproject.toml's range."""
    allowed = project_range(name)
    kept = sorted({Version(v) for v in releases if not Version(v).is_prerelease and Version(v) <= Version(newest)
                   and (allowed is None or allowed.specifier.contains(v))}, reverse=True)
    return [str(v) for v in kept[:tries]]


def choose(names: list[str], image: dict[str, str | None], fetch: Callable[[str, str], str],
           releases: Callable[[str], list[str]], local: Callable[[str], str], tries: int = 4,
           say: Callable[[str], None] = print) -> dict[str, str]:
    """{name: version} to carry. fetch(name, version) gives that wheel's METADATA (downloading it)."""
    environment = marker_environment(image.get("python") or "3.12")
    planned = {canonicalize_name(n): local(n) for n in names}
    read: dict[tuple[str, str], list[Requirement]] = {}
    for name in names:
        key, tried = canonicalize_name(name), []
        for version in candidates(name, planned[key], releases(name), tries):
            read[name, version] = needs(fetch(name, version), environment)
            problems, unchecked = unmet(read[name, version], {**image, **planned})
            if not problems:
                planned[key] = version
                say(f"carry {name} {version}" + (f" (not {', '.join(tried)})" if tried else "") +
                    "".join(f"\n  unchecked: {u}" for u in unchecked))
                break
            tried.append(f"{version}: needs {problems[0]}")
        else:
            raise SystemExit(f"wheels.py: no release of {name} from {planned[key]} back ({tries} tried) has needs the "
                             f"GPU image meets ({'; '.join(tried) or 'none in range'}); carry the need too (name it "
                             "here) or update benchmarks/gpu/image.txt from a newer reading")
    for name in names:  # once more against the final choice: a later package may have gone back a release
        problems, _ = unmet(read[name, planned[canonicalize_name(name)]], {**image, **planned})
        if problems:
            raise SystemExit(f"wheels.py: {name} {planned[canonicalize_name(name)]} needs {problems[0]} once the "
                             "others are chosen; name the packages in another order or pin one")
    return planned


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="+", help="packages to carry")
    parser.add_argument("--dest", type=Path, required=True, help="folder for the wheels (emptied first)")
    parser.add_argument("--tries", type=int, default=4, help="releases to try per package, newest first")
    args = parser.parse_args(argv)
    image = read_image()
    python = image.get("python") or "3.12"
    args.dest.mkdir(parents=True, exist_ok=True)
    for old in args.dest.glob("*.whl"):
        old.unlink()
    wheels: dict[tuple[str, str], Path] = {}

    def fetch(name: str, version: str) -> str:
        wheels[name, version] = pip_download(name, version, args.dest, python)
        return wheel_metadata(wheels[name, version])

    chosen = choose(args.names, image, fetch, pip_releases, importlib.metadata.version, args.tries)
    for (name, version), wheel in wheels.items():
        if chosen[canonicalize_name(name)] != version:
            wheel.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
