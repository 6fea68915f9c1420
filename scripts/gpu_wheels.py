"""`make gpu-wheels`: download, into `.whl/`, the wheels the CUDA machine's image lacks, for
CPython 3.12 on manylinux x86_64, so `scripts/gpu_check.sh` can install them there with no
network (`pip install --no-index --no-deps --target`).

What is carried: every runtime dependency in pyproject.toml that the image does not hold
(IMAGE_PACKAGES, from the device notes' package list), then, from each downloaded wheel's
METADATA, every requirement of it (markers evaluated for Linux, CPython 3.12) that the image
does not hold either, until nothing new appears. ALWAYS_CARRY are carried even though the
image holds them: the committed stubs need runtimes at least as new as their generators
(generate_pb2.py: protobuf 7.35.1; generate_pb2_grpc.py: grpcio 1.85.1), and the image's
versions are not known ahead of a run.

Versions are pinned to what this venv has installed (else constraints.txt); a package found
in neither is an error. One version of each package stays in `.whl/` (older files of a carried
package are removed: two versions of one name stop the whole install).

    .venv/bin/python scripts/gpu_wheels.py [--dest .whl] [--max-mib 48]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parent.parent

# The CUDA machines' image (the device notes' package list of nvidia-h100-x1 / nvidia-h200, read
# 2026-11-17), only the names that matter to pagedserve's dependency tree.
IMAGE_PACKAGES = frozenset(canonicalize_name(n) for n in (
    "accelerate", "aiofiles", "aiohappyeyeballs", "aiohttp", "aiosignal", "anyio", "attrs",
    "certifi", "charset-normalizer", "click", "filelock", "frozenlist", "fsspec", "grpcio", "h11",
    "hf-xet", "httpcore", "httpx", "huggingface-hub", "hypothesis", "idna", "iniconfig", "jinja2",
    "markupsafe", "msgpack", "multidict", "networkx", "numpy", "packaging", "pluggy",
    "prometheus-client", "propcache", "protobuf", "psutil", "pygments", "pytest", "pyyaml",
    "regex", "requests", "rich", "safetensors", "setuptools", "sentencepiece", "six", "sympy",
    "tokenizers", "torch", "tqdm", "transformers", "triton", "typing-extensions", "urllib3",
    "uvloop", "wheel", "yarl",
))
ALWAYS_CARRY = ("grpcio", "protobuf")

# pip matches a manylinux tag's glibc version exactly: name every one a wheel may carry.
PLATFORMS = ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"] + [
    f"manylinux_2_{n}_x86_64" for n in range(5, 40)]
TARGET_ENV = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
              "implementation_name": "cpython", "platform_python_implementation": "CPython",
              "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
              "os_name": "posix", "extra": ""}


def project_requirements(pyproject: Path) -> list[Requirement]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [r for r in map(Requirement, deps) if r.marker is None or r.marker.evaluate(TARGET_ENV)]


def first_names(pyproject: Path) -> list[str]:
    """What to carry before reading any wheel: the project's dependencies the image lacks,
    then ALWAYS_CARRY."""
    names = [r.name for r in project_requirements(pyproject)
             if canonicalize_name(r.name) not in IMAGE_PACKAGES]
    return names + [n for n in ALWAYS_CARRY if n not in names]


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The wheel's Requires-Dist lines that apply on the target (no extras)."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(name).decode()
    reqs = [Requirement(v.strip()) for k, v in
            (line.split(":", 1) for line in text.splitlines() if line.startswith("Requires-Dist:"))]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(TARGET_ENV)]


def pinned_version(name: str, constraints: Path) -> str:
    """The version this venv uses: installed, else `name==X` in constraints.txt."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
    for line in constraints.read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s;#]+)", line)
        if m and canonicalize_name(m.group(1)) == canonicalize_name(name):
            return m.group(2)
    raise SystemExit(f"gpu-wheels: {name} is neither installed in this venv nor pinned in "
                     f"{constraints.name}; run `make setup` first")


def wheels_in(dest: Path) -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for path in dest.glob("*.whl"):
        out.setdefault(canonicalize_name(parse_wheel_filename(path.name)[0]), []).append(path)
    return out


def download(name: str, version: str, dest: Path) -> Path:
    """One wheel, no dependencies, for cp312 manylinux x86_64; older versions removed."""
    key = canonicalize_name(name)
    for path in wheels_in(dest).get(key, []):
        if str(parse_wheel_filename(path.name)[1]) != version:
            path.unlink()
    have = wheels_in(dest).get(key)
    if have:
        return have[0]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
           "--abi", "abi3", "--abi", "none", *[x for p in PLATFORMS for x in ("--platform", p)],
           "-d", str(dest), f"{name}=={version}"]
    subprocess.run(cmd, check=True)
    found = wheels_in(dest).get(key, [])
    if len(found) != 1:
        raise SystemExit(f"gpu-wheels: expected one wheel of {name} in {dest}, found {found}")
    return found[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", default=str(ROOT / ".whl"))
    ap.add_argument("--max-mib", type=float, default=48.0,
                    help="fail above this total (a device call carries 64 MiB with the tree)")
    args = ap.parse_args(argv)
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    constraints = ROOT / "constraints.txt"

    todo = first_names(ROOT / "pyproject.toml")
    carried: dict[str, Path] = {}
    while todo:
        name = todo.pop(0)
        key = canonicalize_name(name)
        if key in carried:
            continue
        version = pinned_version(name, constraints)
        carried[key] = download(name, version, dest)
        todo += [r.name for r in wheel_requirements(carried[key])
                 if canonicalize_name(r.name) not in IMAGE_PACKAGES]
    stale = [p for k, ps in wheels_in(dest).items() if k not in carried for p in ps]
    for path in stale:  # a package no longer carried
        path.unlink()
    total = sum(p.stat().st_size for p in carried.values())
    for key in sorted(carried):
        print(f"{carried[key].name:70s} {carried[key].stat().st_size / 2**20:6.2f} MiB")
    print(f"{len(carried)} wheels, {total / 2**20:.2f} MiB in {dest}")
    if total > args.max_mib * 2**20:
        print(f"gpu-wheels: {total / 2**20:.1f} MiB is over --max-mib {args.max_mib}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
