"""Typed pool errors: each carries a sentence a researcher can act on.

Vocabulary: ``code`` is a stable machine name (``quota_exceeded``); ``message`` is the human
sentence, which names the quota or says what is free instead. Mapping codes to HTTP statuses
happens once, on the hub side; this module does no I/O and knows nothing of HTTP.
"""

from __future__ import annotations


class PoolError(Exception):
    """Base of every error the pool raises on purpose."""

    code = "pool_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(PoolError):
    """The request itself is malformed: unknown offer, bad count, unknown allocation."""

    code = "invalid_request"


class UnknownAllocation(InvalidRequest):
    code = "unknown_allocation"


class TooLarge(InvalidRequest):
    """The request is bigger than the hub accepts (its options, a job's body); says the limit."""

    code = "too_large"


class OfferNotAllowed(PoolError):
    """The offer exists but this team (or a user in no team) may not request it."""

    code = "offer_not_allowed"


class NotATeamMember(PoolError):
    """The user asked to charge a team they do not belong to, or must choose one of several."""

    code = "not_a_team_member"


class QuotaExceeded(PoolError):
    """The team's guarantee plus borrowing limit, or the per-user cap, would be exceeded."""

    code = "quota_exceeded"


class NoCapacity(PoolError):
    """Quota allows it but no device (or no node with enough devices) is free right now."""

    code = "no_capacity"


class LimitReached(PoolError):
    """One user already has as many jobs, followed logs or starting servers as a per-user limit
    allows (:mod:`gpupool.core.limits`); says the limit, what is in use and what to do."""

    code = "limit_reached"
