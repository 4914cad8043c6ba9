"""PNG plots of training results (matplotlib, Agg backend)."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


# one colour family per mechanism family, so 13 mixers stay readable
FAMILY_COLORS = {
    "softmax": ["black"],
    "linear": ["0.55"],
    "mamba2": ["tab:brown"],
    "gdn": ["tab:olive"],
    "hla": ["#1f77b4", "#4a98d3", "#8cc0ea"],
    "loglinear": ["#2ca02c", "#7bd37b"],
    "kata": ["#d62728", "#ff7f0e", "#e377c2"],
    "deltakata": ["#9467bd"],
}
FAMILY_OF = {"hla2": "hla", "ahla": "hla", "hla3": "hla"}


def label_of(result):
    return result.get("label", result["mixer"])


def colors_for(results):
    """A colour per result: the mixer family's palette, in order of appearance."""
    used = {}
    out = []
    for r in results:
        name = r["mixer"]
        family = FAMILY_OF.get(name, name.split("-")[0])
        palette = FAMILY_COLORS.get(family, ["tab:gray"])
        out.append(palette[used.get(family, 0) % len(palette)])
        used[family] = used.get(family, 0) + 1
    return out


def plot_accuracy_vs_length(results, path):
    """Accuracy per eval slice, slices ordered by (length, pairs); shaded: beyond the training length."""
    slices = sorted({(e["length"], e["pairs"]) for r in results for e in r["eval"]})
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for r, color in zip(results, colors_for(results)):
        acc = {(e["length"], e["pairs"]): e["accuracy"] for e in r["eval"]}
        xs = [i for i, s in enumerate(slices) if s in acc]
        ax.plot(xs, [acc[slices[i]] for i in xs], marker="o", label=label_of(r), color=color)
    max_len = max(r["max_train_len"] for r in results)
    beyond = [i for i, (length, _) in enumerate(slices) if length > max_len]
    if beyond:
        ax.axvspan(beyond[0] - 0.5, len(slices) - 0.5, color="0.92", zorder=0, label="beyond training length")
    ax.set_xticks(range(len(slices)), [f"T={length}\n{pairs} pairs" for length, pairs in slices])
    ax.set_xlim(-0.5, len(slices) - 0.5)
    ax.set_ylabel("accuracy on queries")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_accuracy_vs_state(results, path, slices):
    """One panel per slice `(length, pairs)`: accuracy against decoding-state floats at that length."""
    fig, axes = plt.subplots(1, len(slices), figsize=(5 * len(slices), 4), squeeze=False)
    for ax, (length, pairs) in zip(axes[0], slices):
        for r, color in zip(results, colors_for(results)):
            acc = [e["accuracy"] for e in r["eval"] if e["length"] == length and e["pairs"] == pairs]
            if acc:
                state = r["state_floats"][str(length)]
                ax.scatter(state, acc[0], s=40, color=color)
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
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for r, color in zip(results, colors_for(results)):
        hist = r["train"]["history"]
        ax.plot([h["step"] for h in hist], [h["loss"] for h in hist], label=label_of(r), lw=1, color=color)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.set_yscale("log")
    save_with_legend(fig, ax, path)


def plot_loss_by_position(results, path):
    """Validation loss against position t (log axis; the log-linear paper's per-position analysis), one line
    per run and eval slice: the mean over positions t+1 in [2^i, 2^(i+1)) that have a scored token."""
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for r, color in zip(results, colors_for(results)):
        for e, style in zip(r["eval"], ["-", "--", ":", "-."] * len(r["eval"])):
            buckets = {}
            for t, loss in enumerate(e["loss_by_position"]):
                if loss is not None:
                    buckets.setdefault((t + 1).bit_length(), []).append(loss)
            xs = [2 ** (i - 1) for i in buckets]  # each bucket at its first position
            ax.plot(xs, [sum(v) / len(v) for v in buckets.values()], style, marker=".", lw=1, color=color,
                    label=f"{label_of(r)} T={e['length']}")
    ax.set_xscale("log")
    ax.set_xlabel("position t (tokens read; buckets [2^i, 2^(i+1)))")
    ax.set_ylabel("validation loss")
    save_with_legend(fig, ax, path)


def save_with_legend(fig, ax, path):
    """The legend right of the axes, then write the PNG."""
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
