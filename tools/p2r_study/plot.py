"""The study's plot: each arm's held-out loss minus real from scratch's of the same seed, against
steps, one panel per family of arms (Pseudo-to-Real; growth with its compute-matched controls)
and one row per model. Paired differences, not absolute losses: the seed-to-seed spread of the
absolute loss is larger than the differences the study is about."""

from __future__ import annotations

import os
from typing import Dict, List

from tools.p2r_study.analysis import band, difference_curve
from tools.p2r_study.arms import SCRATCH, is_control

FAMILIES = ("Pseudo-to-Real", "growth and its compute-matched controls")
CAPTION = (
    "*Each line: an arm's held-out loss minus real from scratch's with the same seed, mean over seeds, band "
    "± std over seeds; below 0 is better. The upward jump at each growth is the stacked model evaluated right "
    "after the conversion, before any step: every copied block adds its update to the residual stream a second "
    "time, so the grown model computes another function until training adapts it.*"
)


def family(arm: str) -> str:
    return FAMILIES[1] if arm.startswith("grow") or is_control(arm) else FAMILIES[0]


def plot(records: List[dict], models: List[str], order: Dict[str, List[str]], path: str) -> None:
    """The figure at ``path`` (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [f for f in FAMILIES if any(family(a) == f for m in models for a in order[m] if a != SCRATCH)]
    columns = columns or [FAMILIES[0]]
    fig, axes = plt.subplots(len(models), len(columns), figsize=(7 * len(columns), 4.6 * len(models)), squeeze=False)
    for row, model in enumerate(models):
        scratch = {r["seed"]: r for r in records if r["model"] == model and r["arm"] == SCRATCH}
        for col, name in enumerate(columns):
            ax = axes[row][col]
            for arm in [a for a in order[model] if a != SCRATCH and family(a) == name]:
                runs = [r for r in records if r["model"] == model and r["arm"] == arm and r["seed"] in scratch]
                steps, mean, std = band([difference_curve(r, scratch[r["seed"]]) for r in runs], arm)
                (line,) = ax.plot(steps, mean, label=f"{arm} ({len(runs)} seeds)", lw=1.2)
                ax.fill_between(
                    steps,
                    [m - s for m, s in zip(mean, std, strict=True)],
                    [m + s for m, s in zip(mean, std, strict=True)],
                    color=line.get_color(),
                    alpha=0.2,
                    lw=0,
                )
            ax.axhline(0.0, color="black", lw=0.8, ls="--", label="real from scratch")
            ax.set_title(f"{model}: {name}", fontsize=9)
            ax.set_xlabel("steps")
            ax.set_ylabel("held-out loss − real from scratch's")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=60)
    plt.close(fig)
    from PIL import Image  # matplotlib's own dependency: a 128-colour palette keeps the committed PNG small

    Image.open(tmp).convert("RGB").quantize(colors=128).save(tmp, optimize=True)
    os.replace(tmp, path)
