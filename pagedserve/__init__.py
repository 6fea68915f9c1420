"""pagedserve: a router that owns paged KV-cache block tables, executors that run the steps."""

from pathlib import Path as _Path

__version__ = "0.1.0"

# Imported from a source checkout (a worktree, a `git archive` snapshot: `python -m
# pagedserve.cli` run there, a benchmark putting its tree first on sys.path), the
# subpackages pagedserve.router, .kvmanager, ... are that checkout's top-level folders, as
# pyproject.toml maps them at install. Without this, an editable install of another tree
# would supply them, and a snapshot's benchmark would measure the other tree's code.
# Installed normally, they sit inside this folder and are found there first.
_ROOT = _Path(__file__).resolve().parent.parent
if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "router" / "__init__.py").is_file():
    __path__.append(str(_ROOT))  # noqa: F821 - a package's __path__

_OFFLINE = ("LLM", "GenerateError", "SamplingParams")  # offline generation: pagedserve.offline
__all__ = [*_OFFLINE, "__version__"]


def __getattr__(name: str):
    """`from pagedserve import LLM` loads pagedserve.offline on first use (every server
    process imports this package and never needs it)."""
    if name in _OFFLINE:
        from . import offline
        return getattr(offline, name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
