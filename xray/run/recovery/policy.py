"""The run's one fault policy: every recovery, of any kind, draws on one restart budget.

A synchronous step that lost a Workhorse (`recover.recover`), an asynchronous run's lost maker or
trainer Workhorse (`xray/run/detached/supervisor.py`) and its rollback to a checkpoint
(`recover.recover_async`) each spend one restart (a maker failure one per failed maker) of the
same budget, held by the run's trainer for the whole run: a rollback does not reset it. At most
`trainer.max_restarts` recoveries; one more death ends the run with the error.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class RestartsExhausted(RuntimeError):
    """Workhorses or makers died more often than `trainer.max_restarts` allows."""


class RestartBudget:
    """`trainer.max_restarts` recoveries for the whole run."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        """Recoveries so far."""

    def spend(self, what: str, cause: BaseException, n: int = 1,
              error: type[RestartsExhausted] = RestartsExhausted) -> int:
        """Count `n` recoveries of `what` (a sentence: what died) caused by `cause`; the count so far.
        `error` (a RestartsExhausted) past the limit, naming the fix."""
        self.used += n
        if self.used > self.limit:
            raise error(f"{what}, and the run already recovered {self.used - n} times of trainer.max_restarts="
                        f"{self.limit}; raise it, or look at why they die: {cause}") from cause
        log.debug("restart %d of %d: %s", self.used, self.limit, what)
        return self.used
