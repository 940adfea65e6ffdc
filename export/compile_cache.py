"""torch.compile's cache shipped in the repository: the export compiles the steps the server will
compile, into a fresh inductor cache, and copies that cache next to the artifacts; a model that loads
them merges it into its process's cache first, so its warm-up reads compiled kernels (FX graphs,
C++ / Triton kernels) instead of compiling them. The repository may be read-only: the cache is
copied, not used in place. Entries are keyed by content (graph, torch version, device), so a cache
from another torch or device is merely missed.
"""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from torch._inductor.runtime.cache_dir_utils import cache_dir, temporary_cache_dir

CACHE_DIR = "inductor_cache"


@contextlib.contextmanager
def filling(directories: list[Path]) -> Iterator[None]:
    """Compile inside the block into a fresh cache; on success copy it into each of `directories`."""
    with tempfile.TemporaryDirectory(prefix="triton-mtp-inductor-") as fresh:
        with temporary_cache_dir(fresh):
            yield
        for directory in directories:
            shutil.copytree(fresh, directory / CACHE_DIR, dirs_exist_ok=True)


def merge_into_process_cache(directory: Path) -> bool:
    """Add the cache shipped in `directory` (if any) to this process's inductor cache; whether there was one."""
    shipped = Path(directory) / CACHE_DIR
    if not shipped.is_dir():
        return False
    shutil.copytree(shipped, cache_dir(), dirs_exist_ok=True, copy_function=_copy_unless_present)
    return True


def _copy_unless_present(source: str, destination: str) -> str:
    """Entries are named by their content, and a present one may be a kernel library this process has
    loaded: writing over it would change the code under its feet."""
    if not Path(destination).exists():
        shutil.copy2(source, destination)
    return destination
