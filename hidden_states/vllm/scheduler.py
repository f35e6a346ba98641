"""The tail step: the final token's hidden state as one more decode row (ledger point 9 in __init__.py).

A request flagged for the tail (`HiddenStatesExtractionRequest(tail=True)` in
its extra_args) that stops inside the engine (EOS, a stop token id,
`max_tokens`, repetition) is held back one step instead of finishing: its last
sampled token is emitted at once, without a finish reason, and the request
stays running, so the next `schedule()` computes that token as an ordinary
one-token decode row, in the batch that runs anyway, with every earlier K/V in
place. That step's scheduler output names the held requests
(`hidden_states_tails`, an attribute that rides along wherever the scheduler
output goes: a dataclass instance, pickled by the multiprocess executor), so
the runner hook captures their rows. The token sampled from that row is
discarded, and the request finishes with its original finish and stop reason.

A preempted held request is recomputed on resume; the step whose scheduled
span reaches its last token is still a tail step (the runner checks the span).
Requests finished from outside (an abort) are dropped from the held set in
`_free_request`. Nothing changes for unflagged requests.

Not held (the frontend then runs the extraction step, as before): a request
with no room left for one more position (`num_tokens >= max_model_len`), and
stops the engine never sees (stop strings, cut in the frontend: the frontend
does not flag those requests).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from hidden_states.protocol import HiddenStatesExtractionRequest
from hidden_states.vllm import _require

TAILS_ATTR = "hidden_states_tails"  # SchedulerOutput attribute: request ids whose tail row runs in this step
_HOLD = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_REPETITION)


class TailScheduler(Scheduler):
    """vLLM's v1 Scheduler, holding flagged requests' finish for one tail step."""

    def __init__(self, *args: Any, **kwargs: Any):
        for name in ("add_request", "schedule", "_update_request_with_output", "_free_request"):
            _require(hasattr(Scheduler, name), f"Scheduler.{name} (the tail step, ledger point 9)")
        super().__init__(*args, **kwargs)
        self._tail_flagged: set[str] = set()
        self._held: dict[str, tuple[Any, Any]] = {}  # request id -> (finished status, stop reason)
        self.tails_run = 0

    def add_request(self, request: Any) -> None:
        sp = request.sampling_params
        flag = HiddenStatesExtractionRequest.from_extra_args(sp.extra_args if sp is not None else None)
        if flag is not None and flag.tail:
            self._tail_flagged.add(request.request_id)
        super().add_request(request)

    def schedule(self, *args: Any, **kwargs: Any):
        out = super().schedule(*args, **kwargs)
        setattr(out, TAILS_ATTR, [rid for rid in self._held if rid in out.num_scheduled_tokens])
        return out

    def _update_request_with_output(self, request: Any, new_token_ids: list[int], is_stale: bool = False):
        rid = request.request_id
        held = self._held.pop(rid, None)
        if held is not None:
            # The tail step ran: drop the token sampled from it, finish as the request first stopped.
            request.status, request.stop_reason = held
            self.tails_run += 1
            return [], True
        new_token_ids, stopped = super()._update_request_with_output(request, new_token_ids, is_stale)
        if (stopped and rid in self._tail_flagged and request.status in _HOLD
                and request.num_tokens < self.max_model_len):
            self._held[rid] = (request.status, request.stop_reason)
            request.status, request.stop_reason = RequestStatus.RUNNING, None
            return new_token_ids, False
        return new_token_ids, stopped

    def _free_request(self, request: Any, *args: Any, **kwargs: Any):
        self._tail_flagged.discard(request.request_id)
        self._held.pop(request.request_id, None)
        return super()._free_request(request, *args, **kwargs)
