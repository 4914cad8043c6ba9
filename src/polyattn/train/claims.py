"""Published claims checked against a sweep: each claim names the best-LR cells it reads and how it holds.

A claim (one entry of an evidence config's ``"claims"``, `benchmarks/evidence/`)::

    {"claim": "log-linear Mamba-2 ahead of Mamba-2 at width 64, length 256",
     "source": "Log-Linear Attention (Guo et al., 2025), MQAR",
     "source_value": {"loglinear-mamba2": 0.929, "mamba2": 0.896},
     "ours": {"loglinear-mamba2": {"mixer": "loglinear-mamba2", "width": 64, "slice": [256, 64]},
              "mamba2": {"mixer": "mamba2", "width": 64, "slice": [256, 64]}},
     "holds": {"ahead_of": "mamba2"}}

``ours`` is one cell ``{"mixer", "width", "slice": [length, pairs]}`` or named cells; each reads its
``"metric"`` on that test slice of the mixer's best-LR run at that width: ``"accuracy"`` (the default),
``"loss"`` (the slice's mean loss) or ``"loss_by_position"``, the mean loss in each position bucket
``[a, b)`` of ``"buckets"``, bucket edges (default `log2_edges`: ``[0, 1), [1, 2), [2, 4), ...``; position t
scores the prediction of token t + 1 from tokens 0..t; a bucket with no scored position is ``null``). The
cells of a claim read one metric (and the same buckets). ``holds``: ``null`` (reported, not judged),
``{"at_least": x}`` (every cell's accuracy >= x), ``{"ahead_of": NAME}`` (every other named cell's accuracy
strictly above cell NAME's) or ``{"below": NAME}`` (every other named cell's loss strictly below cell NAME's,
bucket by bucket for ``loss_by_position``). ``source_value``: a number, ``null`` or a number (or ``null``) per name.
"""

import math

CLAIM_KEYS = {"claim", "source", "source_value", "ours", "holds"}
CELL_KEYS = {"mixer", "width", "slice"}
OPTIONAL_CELL_KEYS = {"metric", "buckets"}
METRICS = ("accuracy", "loss", "loss_by_position")
RULE_METRICS = {"at_least": ("accuracy",), "ahead_of": ("accuracy",), "below": ("loss", "loss_by_position")}


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def named_cells(ours):
    """``ours`` as ``{name: cell}``: a single cell is named by its mixer."""
    return {ours["mixer"]: ours} if isinstance(ours, dict) and "mixer" in ours else ours


def log2_edges(length):
    """Position bucket edges ``[0, 1, 2, 4, ..., length]``: buckets [0, 1), [1, 2), [2, 4), ..., the last cut at `length`."""
    edges = [0, 1]
    while edges[-1] * 2 < length:
        edges.append(edges[-1] * 2)
    return edges + [length] if edges[-1] < length else edges


def cell_metric(cell):
    return cell.get("metric", "accuracy")


def cell_edges(cell):
    """A ``loss_by_position`` cell's bucket edges (None for other metrics)."""
    if cell_metric(cell) != "loss_by_position":
        return None
    return cell.get("buckets") or log2_edges(cell["slice"][0])


def check_cell(where, cell, mixers, widths, slices):
    if not isinstance(cell, dict) or not CELL_KEYS <= set(cell) <= CELL_KEYS | OPTIONAL_CELL_KEYS:
        raise ValueError(f"{where}: expected a cell {{\"mixer\", \"width\", \"slice\": [length, pairs]}} (and \"metric\", "
                         f"\"buckets\"), got {cell!r}")
    if cell["mixer"] not in mixers:
        raise ValueError(f"{where}: mixer {cell['mixer']!r} is not in the sweep's mixers {list(mixers)}")
    if cell["width"] not in widths or isinstance(cell["width"], bool):
        raise ValueError(f"{where}: width {cell['width']!r} is not in the sweep's widths {list(widths)}")
    shape_ok = isinstance(cell["slice"], list) and len(cell["slice"]) == 2 and all(isinstance(x, int) for x in cell["slice"])
    if not shape_ok or tuple(cell["slice"]) not in slices:
        raise ValueError(f"{where}: slice {cell['slice']!r} is not a test slice [length, pairs] of {[list(s) for s in slices]}")
    if cell_metric(cell) not in METRICS:
        raise ValueError(f"{where}: metric: expected one of {list(METRICS)}, got {cell['metric']!r}")
    if "buckets" in cell:
        edges, length = cell["buckets"], cell["slice"][0]
        if cell_metric(cell) != "loss_by_position":
            raise ValueError(f"{where}: buckets: only a \"loss_by_position\" cell has buckets, this one reads {cell_metric(cell)!r}")
        ints = isinstance(edges, list) and len(edges) >= 2 and all(isinstance(e, int) and not isinstance(e, bool) for e in edges)
        if not ints or edges[0] < 0 or edges[-1] > length or any(a >= b for a, b in zip(edges, edges[1:])):
            raise ValueError(f"{where}: buckets: expected two or more increasing integer edges in [0, {length}] "
                             f"(the slice's length), got {edges!r}")


def check_claims(claims, mixers, widths, slices):
    """ValueError (naming the claim and what is wrong) unless every claim reads cells of this sweep:
    ``mixers`` and ``widths`` swept, ``slices`` the test grid's ``(length, pairs)``."""
    if not isinstance(claims, list) or not claims:
        raise ValueError(f"claims: expected a non-empty list of claims, got {claims!r}")
    slices = set(map(tuple, slices))
    for i, claim in enumerate(claims):
        where = f"claims[{i}]"
        if not isinstance(claim, dict) or set(claim) != CLAIM_KEYS:
            got = sorted(claim) if isinstance(claim, dict) else claim
            raise ValueError(f"{where}: expected the keys {sorted(CLAIM_KEYS)}, got {got!r}")
        for key in ("claim", "source"):
            if not isinstance(claim[key], str) or not claim[key]:
                raise ValueError(f"{where}.{key}: expected a non-empty string, got {claim[key]!r}")
        cells = named_cells(claim["ours"])
        if not isinstance(cells, dict) or not cells:
            raise ValueError(f"{where}.ours: expected a cell or a non-empty object of named cells, got {claim['ours']!r}")
        for name, cell in cells.items():
            check_cell(f"{where}.ours[{name!r}]", cell, mixers, widths, slices)
        if len({(cell_metric(c), str(cell_edges(c))) for c in cells.values()}) > 1:
            raise ValueError(f"{where}.ours: expected every cell to read one metric (and the same buckets), got "
                             f"{ {name: cell_metric(c) for name, c in cells.items()} }")
        source = claim["source_value"]
        values = source.values() if isinstance(source, dict) else [source]
        if isinstance(source, dict) and not set(source) <= set(cells):
            raise ValueError(f"{where}.source_value: names {sorted(set(source) - set(cells))} are not cells of ours {sorted(cells)}")
        if any(v is not None and not is_number(v) for v in values):
            raise ValueError(f"{where}.source_value: expected a number, null or an object of them, got {source!r}")
        check_rule(f"{where}.holds", claim["holds"], cells)


def check_rule(where, rule, cells):
    if rule is None:
        return
    if not isinstance(rule, dict) or len(rule) != 1 or next(iter(rule)) not in RULE_METRICS:
        raise ValueError(f"{where}: expected null, {{\"at_least\": NUMBER}}, {{\"ahead_of\": NAME}} or {{\"below\": NAME}}, got {rule!r}")
    (kind, value), = rule.items()
    if kind == "at_least" and not is_number(value):
        raise ValueError(f"{where}: at_least expects a number, got {value!r}")
    if kind != "at_least" and (value not in cells or len(cells) < 2):
        raise ValueError(f"{where}: {kind} expects one of two or more named cells {sorted(cells)}, got {value!r}")
    metric = cell_metric(next(iter(cells.values())))
    if metric not in RULE_METRICS[kind]:
        raise ValueError(f"{where}: {kind} judges cells of metric {' or '.join(RULE_METRICS[kind])}, these read {metric!r}")


def holds_if(rule, cells):
    """The rule in words: ``"ours >= 0.99"``, ``"kata-m2 > gdn and deltakata-m1 > gdn"``, ``"loglinear-gdn < gdn
    in every bucket"``; None when not judged."""
    if rule is None:
        return None
    if "at_least" in rule:
        return " and ".join(f"{name} >= {rule['at_least']:g}" for name in cells) if len(cells) > 1 else f"ours >= {rule['at_least']:g}"
    (kind, base), = rule.items()
    words = " and ".join(f"{name} {'>' if kind == 'ahead_of' else '<'} {base}" for name in cells if name != base)
    return words + (" in every bucket" if cell_metric(cells[base]) == "loss_by_position" else "")


def below(value, base):
    """Whether a loss (or every bucket's loss, ``{bucket: loss}``) is strictly below the base's; a null bucket is not."""
    if isinstance(base, dict):
        return all(below(value[bucket], b) for bucket, b in base.items())
    return value is not None and base is not None and value < base


def judge(rule, ours):
    """Whether measured ``ours`` (``{name: value}``) satisfies the rule; None for a null rule."""
    if rule is None:
        return None
    if "at_least" in rule:
        return all(v >= rule["at_least"] for v in ours.values())
    (kind, name), = rule.items()
    others = [v for n, v in ours.items() if n != name]
    if kind == "below":
        return all(below(v, ours[name]) for v in others)
    return all(v > ours[name] for v in others)


def bucket_means(by_position, edges):
    """``{"[a,b)": mean}``: the mean of the per-position losses ``by_position[a:b]`` that are not None (None if none is)."""
    buckets = {}
    for a, b in zip(edges, edges[1:]):
        scored = [x for x in by_position[a:b] if x is not None]
        buckets[f"[{a},{b})"] = sum(scored) / len(scored) if scored else None
    return buckets


def measure(cell, row):
    """A cell's metric read from its eval row (`polyattn.train.loop.evaluate`)."""
    if cell_metric(cell) == "loss_by_position":
        return bucket_means(row["loss_by_position"], cell_edges(cell))
    return row[cell_metric(cell)]


def eval_table(best):
    """``{(mixer, width, length, pairs): eval row}`` from a sweep's best-LR runs."""
    return {(r["mixer"], r["config"]["d_model"], e["length"], e["pairs"]): e for r in best for e in r["eval"]}


def claim_rows(claims, best, command):
    """One row per (checked) claim: ``{claim, source, source_value, ours, holds_if, holds, command}``, ``ours``
    measured from ``best`` (a value for a single cell, else ``{name: value}``; a value is a number, or
    ``{bucket: loss}`` for ``loss_by_position``)."""
    rows_of = eval_table(best)
    rows = []
    for claim in claims:
        cells = named_cells(claim["ours"])
        ours = {name: measure(c, rows_of[(c["mixer"], c["width"], *c["slice"])]) for name, c in cells.items()}
        single = "mixer" in claim["ours"]
        rows.append({
            "claim": claim["claim"],
            "source": claim["source"],
            "source_value": claim["source_value"],
            "ours": next(iter(ours.values())) if single else ours,
            "holds_if": holds_if(claim["holds"], cells),
            "holds": judge(claim["holds"], ours),
            "command": command,
        })
    return rows


def format_value(value):
    if value is None:
        return "–"
    if isinstance(value, dict):
        return ", ".join(f"{name} ({format_value(v)})" if isinstance(v, dict) else f"{name} {format_value(v)}" for name, v in value.items())
    return f"{value:.3f}"


def claims_markdown(rows, description, table):
    """``claims.md``: the description, a claims table (claim, source, source value, ours, holds) and the
    sweep table (accuracy per slice, loss per slice for a sweep scored by loss, and train tokens/s of each
    best-LR cell) in a code block."""
    verdict = {True: "yes", False: "**no**", None: "–"}
    lines = [description, "", "| claim | source | source value | ours | holds if | holds |", "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["claim"], r["source"], format_value(r["source_value"]), format_value(r["ours"]), r["holds_if"] or "–", verdict[r["holds"]]]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", f"Command: `{rows[0]['command']}`", "", "Best-LR cells:", "", "```", table, "```", ""]
    return "\n".join(lines)
