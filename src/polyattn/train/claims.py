"""Published claims checked against a sweep: each claim names the best-LR cells it reads and how it holds.

A claim (one entry of an evidence config's ``"claims"``, `benchmarks/evidence/`)::

    {"claim": "log-linear Mamba-2 ahead of Mamba-2 at width 64, length 256",
     "source": "Log-Linear Attention (Guo et al., 2025), MQAR",
     "source_value": {"loglinear-mamba2": 0.844, "mamba2": 0.790},
     "ours": {"loglinear-mamba2": {"mixer": "loglinear-mamba2", "width": 64, "slice": [256, 64]},
              "mamba2": {"mixer": "mamba2", "width": 64, "slice": [256, 64]}},
     "holds": {"ahead_of": "mamba2"}}

``ours`` is one cell ``{"mixer", "width", "slice": [length, pairs]}`` or named cells; each reads the
accuracy on that test slice of the mixer's best-LR run at that width. ``holds``: ``null`` (reported, not
judged), ``{"at_least": x}`` (every cell's accuracy >= x) or ``{"ahead_of": NAME}`` (every other named
cell strictly above cell NAME). ``source_value``: a number, ``null`` or a number (or ``null``) per name.
"""

import math

CLAIM_KEYS = {"claim", "source", "source_value", "ours", "holds"}
CELL_KEYS = {"mixer", "width", "slice"}
RULES = ("at_least", "ahead_of")


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def named_cells(ours):
    """``ours`` as ``{name: cell}``: a single cell is named by its mixer."""
    return {ours["mixer"]: ours} if isinstance(ours, dict) and "mixer" in ours else ours


def check_cell(where, cell, mixers, widths, slices):
    if not isinstance(cell, dict) or set(cell) != CELL_KEYS:
        raise ValueError(f"{where}: expected a cell {{\"mixer\", \"width\", \"slice\": [length, pairs]}}, got {cell!r}")
    if cell["mixer"] not in mixers:
        raise ValueError(f"{where}: mixer {cell['mixer']!r} is not in the sweep's mixers {list(mixers)}")
    if cell["width"] not in widths or isinstance(cell["width"], bool):
        raise ValueError(f"{where}: width {cell['width']!r} is not in the sweep's widths {list(widths)}")
    shape_ok = isinstance(cell["slice"], list) and len(cell["slice"]) == 2 and all(isinstance(x, int) for x in cell["slice"])
    if not shape_ok or tuple(cell["slice"]) not in slices:
        raise ValueError(f"{where}: slice {cell['slice']!r} is not a test slice [length, pairs] of {[list(s) for s in slices]}")


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
    if not isinstance(rule, dict) or len(rule) != 1 or next(iter(rule)) not in RULES:
        raise ValueError(f"{where}: expected null, {{\"at_least\": NUMBER}} or {{\"ahead_of\": NAME}}, got {rule!r}")
    if "at_least" in rule and not is_number(rule["at_least"]):
        raise ValueError(f"{where}: at_least expects a number, got {rule['at_least']!r}")
    if "ahead_of" in rule and (rule["ahead_of"] not in cells or len(cells) < 2):
        raise ValueError(f"{where}: ahead_of expects one of two or more named cells {sorted(cells)}, got {rule['ahead_of']!r}")


def holds_if(rule, cells):
    """The rule in words: ``"ours >= 0.99"``, ``"kata-m2 > gdn and deltakata-m1 > gdn"``; None when not judged."""
    if rule is None:
        return None
    if "at_least" in rule:
        return " and ".join(f"{name} >= {rule['at_least']:g}" for name in cells) if len(cells) > 1 else f"ours >= {rule['at_least']:g}"
    base = rule["ahead_of"]
    return " and ".join(f"{name} > {base}" for name in cells if name != base)


def judge(rule, ours):
    """Whether measured ``ours`` (``{name: accuracy}``) satisfies the rule; None for a null rule."""
    if rule is None:
        return None
    if "at_least" in rule:
        return all(v >= rule["at_least"] for v in ours.values())
    base = ours[rule["ahead_of"]]
    return all(v > base for name, v in ours.items() if name != rule["ahead_of"])


def accuracy_table(best):
    """``{(mixer, width, length, pairs): accuracy}`` from a sweep's best-LR runs."""
    return {(r["mixer"], r["config"]["d_model"], e["length"], e["pairs"]): e["accuracy"] for r in best for e in r["eval"]}


def claim_rows(claims, best, command):
    """One row per (checked) claim: ``{claim, source, source_value, ours, holds_if, holds, command}``, ``ours``
    measured from ``best`` (a number for a single cell, else ``{name: accuracy}``)."""
    accuracy = accuracy_table(best)
    rows = []
    for claim in claims:
        cells = named_cells(claim["ours"])
        ours = {name: accuracy[(c["mixer"], c["width"], *c["slice"])] for name, c in cells.items()}
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
        return ", ".join(f"{name} {format_value(v)}" for name, v in value.items())
    return f"{value:.3f}"


def claims_markdown(rows, description, table):
    """``claims.md``: the description, a claims table (claim, source, source value, ours, holds) and the
    sweep table (accuracy per slice and train tokens/s of each best-LR cell) in a code block."""
    verdict = {True: "yes", False: "**no**", None: "–"}
    lines = [description, "", "| claim | source | source value | ours | holds if | holds |", "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["claim"], r["source"], format_value(r["source_value"]), format_value(r["ours"]), r["holds_if"] or "–", verdict[r["holds"]]]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", f"Command: `{rows[0]['command']}`", "", "Best-LR cells:", "", "```", table, "```", ""]
    return "\n".join(lines)
