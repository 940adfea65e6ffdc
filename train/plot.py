"""Loss curves of a training run (`train_log.jsonl`) as a PNG: `python -m triton_mtp.train.plot LOG PNG`."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def plot_losses(log_path: Path, png_path: Path) -> None:
    """Train and held-out loss per depth (target, MTP 1..D), and held-out draft agreement per MTP depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
    train = [e for e in entries if "depth_loss" in e]
    held = [e for e in entries if "held_out_loss" in e]
    if not train or not held:
        raise ValueError(f"{log_path}: no training or held-out entries")
    names = ["target"] + [f"MTP {k}" for k in range(1, len(train[0]["depth_loss"]))]
    fig, (ax_loss, ax_agree) = plt.subplots(1, 2, figsize=(11, 4))
    for d, name in enumerate(names):
        line, = ax_loss.plot([e["step"] for e in train], [e["depth_loss"][d] for e in train],
                             alpha=0.35, linewidth=0.8)
        ax_loss.plot([e["step"] for e in held], [e["held_out_loss"][d] for e in held], marker="o",
                     markersize=3, color=line.get_color(), label=f"{name} (held-out)")
    ax_loss.set(xlabel="step", ylabel="cross-entropy (nats)", title="loss: train (faint) and held-out")
    ax_loss.set_yscale("log")
    ax_loss.legend()
    for d, name in enumerate(names[1:]):
        ax_agree.plot([e["step"] for e in held], [e["held_out_agreement"][d] for e in held], marker="o",
                      markersize=3, label=name)
    ax_agree.set(xlabel="step", ylabel="fraction", ylim=(0, 1),
                 title="held-out greedy draft agreement (teacher-forced)")
    ax_agree.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m triton_mtp.train.plot TRAIN_LOG_JSONL OUT_PNG")
    plot_losses(Path(sys.argv[1]), Path(sys.argv[2]))
