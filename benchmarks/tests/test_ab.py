"""benchmarks/ab.py: metrics found in a run's JSON, paired A with B per round, ratios B / A."""

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ab  # noqa: E402

KEYS = re.compile(ab.PERCENTILE_KEY)


def test_flatten_keys_every_number_by_its_path():
    doc = {"a": {"p50_us": 3, "ok": True, "rows": [{"max": 1.5}, {"name": "x"}]}, "n": 2}
    assert ab.flatten(doc) == {"a.p50_us": 3.0, "a.rows.0.max": 1.5, "n": 2.0}


def test_collect_keeps_percentiles_and_pairs_dated_names(tmp_path):
    run = tmp_path / "checksum"
    run.mkdir()
    (run / "2026-12-07-2cpu-epyc.json").write_text(json.dumps({"get": {"p50_us": 10, "p99_us": 30, "gbps": 2.0}}))
    assert ab.collect(tmp_path, KEYS) == {"checksum/RUN.json:get.p50_us": 10.0, "checksum/RUN.json:get.p99_us": 30.0}
    assert ab.collect(tmp_path, re.compile("gbps")) == {"checksum/RUN.json:get.gbps": 2.0}


def test_compare_reports_medians_and_per_round_ratios():
    runs = [ab.Run("A", 0, {"m:p50": 10.0}), ab.Run("B", 0, {"m:p50": 5.0}),
            ab.Run("A", 1, {"m:p50": 20.0}), ab.Run("B", 1, {"m:p50": 20.0, "only_b:p99": 1.0}),
            ab.Run("A", 2, {"m:p50": 10.0}), ab.Run("B", 2, {"m:p50": 8.0})]  # fmt: skip
    (row,) = ab.compare(runs)  # a metric missing from a run is not compared
    assert row["metric"] == "m:p50" and row["rounds"] == 3
    assert (row["a_median"], row["b_median"]) == (10.0, 8.0)
    assert (row["ratio_median"], row["ratio_min"], row["ratio_max"]) == (0.8, 0.5, 1.0)


def test_same_build_same_env_is_refused(capsys):
    with pytest.raises(SystemExit):
        ab.main(["--builds", "HEAD", "HEAD", "--", "checksum"])
    assert "same build" in capsys.readouterr().err


def test_benchmark_after_double_dash_is_required(capsys):
    with pytest.raises(SystemExit):
        ab.main(["--builds", "HEAD", "WORKTREE"])
    assert "after `--`" in capsys.readouterr().err


def test_env_pairs_are_parsed_and_checked():
    assert ab.parse_env(["A=1", "B=x=y"], "--env") == {"A": "1", "B": "x=y"}
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        ab.parse_env(["oops"], "--env")
