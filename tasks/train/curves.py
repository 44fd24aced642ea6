"""The training-curves picture attached to every MLflow run: loss and top-1 per epoch."""

from __future__ import annotations

from pathlib import Path

from models.atomic import atomic_file
from tasks.train.loop import LOSS, TOP1, VAL_LOSS


def plot_curves(history: list[dict[str, float]], path: Path) -> Path:
    """Write a PNG of train/val loss and val top-1 by epoch to ``path`` (atomically)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and workers; must precede pyplot
    import matplotlib.pyplot as plt

    epochs = [int(h["epoch"]) for h in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    left.plot(epochs, [h[LOSS] for h in history], marker="o", label="train")
    left.plot(epochs, [h[VAL_LOSS] for h in history], marker="o", label="validation")
    left.set(title="Loss", xlabel="epoch", ylabel="cross-entropy")
    left.legend()
    right.plot(epochs, [h[TOP1] for h in history], marker="o", color="tab:green")
    right.set(title="Validation top-1 accuracy", xlabel="epoch", ylabel="top-1", ylim=(0, 1.02))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.set_xticks(epochs)
    with atomic_file(Path(path)) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    return Path(path)
