"""benchmarks/registry.py, results_io.py and run.py: names, machine names, result paths, LATEST.md."""

import sys
from pathlib import Path

import pytest

BENCHMARKS_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS_DIR))

import registry  # noqa: E402
import results_io  # noqa: E402
import run  # noqa: E402


def test_every_entry_points_at_something_that_exists():
    for bench in registry.BENCHMARKS:
        if bench.is_module:
            continue
        assert (BENCHMARKS_DIR / bench.target).is_file(), bench.name


def test_unknown_name_says_how_to_list():
    with pytest.raises(KeyError, match="--list"):
        registry.get("no_such_benchmark")


def test_bad_kind_is_refused():
    with pytest.raises(ValueError, match="kind"):
        registry.Benchmark("x", "nano", "x.py", "x")


@pytest.mark.parametrize("model, family", [
    ("AMD EPYC 7763 64-Core Processor", "epyc"),
    ("Intel(R) Xeon(R) Processor", "xeon"),
    ("Intel(R) Core(TM) i7-8700K CPU @ 3.70GHz", "core"),
    ("AMD Ryzen 9 5950X 16-Core Processor", "ryzen"),
    ("", "unknown"),
])  # fmt: skip
def test_cpu_family(model, family):
    assert results_io.cpu_family(model) == family


def test_machine_name_has_cores_family_and_gpu():
    cpu_only = results_io.Machine("AMD EPYC 9B14", 2, 7.8, "6.8.0", None)
    assert cpu_only.name == "2cpu-epyc"
    with_gpu = results_io.Machine("Intel(R) Xeon(R) Platinum 8480+", 16, 128.0, "6.8.0", "NVIDIA H100 80GB HBM3")
    assert with_gpu.name == "16cpu-xeon-h100"
    assert results_io.gpu_short_name("NVIDIA GeForce RTX 4090") == "rtx4090"
    assert results_io.gpu_short_name("NVIDIA L40S") == "l40s"


def test_dated_names_split_machine_from_variant():
    assert results_io.DATED.match("2026-12-07-2cpu-epyc").groups() == ("2026-12-07", "2cpu-epyc", None)
    assert results_io.DATED.match("2026-12-07-2cpu-epyc-gemma3").groups() == ("2026-12-07", "2cpu-epyc", "gemma3")
    assert results_io.DATED.match("2026-12-07-16cpu-xeon-h100").groups() == ("2026-12-07", "16cpu-xeon-h100", None)
    assert results_io.DATED.match("2026-12-07-unknown-long").groups() == ("2026-12-07", "unknown", "long")
    assert results_io.DATED.match("2026-12-07-2cpu-epyc-1407").groups() == ("2026-12-07", "2cpu-epyc", "1407")
    assert results_io.DATED.match("LATEST") is None


def test_result_files_and_latest(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPOOL_RESULTS_DIR", str(tmp_path))
    machine = results_io.Machine("AMD EPYC 9B14", 2, 7.8, "6.8.0", None)
    old = tmp_path / "checksum" / "2026-01-02-2cpu-xeon.md"
    old.parent.mkdir()
    old.write_text("# old\n| a |\n")
    files = results_io.result_files("checksum", machine=machine)
    assert files.folder == tmp_path / "checksum"
    assert files.md.name == f"{results_io.today()}-2cpu-epyc.md"
    files.md.write_text("# Checksums\n\n| size | GB/s |\n|---|---|\n| 1 MiB | 20 |\n")
    latest = results_io.refresh_latest("checksum").read_text()
    assert "| 1 MiB | 20 |" in latest and "## Checksums" in latest.replace("### Checksums", "## Checksums")
    assert "| a |" not in latest  # only the newest date's tables
    assert f"[{files.md.name}]({files.md.name})" in latest  # the newest report, shown
    assert "- 2026-01-02-2cpu-xeon: [md](2026-01-02-2cpu-xeon.md)" in latest  # every dated result, linked
    assert "../../method.md" in latest and "../../machines.md" in latest


def test_run_lists_and_builds_commands():
    text = run.listing()
    assert all(b.name in text for b in registry.BENCHMARKS)
    module = registry.Benchmark("cli_demo", "e2e", "-m kvpool.cli", "x", ("demo",))
    assert run.command(module, ["--help"])[1:] == ["-m", "kvpool.cli", "demo", "--help"]
    checksum = run.command(registry.get("checksum"), ["--quick"])
    assert checksum[1:] == [str(BENCHMARKS_DIR / "checksum_bench.py"), "--quick"]
    assert run.main(["no_such_benchmark"]) == 2


def test_newest_finds_a_variant_run_twice_a_day(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPOOL_RESULTS_DIR", str(tmp_path))
    for name in ("2026-12-01-2cpu-epyc-tail", "2026-12-03-2cpu-epyc-tail-0900", "2026-12-03-2cpu-epyc-tail-1400",
                 "2026-12-04-2cpu-epyc-router"):
        (tmp_path / "demo" / name).mkdir(parents=True)
    assert results_io.newest("demo", "tail").name == "2026-12-03-2cpu-epyc-tail-1400"
    assert results_io.newest("demo", "kv40") is None


def test_latest_demotes_headings_but_not_code(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPOOL_RESULTS_DIR", str(tmp_path))
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "2026-12-01-2cpu-epyc.md").write_text("# Store\n```\n# a shell comment\n```\n")
    latest = results_io.refresh_latest("store").read_text()
    assert "## Store" in latest and "\n# a shell comment\n" in latest
