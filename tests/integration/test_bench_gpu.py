"""bench/gpu.py's dry run (the command prepared for the GPU host) completes on the CPU and
writes every key; it never writes the results file; its @serve.batch peer batches."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import pytest

from bench import gpu


def test_dry_run_writes_every_key(tmp_path):
    out = tmp_path / "gpu.json"
    assert gpu.main(["--dry-run", "--models", "transformer", "--seconds", "0.05", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["complete"] is True and result["dry_run"] is True and result["environment"]["backend"] in ("torch-cpu", "cpu")
    for key in ("ours_c32_over_raw_cuda_batched", "added_p50_ms", "ours_over_serve_gpu"):
        assert np.isfinite(result["keys"][key]["transformer"])
    served = result["served"]["transformer"]
    assert served["ours"]["8"]["requests"] > 0 and served["serve_batch_peer"]["8"]["requests"] > 0
    assert [p["batch"] for p in result["raw"]["transformer"]["fp32"]["points"]] == list(gpu.DRY_BATCHES)
    cost = result["cost_model"]["transformer"]
    assert cost["reference_device"] == "h100" and cost["segments"] and cost["median_abs_error"] is not None
    assert result["memory"]["transformer"]["cold_load_to_first_answer_ms"] > 0
    assert os.path.exists(tmp_path / "gpu.png") or "matplotlib" not in str(result)
    # the reference checked against what the run measured, without a GPU
    check_out = tmp_path / "check.json"
    assert gpu.main(["--check-reference", str(out), "--out", str(check_out)]) == 0
    check = json.loads(check_out.read_text())
    rows = check["models"]["transformer"]
    assert [r["layers"] for r in rows] == [s["layers"] for s in cost["segments"]]
    assert all(np.isfinite(r["b32"]["error"]) for r in rows) and check["median_abs_error"]["b32"] is not None


def test_the_committed_gpu_run_checks_against_the_reference():
    """bench/results/gpu.json (measured on a GPU) against planner/devices.py's h100, as
    docs/benchmarks.md quotes it: each segment lines up with this graph and is predicted."""
    check = gpu.check_reference(json.loads(open(os.path.join(gpu.RESULTS, "gpu.json")).read()))
    assert set(check["models"]) == {"resnet50", "densenet121", "transformer"}
    assert all(np.isfinite(r["b32"]["predicted_ms"]) for rows in check["models"].values() for r in rows)
    assert check["median_abs_error"]["b32"] <= 0.15  # the target, at batch 32


def test_dry_run_refuses_the_results_file(capsys):
    assert gpu.main(["--dry-run", "--out", os.path.join(gpu.RESULTS, "gpu.json")]) == 2
    assert "never writes the results file" in capsys.readouterr().err


class _Doubler:
    def __init__(self) -> None:
        self.batches: list[int] = []

    def run_batch(self, requests):
        self.batches.append(len(requests))
        return [{"y": r["x"] * 2} for r in requests]


def test_serve_batch_peer_batches_and_answers_each_request():
    engine = _Doubler()

    async def main():
        peer = gpu.ServeBatchPeer(engine, max_batch_size=4, batch_wait_timeout_s=0.05)
        outs = await asyncio.gather(*(peer.submit({"x": np.full(1, i)}) for i in range(10)))
        await peer.close()
        return outs

    outs = asyncio.run(main())
    assert [int(o["y"][0]) for o in outs] == [2 * i for i in range(10)]
    assert max(engine.batches) == 4 and sum(engine.batches) == 10


@pytest.mark.parametrize("bad", ["nope"])
def test_unknown_model_is_refused(tmp_path, capsys, bad):
    assert gpu.main(["--dry-run", "--models", bad, "--out", str(tmp_path / "x.json")]) == 2
    assert f"--models {bad}: unknown" in capsys.readouterr().err
