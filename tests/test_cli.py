import subprocess
import sys

from polyattn.cli import main


def test_info_lists_ops(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "polyattn 0.1.0" in out
    assert "linear_attn" in out and "chunk" in out and "delta_rule" in out


def test_python_dash_m_entry_point():
    done = subprocess.run([sys.executable, "-m", "polyattn", "info"], capture_output=True, text=True, check=True)
    assert "torch" in done.stdout
