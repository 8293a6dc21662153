"""Speculator: which decoding requests get draft tokens this step, and how many.

A draft token is verified in the same forward pass as its request's next token, so it costs one more
token of compute in the step. It pays when the chance that it is accepted (and all drafts before it)
beats that cost measured against what a token of the step costs anyway. With a step of B tokens costing
fixed + per_token * B seconds (weights read once, then compute per token), one more token is worth
per_token * B / (fixed + per_token * B) = B / (B + B0) of an output token, B0 = fixed / per_token:
nearly free at batch 1 (the step is reading weights), nearly a full token once a large batch makes the
step compute-bound. So draft j (1-based) of a request is proposed while acceptance^j >= B / (B + B0),
where acceptance is the request's own recent rate. Requests whose text the prompt does not predict
drop out by themselves, and so does a whole batch once it is large enough that only near-certain drafts
pay.

A request that is not drafting still asks its proposer for the next token and checks the guess against
the token the step gives (a shadow draft): its acceptance keeps up with its text at no cost in the
forward pass, so drafting resumes when the text turns predictable again, with no probing drafts.

B0 comes from a least-squares fit of recent decode steps' times against their token counts (drafts and
batch sizes vary the count). Drafted steps are verified on the decode path, one decode row per token
(nanoserve.model.attention), so steps with and without drafts are one kind of step and one line fits
both. Until the steps have varied enough to fit, DEFAULT_BREAK_EVEN_TOKENS; after that, while every
step has the same size (a batch that stopped drafting), the last fitted value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nanoserve.config import EngineOptions
from nanoserve.core.ngram_proposer import NgramIndex
from nanoserve.core.request import Request
from nanoserve.model.batch import SchedulerOutput

ACCEPTANCE_DECAY = 0.8
"""Weight of a request's earlier verifications in its acceptance rate, per verification (about the last 5)."""
DEFAULT_BREAK_EVEN_TOKENS = 16.0
"""B0 before the fit: a bf16 step of the bundled model on 2 Zen 4 cores reads weights for about as long
as it computes 16 tokens."""
STEP_COST_DECAY = 0.98
"""Weight of older steps in the cost fit, per step (about the last 50)."""
MIN_TOKEN_SPREAD = 1.0
"""Standard deviation of the steps' token counts (weighted) below which the fit is not trusted."""
BREAK_EVEN_RANGE = (1.0, 256.0)


@dataclass
class DraftState:
    """One request's proposer and its record of accepted drafts (counts decayed per verification)."""

    index: NgramIndex
    num_accepted: float = 0.0
    num_verified: float = 0.0
    """Draft positions whose outcome was seen: every accepted one and the first rejected one."""
    shadow_draft: int | None = None
    """The proposer's guess at the token after the first `shadow_position` tokens, not drafted."""
    shadow_position: int = 0

    @property
    def acceptance(self) -> float:
        """The chance the next draft position is accepted, given the ones before it were (prior 1/2)."""
        return (self.num_accepted + 1.0) / (self.num_verified + 2.0)

    def update(self, num_accepted: int, num_verified: int) -> None:
        self.num_accepted = self.num_accepted * ACCEPTANCE_DECAY + num_accepted
        self.num_verified = self.num_verified * ACCEPTANCE_DECAY + num_verified

    def check_shadow(self, tokens: list[int]) -> None:
        """Score the shadow draft against the token that followed, once it is known."""
        if self.shadow_draft is not None and len(tokens) > self.shadow_position:
            self.update(int(tokens[self.shadow_position] == self.shadow_draft), 1)
            self.shadow_draft = None


@dataclass
class StepCostModel:
    """Exponentially weighted least squares of seconds = fixed + per_token * tokens over decode steps."""

    sums: list[float] = field(default_factory=lambda: [0.0] * 5)
    """Weighted sums of 1, t, t^2, y, t*y."""
    break_even: float = DEFAULT_BREAK_EVEN_TOKENS
    """B0 = fixed / per_token of the latest fit the steps varied enough for."""

    def observe(self, num_tokens: int, seconds: float) -> None:
        t, y = float(num_tokens), seconds
        for i, value in enumerate((1.0, t, t * t, y, t * y)):
            self.sums[i] = self.sums[i] * STEP_COST_DECAY + value
        s0, st, stt, sy, sty = self.sums
        spread = s0 * stt - st * st
        if spread < (MIN_TOKEN_SPREAD * s0) ** 2:
            return
        per_token = (s0 * sty - st * sy) / spread
        fixed = (sy - per_token * st) / s0
        if per_token > 0.0 and fixed > 0.0:
            low, high = BREAK_EVEN_RANGE
            self.break_even = min(high, max(low, fixed / per_token))


class Speculator:
    def __init__(self, options: EngineOptions) -> None:
        self.num_speculative_tokens = options.spec_num_tokens
        self.min_n = options.spec_lookup_min
        self.max_n = options.spec_lookup_max
        self.states: dict[str, DraftState] = {}
        self.cost = StepCostModel()
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        """Totals since the engine started, for the scheduler's stats."""

    def propose(self, request: Request, batch_size: int, max_drafts: int) -> list[int]:
        """Draft tokens for a request about to decode in a batch of `batch_size` requests."""
        state = self.states.get(request.request_id)
        if state is None:
            state = self.states[request.request_id] = DraftState(NgramIndex(self.min_n, self.max_n))
        tokens = request.all_token_ids
        state.check_shadow(tokens)
        num_drafts = min(self._worthwhile_drafts(state.acceptance, batch_size), max_drafts)
        proposal = state.index.propose(tokens, max(num_drafts, 1))
        if num_drafts == 0:
            state.shadow_draft, state.shadow_position = (proposal[0], len(tokens)) if proposal else (None, 0)
            return []
        return proposal

    def _worthwhile_drafts(self, acceptance: float, batch_size: int) -> int:
        """The largest j <= num_speculative_tokens with acceptance^j >= B / (B + B0)."""
        price = batch_size / (batch_size + self.cost.break_even)
        if acceptance >= 1.0:
            return self.num_speculative_tokens
        if acceptance < price:
            return 0
        return min(self.num_speculative_tokens, int(math.log(price) / math.log(acceptance)))

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification: `num_accepted` of the request's `num_drafts` draft tokens matched."""
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        state = self.states.get(request_id)
        if state is None:
            return
        state.update(num_accepted, min(num_accepted + 1, num_drafts))

    def observe_step(self, scheduled: SchedulerOutput, seconds: float) -> None:
        """Time of a step's forward pass and sampling; only decode steps enter the cost fit."""
        if all(c.num_new_tokens - len(c.draft_token_ids) == 1 for c in scheduled.chunks):
            self.cost.observe(scheduled.num_batched_tokens, seconds)

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)
