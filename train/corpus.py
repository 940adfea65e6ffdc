"""Training corpus: the Python standard library sources of the running interpreter.

Only the standard library itself (no site-packages / dist-packages), without its test suites
(directories named `test`, `tests` or `idle_test`). Files are split into train / held-out by a
deterministic rule on their path relative to the library root, so every machine with the same Python
version draws the same split:

    held_out(path) = int(sha256(relative_posix_path).hexdigest(), 16) % 10 == 0     (~10% of files)
"""
from __future__ import annotations

import dataclasses
import hashlib
import sysconfig
from pathlib import Path

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
HELD_OUT_BUCKETS = 10


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    """The split rule: a file is held out when the sha256 of its relative path is 0 mod 10."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).hexdigest()
    return int(digest, 16) % HELD_OUT_BUCKETS == 0


@dataclasses.dataclass(frozen=True)
class Split:
    """Relative paths of the train and held-out files under `root`, each sorted."""

    root: Path
    train: list[str]
    held_out: list[str]

    def read(self, relative_path: str) -> str:
        """One source file as text (undecodable bytes replaced)."""
        return (self.root / relative_path).read_bytes().decode("utf-8", errors="replace")


def split_stdlib(root: Path | None = None) -> Split:
    """All `.py` files of the standard library at `root`, split by `is_held_out`."""
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root}: not a directory")
    paths = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])
    )
    if not paths:
        raise FileNotFoundError(f"corpus root {root}: no .py files found")
    held_out = [p for p in paths if is_held_out(p)]
    train = [p for p in paths if not is_held_out(p)]
    return Split(root=root, train=train, held_out=held_out)
