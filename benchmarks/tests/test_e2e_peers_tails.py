"""benchmarks/e2e_peers/tails.py: one run's routes out of an appended router log, and surprises."""

import sys
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e_peers.tails import joined, parse_router_log, run_tails  # noqa: E402


def _line(at: str, session: str, prompt: int, local: int, pool: int, backend: str = "http://127.0.0.1:1") -> str:
    return (f'{at},000 127.0.0.1 "POST /v1/completions" 200 session={session}(header) backend={backend} '
            f"reason=local attempts=1 prompt={prompt} local={local} pool={pool} ttft_s=1.000 total_s=2.000 bytes=9")


def test_only_the_runs_own_lines_are_read_and_a_recomputed_expected_hit_is_a_surprise(tmp_path):
    log = tmp_path / "router.log"
    log.write_text("\n".join([
        _line("2026-12-02 10:00:00", "s1", 5000, 0, 4096),  # an earlier run in the same workdir
        _line("2026-12-02 11:00:00", "s1", 5000, 4096, 4096),
        '2026-12-02 11:00:01,000 127.0.0.1 "GET /v1/models" 200 session=x(hash) backend=b reason=any attempts=1 '
        "prompt=0 local=0 pool=0 ttft_s=- total_s=0.001 bytes=10",
        _line("2026-12-02 11:00:02", "s2", 3000, 0, 0) + " est=http://127.0.0.1:1:2.50/0.40,http://127.0.0.1:2:9.10/8.00",
        _line("2026-12-02 12:00:00", "s1", 5000, 0, 0),  # a later run
    ]) + "\n")
    start = datetime(2026, 12, 2, 11, 0, 0).timestamp()
    routes = parse_router_log(log, start, start + 60)
    assert [r[0] for r in routes["rows"]] == ["s1", "s2"]
    assert [r[-1] for r in routes["rows"]] == ["", "http://127.0.0.1:1:2.50/0.40,http://127.0.0.1:2:9.10/8.00"]
    run = {"routes": routes, "requests": {
        "columns": ["session", "turn", "prompt_tokens", "cached_tokens", "ttft_s"],
        "rows": [["s1", 3, 5000, 1536, 40.0], ["s2", 0, 3000, 0, 2.0], ["s3", 0, 100, 0, 1.0]]}}
    by_session = {r["session"]: r for r in joined(run)}
    assert by_session["s1"]["surprise"] and by_session["s1"]["expected_cached"] == 4096
    assert not by_session["s2"]["surprise"] and by_session["s3"]["route"] is None
    tails = run_tails(run)
    assert (tails["surprises"], tails["surprise_tokens"], tails["worst"][0]["session"]) == (1, 4096 - 1536, "s1")
