"""Measured per-token rates for the cache-aware policy's `CostModel`.

Rules:
- Pure: observations come in as numbers (the caller measured them), `costs()` gives a `CostModel`.
- Time to first token is fitted as `overhead + a * compute_tokens + b * pool_tokens` by least
  squares over exponentially weighted observations (recent requests count most, old ones fade with
  `half_life` observations). `compute_tokens` is what the backend had to prefill before this
  request's first token: its recomputed tokens plus the prompt tokens queued ahead of it.
- The prior enters as a few weighted pseudo-observations that never fade, so a rate the traffic
  has not shown yet (no pool hits so far) stays at the prior instead of being a guess from noise.
  Rejected: separate EWMAs of ttft/tokens per kind of request: queueing and the fixed overhead land
  in whichever rate happens to be observed, and mixed requests (part pool, part recompute) are lost.
- Rates never go negative; a fit that says so is clamped to zero.
- The cost of a token another request decodes meanwhile (`CostModel.decode_s_per_token`) is the
  fitted prefill rate: one more token through the model. It is NOT the decode latency a stream
  shows (`decode_latency_s_per_token`, seconds between one request's tokens): that is a whole
  engine step, shared by every request in the batch, and a request sent now joins the next step
  alongside the decodes. Charged per token in flight, the latency made a server decoding two
  answers (~100 tokens) look 20 s busy on the Claude Code replay, so warm requests went behind a
  14K-token cold prefill instead (docs/design/router.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.router.policy import CostModel

_FEATURES = 3  # overhead (constant 1), compute tokens, pool tokens


@dataclass(frozen=True)
class RateConfig:
    prior: CostModel
    half_life: float = 32.0  # observations after which an observation weighs half
    prior_weight: float = 0.1  # the prior weighs as this many observations of prior_tokens each
    prior_tokens: int = 1024  # size of the prior's pseudo-observations

    def __post_init__(self) -> None:
        if not self.half_life > 0:
            raise ValueError(f"half_life must be > 0, got {self.half_life}")
        if not self.prior_weight > 0:
            raise ValueError(f"prior_weight must be > 0, got {self.prior_weight}")
        if self.prior_tokens < 1:
            raise ValueError(f"prior_tokens must be >= 1, got {self.prior_tokens}")


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


class RateEstimator:
    def __init__(self, config: RateConfig) -> None:
        self.config = config
        self._decay = 0.5 ** (1.0 / config.half_life)
        self._xtx = [[0.0] * _FEATURES for _ in range(_FEATURES)]
        self._xty = [0.0] * _FEATURES
        self._decode_latency_s = None  # seconds between a stream's tokens (an EWMA), once seen
        self._decode_weight = 0.0
        self.num_ttft_observations = 0
        self.num_decode_observations = 0

    def observe_ttft(self, compute_tokens: int, pool_tokens: int, ttft_s: float) -> None:
        if compute_tokens < 0 or pool_tokens < 0 or not ttft_s >= 0:
            raise ValueError(f"bad observation: {compute_tokens=} {pool_tokens=} {ttft_s=}")
        x = (1.0, float(compute_tokens), float(pool_tokens))
        for i in range(_FEATURES):
            self._xty[i] = self._xty[i] * self._decay + x[i] * ttft_s
            for j in range(_FEATURES):
                self._xtx[i][j] = self._xtx[i][j] * self._decay + x[i] * x[j]
        self.num_ttft_observations += 1

    def observe_decode(self, num_tokens: int, seconds: float) -> None:
        """`num_tokens` generated in `seconds` after the first one (one request's decode phase):
        the decode latency, reported (metrics), not a cost (see the module's rules)."""
        if num_tokens <= 0 or not seconds >= 0:
            return  # nothing decoded: nothing to learn
        w = self._decode_weight * self._decay
        latest = seconds / num_tokens
        previous = self._decode_latency_s if self._decode_latency_s is not None else latest
        self._decode_latency_s = (w * previous + latest) / (w + 1.0)
        self._decode_weight = w + 1.0
        self.num_decode_observations += 1

    @property
    def decode_latency_s_per_token(self) -> float | None:
        return self._decode_latency_s

    def costs(self) -> CostModel:
        prior, t, w = self.config.prior, float(self.config.prior_tokens), self.config.prior_weight
        xtx = [row[:] for row in self._xtx]
        xty = self._xty[:]
        # Pseudo-observations (a ridge towards the prior): each rate alone over prior_tokens, and an
        # overhead of zero. No intercept in the rate rows, so they pull each rate, not the overhead.
        for x, y in (((0.0, t, 0.0), prior.prefill_s_per_token * t), ((0.0, 0.0, t), prior.pool_load_s_per_token * t),
                     ((1.0, 0.0, 0.0), 0.0)):  # fmt: skip
            for i in range(_FEATURES):
                xty[i] += w * x[i] * y
                for j in range(_FEATURES):
                    xtx[i][j] += w * x[i] * x[j]
        fit = _solve(xtx, xty)
        if fit is None:
            return CostModel(prior.prefill_s_per_token, prior.pool_load_s_per_token, prior.prefill_s_per_token)
        prefill = max(0.0, fit[1])
        return CostModel(prefill_s_per_token=prefill, pool_load_s_per_token=max(0.0, fit[2]), decode_s_per_token=prefill)
