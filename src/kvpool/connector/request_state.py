"""What the scheduler side knows about one request (pure: no I/O, no vLLM).

Rules:
- One RequestState per request, in the scheduler's one dict `request id -> RequestState`: made
  the first time vLLM asks about the request (or admits it without asking) and dropped when vLLM
  finishes it (`request_finished`), nowhere else.
- `request` is set at admission (`update_state_after_alloc`): a state without it belongs to a
  request vLLM has asked about but not admitted, and is neither saved nor marked as a failed load.
- A lookup's answer and vLLM's local hit are kept from the question to the admission that takes
  them; a later question (vLLM retries an admission that could not allocate) replaces them.
- A request whose pool load came back short is computed from then on: asking the pool again
  would plan the same failing load forever (the master may list a dead node's objects until the
  node's TTL ends).
- A P/D decode request (vLLM's `kv_transfer_params` say `do_remote_prefill`) gets its prompt's KV
  from the prefill instance, which saved it to the pool: its prompt's objects need no save and no
  lookup; what it decodes is saved as usual.
- Save progress only grows: objects [0, next_save) are in the pool or on their way; for a hybrid
  model, `saved_until[group]` is the same per KV-cache group (groups.py), 0 where absent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.connector.session_hints import SessionHint


@dataclass
class RequestState:
    request_id: str
    request: object | None = None  # vLLM's Request, from its admission on
    local_hit_tokens: int = 0  # vLLM's local prefix-cache hit when it last asked, until admission
    lookup: tuple[int, int] | None = None  # (local hit tokens, pool hit objects) of the last answer, until admission
    remote_prefill: bool = False  # P/D decode: the prompt's KV comes from a prefill instance
    load_failed: bool = False  # its pool load came back short: computed from now on, never planned again
    next_save: int = 0
    saved_until: dict[int, int] = field(default_factory=dict)  # hybrid models: per KV-cache group
    save_jobs: set[int] = field(default_factory=set)  # save jobs planned for it (pins.py)
    hint: SessionHint | None = None  # its agent session and TTL (session_hints.py), read when first asked
    hint_read: bool = False

    @property
    def admitted(self) -> bool:
        return self.request is not None

    def take_local_hit(self) -> int:
        """vLLM's local hit as it last asked (0 if it did not ask since the last admission)."""
        tokens, self.local_hit_tokens = self.local_hit_tokens, 0
        return tokens

    def take_lookup(self) -> tuple[int, int] | None:
        lookup, self.lookup = self.lookup, None
        return lookup

    def mark_saved(self, num_objects: int, groups=()) -> None:
        """Objects [0, num_objects) need no save; nor, for each of `groups`, its blocks before that."""
        self.next_save = max(self.next_save, num_objects)
        for g in groups:
            self.saved_until[g] = max(self.saved_until.get(g, 0), num_objects)
