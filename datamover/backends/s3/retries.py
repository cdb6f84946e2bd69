"""botocore's retries bounded by the transfer's deadline, in every retry mode: none is sent for a transfer cancelled
or past its deadline, nor one whose backoff would end past it (a retry sent then could commit an object after ERR)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..base import clock

#: botocore's retry modes (each is bounded by the transfer's deadline: bound_retries)
RETRY_MODES = ("legacy", "standard", "adaptive")
#: how often a retry's backoff looks whether its transfer was cancelled meanwhile
_BACKOFF_POLL_S = 0.05


class DeadlineRetries:
    """The S3 backend's retry gate: whether a call of this thread (made for a transfer) may be retried, and when."""

    def _botocore_may_retry(self, delay: float) -> bool:
        """Whether botocore may retry this thread's call after waiting ``delay`` s (waited here): not a call we
        retry ourselves (``Run.create_upload``), else as ``_wait_to_retry``."""
        return not getattr(self._calling, "once", False) and self._wait_to_retry(delay)

    def _wait_to_retry(self, delay: float) -> bool:
        """Wait ``delay`` s before a retry of this thread's call; False, without waiting it out, where its transfer
        was cancelled (before or meanwhile) or the retry would start past its deadline: a retry sent then could commit
        an object after the transfer ended ERR and ``release()`` returned."""
        if self._stopped_transfer():
            return False
        deadline = getattr(self._calling, "deadline", None)
        end = clock() + delay
        if deadline is not None and end >= deadline:
            return False
        while (left := end - clock()) > 0:
            time.sleep(min(left, _BACKOFF_POLL_S))
            if self._stopped_transfer():
                return False
        return True

    def _stopped_transfer(self) -> bool:
        """Whether the transfer this thread calls for was cancelled or is past its deadline."""
        stop = getattr(self._calling, "stop", None)
        return stop is not None and stop()


class RetryNotSent(Exception):
    """A retry botocore was about to send for a transfer cancelled or past its deadline (it was not sent)."""


def bound_retries(
    client: Any,
    mode: str,
    attempts: int,
    session: Any,
    may_retry: Callable[[float], bool],
    stopped: Callable[[], bool],
) -> None:
    """Put botocore's retry handler of ``mode`` behind ``may_retry(delay)``, and send no retry once ``stopped()``.

    ``may_retry`` waits out the backoff itself, or refuses the retry (a transfer cancelled, or one whose deadline
    comes first). Every attempt after the first is checked again just before it is sent, after adaptive mode's rate
    limiter, which may hold it: a retry found ``stopped()`` there is not sent and fails the call with RetryNotSent.
    Standard and adaptive retries get a quota that never runs out: botocore spends a shared quota of 500 on retries
    (14 per connection error), refilled only by calls that succeed, so after an outage of a few dozen failed calls one
    dropped connection would fail a transfer at once. The attempts per call stay bounded by ``attempts``.
    """
    import sys

    from botocore import retryhandler, translate
    from botocore.retries import quota, standard

    svc = client.meta.service_model.service_id.hyphenize()
    handler: Callable[..., float | None]
    if mode == "legacy":  # as botocore's ClientCreator._register_legacy_retries builds it
        prefix = client.meta.service_model.endpoint_prefix
        model = session.get_component("data_loader").load_data("_retry")
        config = translate.build_retry_config(
            prefix, model.get("retry", {}), model.get("definitions", {}), {"max_attempts": attempts - 1}
        )
        handler = retryhandler.create_retry_handler(config, prefix)
    else:
        adapter = standard.RetryEventAdapter()
        detector = standard.ThrottlingErrorDetector(adapter)
        handler = standard.RetryHandler(
            retry_policy=standard.RetryPolicy(
                retry_checker=standard.StandardRetryConditions(max_attempts=attempts),
                retry_backoff=standard.ExponentialBackoff(service_name=svc, throttling_detector=detector),
            ),
            retry_event_adapter=adapter,
            retry_quota=standard.RetryQuotaChecker(quota.RetryQuota(sys.maxsize), detector),
            service_name=svc,
        ).needs_retry
    unique_id = f"retry-config-{svc}"
    client.meta.events.unregister(f"needs-retry.{svc}", unique_id=unique_id)

    def needs_retry(**kwargs: Any) -> float | None:
        if stopped():
            return None
        delay = handler(**kwargs)
        # 0: botocore sleeps no more (may_retry waited); None: botocore raises this attempt's error
        return 0 if delay is not None and delay is not False and may_retry(delay) else None

    def before_send(request: Any, **_: Any) -> None:
        retries = (getattr(request, "context", None) or {}).get("retries") or {}
        if retries.get("attempt", 1) > 1 and stopped():
            raise RetryNotSent(
                f"retry {retries['attempt'] - 1} not sent: the transfer was cancelled or is past its deadline"
            )

    client.meta.events.register(f"needs-retry.{svc}", needs_retry, unique_id=unique_id)
    # the generic event, last: after adaptive mode's rate limiter (also on "before-send"), which may hold a retry
    client.meta.events.register_last("before-send", before_send, unique_id=f"dm-retry-guard-{svc}")
