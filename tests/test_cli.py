"""The command line: zoo listing, profile output, argument errors."""

import subprocess
import sys

from fxplan.cli import format_table, main


def test_zoo_lists_every_network(capsys):
    import models_zoo

    assert main(["zoo"]) == 0
    out = capsys.readouterr().out
    for name in models_zoo.names():
        assert name in out


def test_profile_prints_nodes_and_breakdown(capsys):
    assert main(["profile", "vgg19", "--batch-size", "2", "--input-size", "64", "--quiet", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "46 compute nodes" in out
    assert "largest outputs" in out and "most expensive" in out
    for category in ("parameters", "activations", "gradients", "peak"):
        assert category in out


def test_unknown_model_is_a_clean_error(capsys):
    assert main(["profile", "no-such-net", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "no-such-net" in err and "resnet50" in err


def test_bad_batch_size_is_rejected(capsys):
    assert main(["profile", "vgg19", "--batch-size", "0"]) == 2
    assert "--batch-size must be positive" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "fxplan", "--help"], capture_output=True, text=True, check=True)
    assert "profile" in out.stdout


def test_format_table_aligns_numbers_right_and_text_left():
    text = format_table(("name", "n"), [("a", 1), ("bbb", 22)])
    assert text.splitlines() == ["name   n", "----  --", "a      1", "bbb   22"]
