"""`make demo` end to end: export the bundled checkpoint, serve it, stream a held-out completion."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def test_demo_streams_a_held_out_completion_with_acceptance_stats(tmp_path: Path) -> None:
    repository = tmp_path / "repository"
    done = subprocess.run([sys.executable, "-m", "triton_mtp.demo", "--max-tokens", "24", "--repository",
                           str(repository)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (repository / "export.json").is_file()
    assert "--- held-out prompt (96 tokens) ---" in done.stdout
    assert re.search(r"^24 tokens in [0-9.]+ s \([0-9.]+ tokens/s\), finish length, acceptance [0-9.]+% "
                     r"\(\d+/\d+\), mean accepted length [0-9.]+$", done.stdout, re.MULTILINE), done.stdout[-800:]
    positions = re.search(r"^accepted per draft position: 1: (\d+)/(\d+) .*, 3: \d+/\d+ \([0-9.]+\)$",
                          done.stdout, re.MULTILINE)
    assert positions and 0 < int(positions[1]) <= int(positions[2]), done.stdout[-800:]
