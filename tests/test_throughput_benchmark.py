"""benchmarks/throughput.py keeps running: every side trains on the same micro-batches to the same loss."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


@pytest.mark.slow
def test_quick_benchmark_runs_every_side_to_the_same_loss(tmp_path):
    import throughput

    summary = throughput.main(["--quick", "--json", str(tmp_path / "out.json")])
    sides = summary["sides"]
    assert set(sides) == set(throughput.SIDES)
    reference = sides["hf_padded"]["losses"]
    for side in sides.values():
        assert side["losses"] == pytest.approx(reference, rel=1e-3)
        assert side["tokens_per_cpu_s"] > 0 and side["peak_bytes"] > 0
    assert sides["ours"]["vocab_peak_bytes"] < sides["hf_padded"]["vocab_peak_bytes"]
    assert (tmp_path / "out.json").is_file()
