"""Synthetic agent sessions shaped like the published workloads (see shared notes/workloads.md).

Profiles:
- codex: the Codex / SWE-bench Pro trace set. LLM calls per session lognormal (median 30, mean 33);
  first context ~12K tokens including a 4K system prompt shared by every session; the prompt grows
  by ~2.2K tokens per call (the previous answer plus tool results, lognormal); output tokens set per
  session so input:output is 131:1; tool time before each call lognormal (median 5.2 s, P99 81.4 s).
- seed-scaleout: the reference scale-out load. 20K-token common prefix, 10K-token first input
  (after the prefix), each turn appends the 900-token answer and 2,048 new tokens, 30 turns, no
  think time.

Rules:
- An agent re-sends its whole history: turn k's tokens are turn k-1's prompt, its output, then the
  new tokens. Block ids follow the token stream: full blocks keep their id, the block holding the
  old tail is completed by new tokens and gets a fresh id.
- Private ids are unique across the file (session index in the high bits), so even a consumer that
  ignores `id_scope` cannot mistake two sessions for one; shared prefix ids are 0..P-1.
- Session i depends only on (seed, i): `--sessions` adds sessions without changing earlier ones.
- `scale` multiplies every token count (prefix, first input, growth, output); times are unscaled.
- Turn `start_offset_s` is the sum of think times so far: service time is not modelled here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvpool.workload.model import Session, Turn

_Z99 = 2.3263478740408408  # standard normal quantile at 0.99


@dataclass(frozen=True)
class Profile:
    name: str
    shared_prefix_tokens: int  # system prompt shared by every session
    first_input_tokens: float  # median of the session's own first input, after the shared prefix
    first_input_sigma: float  # lognormal sigma of the above (0 = fixed)
    turns_median: float
    turns_sigma: float  # lognormal sigma of turns per session (0 = fixed)
    new_tokens_mean: float  # tokens appended per turn
    new_tokens_sigma: float
    new_tokens_include_output: bool  # True: new tokens count the previous answer; False: added to it
    output_tokens_mean: float | None  # fixed mean output per call ...
    input_output_ratio: float | None  # ... or a mean set per session to give this input:output ratio
    output_sigma: float
    think_time_median_s: float  # 0 = no think time
    think_time_p99_s: float


PROFILES: dict[str, Profile] = {
    "codex": Profile(
        name="codex",
        shared_prefix_tokens=4096,
        first_input_tokens=8000.0,
        first_input_sigma=0.3,
        turns_median=30.0,
        turns_sigma=math.sqrt(2 * math.log(33 / 30)),  # mean/median = exp(sigma^2 / 2) = 1.1
        new_tokens_mean=2200.0,
        new_tokens_sigma=0.8,
        new_tokens_include_output=True,
        output_tokens_mean=None,
        input_output_ratio=131.0,
        output_sigma=0.7,
        think_time_median_s=5.2,
        think_time_p99_s=81.4,
    ),
    "seed-scaleout": Profile(
        name="seed-scaleout",
        shared_prefix_tokens=20000,
        first_input_tokens=10000.0,
        first_input_sigma=0.0,
        turns_median=30.0,
        turns_sigma=0.0,
        new_tokens_mean=2048.0,
        new_tokens_sigma=0.0,
        new_tokens_include_output=False,
        output_tokens_mean=900.0,
        input_output_ratio=None,
        output_sigma=0.0,
        think_time_median_s=0.0,
        think_time_p99_s=0.0,
    ),
}


@dataclass(frozen=True)
class SynthConfig:
    profile: str = "codex"
    num_sessions: int = 100
    scale: float = 1.0  # multiplies every token count
    block_size: int = 16  # tokens per block id
    seed: int = 0
    max_turns: int = 500  # cap on the lognormal turn count

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}; choose one of {', '.join(PROFILES)}")
        if self.num_sessions < 1:
            raise ValueError(f"num_sessions must be >= 1, got {self.num_sessions}")
        if not 0 < self.scale <= 1000:
            raise ValueError(f"scale must be in (0, 1000], got {self.scale}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")


def _lognormal_mean(rng: np.random.Generator, mean: float, sigma: float, size: int) -> np.ndarray:
    """Lognormal samples with the given mean (not median); sigma 0 gives the constant."""
    if sigma == 0:
        return np.full(size, mean)
    return rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma, size)


def _tokens(x: float, scale: float) -> int:
    return max(1, round(x * scale))


def _session_lengths(p: Profile, c: SynthConfig, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """Prompt lengths and output lengths of one session's turns (tokens, scaled)."""
    num_turns = round(p.turns_median * (rng.lognormal(0.0, p.turns_sigma) if p.turns_sigma else 1.0))
    num_turns = min(max(1, num_turns), c.max_turns)
    first_own = p.first_input_tokens * (rng.lognormal(0.0, p.first_input_sigma) if p.first_input_sigma else 1.0)
    first = round(p.shared_prefix_tokens * c.scale) + _tokens(first_own, c.scale)
    new = [_tokens(x, c.scale) for x in _lognormal_mean(rng, p.new_tokens_mean, p.new_tokens_sigma, num_turns - 1)]
    if p.new_tokens_include_output:
        prompts = [first]
        for n in new:
            prompts.append(prompts[-1] + n)
        out_mean = (sum(prompts) / len(prompts) / p.input_output_ratio) if p.input_output_ratio else p.output_tokens_mean * c.scale
        outputs = [_tokens(x, 1.0) for x in _lognormal_mean(rng, out_mean, p.output_sigma, num_turns)]
        # the answer is re-sent in the next prompt, so that prompt grows by at least the answer
        # (raising the growth rather than clipping the answer keeps the input:output ratio)
        for k, n in enumerate(new):
            prompts[k + 1] = prompts[k] + max(n, outputs[k])
        return prompts, outputs
    out_mean = p.output_tokens_mean * c.scale if p.output_tokens_mean else p.new_tokens_mean * c.scale
    outputs = [_tokens(x, 1.0) for x in _lognormal_mean(rng, out_mean, p.output_sigma, num_turns)]
    prompts = [first]
    for out, n in zip(outputs, new):
        prompts.append(prompts[-1] + out + n)
    return prompts, outputs


def synth_session(config: SynthConfig, index: int) -> Session:
    p = PROFILES[config.profile]
    rng = np.random.default_rng([config.seed, index])
    prompts, outputs = _session_lengths(p, config, rng)
    if p.think_time_median_s > 0:
        sigma = math.log(p.think_time_p99_s / p.think_time_median_s) / _Z99
        thinks = [0.0] + [float(x) for x in rng.lognormal(math.log(p.think_time_median_s), sigma, len(prompts) - 1)]
    else:
        thinks = [0.0] * len(prompts)
    shared_blocks = round(p.shared_prefix_tokens * config.scale) // config.block_size
    block_ids: list[int] = list(range(shared_blocks))
    next_id = (index + 1) << 32
    turns: list[Turn] = []
    offset_s = 0.0
    for prompt_tokens, output_tokens, think_s in zip(prompts, outputs, thinks):
        num_full = prompt_tokens // config.block_size
        while len(block_ids) < num_full:
            block_ids.append(next_id)
            next_id += 1
        offset_s += think_s
        turns.append(
            Turn(
                block_ids=block_ids[:num_full],
                tail_tokens=prompt_tokens - num_full * config.block_size,
                output_tokens=output_tokens,
                start_offset_s=round(offset_s, 3),
                think_time_s=round(think_s, 3),
            )
        )
    return Session(
        session_id=f"{p.name}-{config.seed}-{index:05d}",
        block_size=config.block_size,
        turns=turns,
        source=f"synth:{p.name}",
        shared_prefix_blocks=shared_blocks,
    )


def synth_sessions(config: SynthConfig) -> list[Session]:
    return [synth_session(config, i) for i in range(config.num_sessions)]
