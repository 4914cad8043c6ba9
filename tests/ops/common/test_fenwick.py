"""Structure of the Fenwick level partition (ops/loglinear/README.md, "Levels"): exact integer facts, no tolerances."""

import pytest
import torch

from polyattn.ops.common import fenwick, level, level_matrix, level_table, num_levels

QUERIES = list(range(0, 130)) + [255, 256, 257, 1023, 1024, 4097]


def _groups(t):
    """Keys ``0..t`` of query ``t`` grouped by level."""
    groups = {}
    for s in range(t + 1):
        groups.setdefault(level(t, s), []).append(s)
    return groups


@pytest.mark.parametrize("t", QUERIES, ids=lambda t: f"t{t}")
def test_each_prefix_is_partitioned_into_fenwick_buckets(t):
    groups = _groups(t)
    assert sorted(s for keys in groups.values() for s in keys) == list(range(t + 1))
    assert groups[0] == [t]
    assert len(groups) == bin(t).count("1") + 1  # popcount(t) + 1 non-empty levels
    assert max(groups) < num_levels(t + 1)
    for lev in range(1, num_levels(t + 1)):
        size = 2 ** (lev - 1)
        if (t >> (lev - 1)) & 1:  # non-empty iff bit lev - 1 of t is set
            hi = t - t % size
            assert groups[lev] == list(range(hi - size, hi)), f"level {lev}"  # 2^(lev-1) consecutive keys
        else:
            assert lev not in groups


@pytest.mark.parametrize("t", QUERIES[1:], ids=lambda t: f"t{t}")
def test_groups_of_the_previous_query_are_nested(t):
    # Every level group of query t - 1 lies whole in one level of query t: states merge, never split.
    # Key t - 1 itself goes to level(t, t - 1) = ctz(t) + 1, the carry target of the decoding step.
    groups = _groups(t - 1)
    carry_target = (t & -t).bit_length()
    for lev, keys in groups.items():
        new = {level(t, s) for s in keys}
        assert new == {max(lev, carry_target)}, f"group {lev} of query {t - 1}"


def test_num_levels_from_integer_bits():
    expected = {0: 1, 1: 1, 2: 2, 3: 3, 4: 3, 5: 4, 64: 7, 65: 8, 2048: 12, 16384: 15, 2**20 + 1: 22}
    assert {T: num_levels(T) for T in expected} == expected
    for e in (29, 31, 40, 62):  # where ceil(log2(2^e)) in floating point goes wrong upstream
        assert num_levels(2**e) == e + 1
        assert num_levels(2**e + 1) == e + 2
    for T in range(1, 70):  # exactly enough levels for every pair of a length-T sequence
        assert num_levels(T) == 1 + max(level(t, s) for t in range(T) for s in range(t + 1))


def test_levels_at_large_positions():
    t = 2**40 + 5
    assert level(t, t) == 0
    assert level(t, t - 1) == 1
    assert level(t, 2**40 - 1) == 41
    m = level_matrix(4, offset=2**31 - 2)
    assert m.tolist() == [[0, -1, -1, -1], [1, 0, -1, -1], [32, 32, 0, -1], [32, 32, 1, 0]]


@pytest.mark.parametrize("T, offset", [(1, 0), (17, 0), (33, 5), (40, 1000)], ids=lambda x: str(x))
def test_level_matrix_equals_scalar_definition(T, offset):
    m = level_matrix(T, offset=offset)
    assert m.dtype == torch.int64 and m.shape == (T, T)
    expected = [[level(offset + t, offset + s) if s <= t else -1 for s in range(T)] for t in range(T)]
    assert m.tolist() == expected


@pytest.mark.parametrize("C", [1, 2, 4, 8, 64])
def test_level_table_equals_scalar_definition_and_factorises(C):
    lut = level_table(C)
    assert lut.tolist() == [[level(i, j) if j <= i else -1 for j in range(C)] for i in range(C)]
    c = C.bit_length() - 1
    for tc, sc in [(0, 0), (3, 3), (5, 4), (6, 1), (9, 0)]:
        if sc > tc:
            continue
        for ti in range(C):
            for si in range(C):
                if tc == sc and si > ti:
                    continue
                got = level(tc * C + ti, sc * C + si)
                want = lut[ti, si].item() if tc == sc else c + (tc ^ sc).bit_length()
                assert got == want


def test_level_table_rejects_non_powers_of_two():
    with pytest.raises(ValueError, match="power-of-two"):
        level_table(6)


def test_level_rejects_a_key_after_the_query():
    with pytest.raises(ValueError, match="0 <= s <= t"):
        level(3, 4)


def test_module_prints_the_grid(capsys):
    assert fenwick.main(["16"]) == 0  # what ``python -m polyattn.ops.common.fenwick 16`` runs
    rows = capsys.readouterr().out.strip().splitlines()
    assert "num_levels = 5" in rows[0]
    assert rows[-1].split() == ["15", "(1111)", "4", "4", "4", "4", "4", "4", "4", "4", "3", "3", "3", "3", "2", "2", "1", "0"]
