"""`benchmarks/ncu_stalls.py` on a small export of the shape Nsight Compute writes (two launches, each opened by a
"Kernel Name" line): the shares it prints are the counts' shares, and a wait is paired with the load before it."""

from test_gpu_benchmarks import load

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
          '"stall_long_sb","stall_barrier","stall_long_sb (Not Issued)"')


def _launch(rows):
    return ['"Kernel Name","k",', HEADER] + [",".join(f'"{x}"' for x in r) for r in rows]


def test_stall_shares_and_the_load_before_a_wait(tmp_path, capsys):
    first = [("0x0", "LDG.E.128 R4, desc[UR4][R2.64]", "10", "2,000", "0", "10", "5"),
             ("0x10", "@P0 FFMA R8, R4, R5, R8", "30", "1,000", "30", "0", "30"),
             ("0x20", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24", "0", "1,000", "0", "0", "0")]
    second = [("0x0", "LDL R1, [R1+0x10]", "4", "3", "1", "3", "0"),
              ("0x10", "ISETP.NE.U32.AND P0, PT, R1, R2, PT", "12", "1", "12", "0", "0")]
    path = tmp_path / "sass.csv"
    path.write_text("\n".join(_launch(first) + _launch(second)) + "\n")
    ncu_stalls = load("ncu_stalls")
    for rows, name in zip(ncu_stalls.launches(str(path)), ["one", "two"]):
        ncu_stalls.report(rows, name, top=1)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "== one: 0M warp instructions executed, 40 samples"
    assert out[1] == "  stall reasons: long_sb 75.0%, barrier 25.0%"
    assert out[2] == "  instructions:  LDG 50.0%, FFMA 25.0%, HGMMA 25.0%"
    assert out[4] == "  spill reloads (LDL): 0.0% of the instructions"
    assert "75.0% long_sb at @P0 FFMA" in out[5] and out[5].endswith("after LDG.E.128 R4, desc[UR4][R2.64]")
    assert out[6] == "== two: 0M warp instructions executed, 16 samples"
    assert out[10] == "  spill reloads (LDL): 75.0% of the instructions"
    assert "75.0% long_sb at ISETP" in out[11] and out[11].endswith("after LDL R1, [R1+0x10]")
