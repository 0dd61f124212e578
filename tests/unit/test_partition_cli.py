"""`splitinfer inspect` and `splitinfer split`, run through the real entry point."""

from __future__ import annotations

import json

import onnx
import pytest

from splitinfer.cli import main
from tests.onnx_models import conv_bn_relu_chain, residual_block, write


def test_inspect_json_has_the_documented_fields(tmp_path, capsys) -> None:
    path = write(residual_block(), tmp_path / "res.onnx")
    assert main(["inspect", path, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "res"
    assert [t["name"] for t in out["inputs"]] == ["x"]
    assert [t["name"] for t in out["outputs"]] == ["y"]
    layer = out["layers"][0]
    assert set(layer) >= {"id", "name", "nodes", "ops", "flops", "param_bytes", "inputs", "outputs"}
    assert isinstance(layer["id"], int)
    tensor = next(t for t in out["tensors"] if t["name"] == "x")
    assert set(tensor) >= {"name", "dtype", "shape", "bytes_per_sample", "producer", "consumers"}
    assert tensor["producer"] is None and tensor["consumers"] == [0, 1]
    assert out["chain_points"] == [1]


def test_inspect_table_for_a_zoo_name(capsys) -> None:
    assert main(["inspect", "squeezenet"]) == 0
    out = capsys.readouterr().out
    assert "Conv+Relu" in out and "chain cut points" in out


def test_split_writes_head_tail_and_json(tmp_path, capsys) -> None:
    path = write(conv_bn_relu_chain(3), tmp_path / "chain.onnx")
    out_dir = tmp_path / "out"
    assert main(["split", path, "--after", "1", "-o", str(out_dir), "--verify"]) == 0
    info = json.loads((out_dir / "split.json").read_text())
    assert info["edge_layers"] == [0, 1]
    assert info["boundary"] == ["r1"]
    assert info["head_inputs"] == ["x"] and info["head_outputs"] == ["r1"]
    assert info["tail_inputs"] == ["r1"] and info["tail_outputs"] == ["y"]
    head = onnx.load(str(out_dir / "head.onnx"))
    tail = onnx.load(str(out_dir / "tail.onnx"))
    assert [i.name for i in tail.graph.input] == ["r1"]
    assert [o.name for o in head.graph.output] == ["r1"]
    assert "verified" in capsys.readouterr().out


def test_split_edge_layers_with_range(tmp_path) -> None:
    path = write(conv_bn_relu_chain(3), tmp_path / "chain.onnx")
    assert main(["split", path, "--edge-layers", "0-2", "-o", str(tmp_path / "o")]) == 0
    assert json.loads((tmp_path / "o" / "split.json").read_text())["edge_layers"] == [0, 1, 2]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--edge-layers", "1"], "layer 1 (conv_b) is on the device but its producer layer 0 (conv_a) is not"),
        (["--edge-layers", "0,9"], "--edge-layers '0,9': unknown layer 9: res has layers 0..1; give ids in 0..1"),
        (["--edge-layers", "a,b"], "--edge-layers 'a,b': 'a' is not a layer id or a range"),
        (["--after", "5"], "--after 5 is not a layer of res: give a layer in 0..1"),
        (["--after", "-1"], "--after -1 is not a layer of res"),
    ],
)
def test_invalid_cuts_get_one_clear_line(tmp_path, capsys, args, message) -> None:
    path = write(residual_block(), tmp_path / "res.onnx")
    assert main(["split", path, *args, "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "value, message",
    [
        ("5-3", "--edge-layers '5-3': the range 5-3 is reversed; write 3-5"),
        ("2-1", "the range 2-1 is reversed; write 1-2"),
        ("", "--edge-layers '': names no layer"),
        (" , ", "names no layer"),
        ("0-2,1-3", "--edge-layers '0-2,1-3': layer 1 is given twice; list each layer once"),
        ("0,0", "layer 0 is given twice"),
        ("0-9", "--edge-layers '0-9': unknown layer 9: chain has layers 0..4"),
        ("0-x", "'0-x' is not a layer id or a range; write e.g. 0,1,2 or 0-12"),
        ("-1", "'-1' is not a layer id or a range"),
    ],
)
def test_split_refuses_reversed_edge_layer_range(tmp_path, capsys, value, message) -> None:
    """Reversed, empty, overlapping and out-of-range --edge-layers: one line, exit 2, no files."""
    path = write(conv_bn_relu_chain(3), tmp_path / "chain.onnx")
    out_dir = tmp_path / "o"
    assert main(["split", path, "--edge-layers", value, "-o", str(out_dir)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out_dir.exists()


def test_bad_files_get_one_clear_line(tmp_path, capsys) -> None:
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x08\x07 definitely not protobuf \xff\xfe")
    assert main(["inspect", str(garbage)]) == 2
    err = capsys.readouterr().err
    assert "not a readable ONNX model" in err and "Traceback" not in err
    assert main(["inspect", "no-such-zoo-model"]) == 2
    assert "unknown zoo model" in capsys.readouterr().err


def test_unknown_command_suggests(capsys) -> None:
    assert main(["inpsect"]) == 2
    assert "did you mean 'inspect'" in capsys.readouterr().err
    assert main([]) == 0
    assert "commands:" in capsys.readouterr().out
