"""PNG plots of training results (matplotlib, Agg backend)."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def label_of(result):
    return result.get("label", result["mixer"])


def plot_accuracy_vs_length(results, path):
    """Accuracy per eval slice against sequence length; the shaded band is beyond the training length."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        rows = sorted(r["eval"], key=lambda e: (e["length"], e["pairs"]))
        ax.plot([e["length"] for e in rows], [e["accuracy"] for e in rows], marker="o", label=label_of(r))
    max_len = max(r["max_train_len"] for r in results)
    ax.axvspan(max_len, ax.get_xlim()[1], color="0.9", zorder=0, label="extrapolation")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("accuracy on queries")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_accuracy_vs_state(results, path, slices):
    """One panel per slice `(length, pairs)`: accuracy against decoding-state floats at that length."""
    fig, axes = plt.subplots(1, len(slices), figsize=(5 * len(slices), 4), squeeze=False)
    for ax, (length, pairs) in zip(axes[0], slices):
        for r in results:
            acc = [e["accuracy"] for e in r["eval"] if e["length"] == length and e["pairs"] == pairs]
            if acc:
                state = r["state_floats"][str(length)]
                ax.scatter(state, acc[0], s=40)
                ax.annotate(label_of(r), (state, acc[0]), fontsize=7, xytext=(4, 2), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel(f"decoding state (floats per sequence, T={length})")
        ax.set_ylabel("accuracy on queries")
        ax.set_title(f"T={length}, {pairs} pairs")
        ax.set_ylim(-0.02, 1.02)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_training_curve(results, path):
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        hist = r["train"]["history"]
        ax.plot([h["step"] for h in hist], [h["loss"] for h in hist], label=label_of(r), lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
