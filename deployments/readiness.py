"""Is an engine replica running, and if not, why not: what the Router tells clients.

Without a running replica `/health`, `/v1/models` and every request answer 503 with the cause
(still starting, or the start-up failure's own message) instead of waiting for a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

logger = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "EngineReplica"
_CAUSE = re.compile(r"(?:EngineStartupError|VLLMIncompatibleError): (.+)")


def startup_cause(message: str) -> str:
    """The failure's own words out of a Serve status message (which holds a traceback)."""
    found = _CAUSE.findall(message or "")
    if found:
        return found[-1].strip()
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    return lines[-1] if lines else "unknown"


def why_not_ready(deployment) -> str | None:
    """None if the engine deployment has a running replica; else the reason, for a 503 body."""
    if deployment is None:
        return "the engine deployment is not deployed yet"
    states = {str(getattr(k, "value", k)): v for k, v in (deployment.replica_states or {}).items()}
    if states.get("RUNNING", 0) > 0:
        return None
    status = str(getattr(deployment.status, "value", deployment.status))
    if status in ("DEPLOY_FAILED", "UNHEALTHY") or "failed" in (deployment.message or "").lower():
        return f"no engine replica is running: its engine failed to start: {startup_cause(deployment.message)}"
    starting = sum(v for k, v in states.items() if k in ("STARTING", "UPDATING", "RECOVERING", "PENDING_MIGRATION"))
    return (
        f"no engine replica is ready yet ({starting} starting; an engine takes a minute or more to load its "
        "model and warm up): retry shortly"
    )


class Readiness:
    """The Router's cached view of its engine replicas: one controller call per `ready_ttl_s` while
    they serve, per `not_ready_ttl_s` while they do not."""

    def __init__(self, app_name: str, ready_ttl_s: float = 10.0, not_ready_ttl_s: float = 1.0, timeout_s: float = 10.0):
        self.app_name, self.timeout_s = app_name, timeout_s
        self.ready_ttl_s, self.not_ready_ttl_s = ready_ttl_s, not_ready_ttl_s
        self._checked = -float("inf")
        self._reason: str | None = "not checked yet"
        self._lock = asyncio.Lock()

    def _fresh(self) -> bool:
        ttl = self.ready_ttl_s if self._reason is None else self.not_ready_ttl_s
        return time.monotonic() - self._checked < ttl

    async def why_not(self) -> str | None:
        if self._fresh():
            return self._reason
        async with self._lock:
            if not self._fresh():
                self._reason = await self._check()
                self._checked = time.monotonic()
        return self._reason

    async def _check(self) -> str | None:
        from ray import serve

        try:
            status = await asyncio.wait_for(asyncio.to_thread(serve.status), self.timeout_s)
        except Exception as e:  # the controller is busy or gone: do not block traffic on it
            logger.warning("could not read Serve's status (%s); assuming the engine replicas are up", e)
            return None
        app = status.applications.get(self.app_name)
        return why_not_ready(None if app is None else app.deployments.get(ENGINE_DEPLOYMENT))
