"""benchmarks/e2e_peers/cold_prompts.py: a run's requests split into cold and warm prompts."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e_peers.cold_prompts import rows, split, warm_p99_ratios  # noqa: E402

COLUMNS = ["session", "turn", "prompt_tokens", "ideal_cached_tokens", "ttft_s", "status"]


def _run(config: str, round_index: int, warm_ttft: float) -> dict:
    reqs = [[f"s{i}", 0, 3000, 1024, 20.0 + i, "ok"] for i in range(3)]  # a burst of first turns
    reqs += [[f"s{i}", 5, 4000, 3900, warm_ttft * (1 + i / 100), "ok"] for i in range(97)]
    reqs += [["s9", 6, 14000, 384, 30.0, "ok"], ["s9", 7, 4000, 3900, None, "error"]]  # a new file; a failure
    return {"config": config, "round": round_index, "requests": {"columns": COLUMNS, "rows": reqs}}


def test_cold_prompts_are_those_mostly_new_and_the_tail_is_read_apart():
    s = split(_run("kv", 0, 1.0))
    assert (s["cold_n"], s["warm_n"]) == (4, 97)  # three first turns and a later turn with a new file
    assert s["slowest_cold_share"] == 1.0  # the 2 slowest of 101 are cold
    assert s["warm_p99"] < 2.0 < 20.0 < s["cold_p99"]
    assert split({"requests": {"columns": COLUMNS, "rows": []}}) is None


def test_warm_p99_ratios_pair_the_same_round():
    saved = [_run("kv", 0, 1.0), _run("lm", 0, 1.5), _run("kv", 1, 2.0), _run("lm", 1, 2.0), _run("lm", 2, 9.0)]
    usable = {("kv", 0), ("lm", 0), ("kv", 1), ("lm", 1), ("lm", 2)}
    ratios = warm_p99_ratios(saved, usable, "kv", "lm")
    assert len(ratios) == 2 and abs(ratios[0] - 1.5) < 1e-9 and abs(ratios[1] - 1.0) < 1e-9
    table = rows(saved, usable, {"kv": "kvpool", "lm": "LMCache"})
    assert [r[0] for r in table] == ["kvpool", "LMCache"] and table[0][1] == "4"
