"""gpupool's server options: which keys of ``user_options`` are gpupool's, and how a spawn form or
a spawn link becomes them.

Vocabulary
- *gpupool's keys*: ``offer`` (an offer name), ``count`` (whole GPUs of a ``gpu`` offer, MIG
  instances of a ``mig`` offer with a ``max_count``, else 1)
  and ``team`` (needed only by a user in several teams) of ``user_options``. Every other key
  belongs to someone else (an admin's ``apply_user_options``, another form's fields, a spawn
  link's ``opt-`` arguments) and is left as it came: JupyterHub treats ``user_options`` as opaque.
- *offer limit*: the offers one start may take at most, whatever the pool would grant, set by
  the spawner from something else the user chose (a KubeSpawner profile's ``gpupool_offers``):
  :class:`OfferLimit`.
- *form data*: what JupyterHub hands ``options_from_form`` and ``options_from_query``: a dict of
  lists of strings. gpupool's spawn form sends one field, :data:`FIELD`
  (``"team|offer|count"``); a spawn link sends the keys themselves
  (``/hub/spawn?opt-offer=h100&opt-count=2``).

Contract: pure; gpupool's keys are checked strictly (:class:`InvalidRequest` with a sentence),
the others never looked into.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpupool.core.errors import InvalidRequest
from gpupool.core.parse import clip, whole_number
from gpupool.hub.form import FIELD

KEYS = ("offer", "count", "team")
"""gpupool's keys of ``user_options``."""
FORM_KEYS = (FIELD, *KEYS)
"""The form (or query) fields gpupool reads."""
MAX_COUNT = 64
"""The largest ``count`` a request may name at all (each offer has its own, smaller maximum)."""


def parse_user_options(options: Mapping[str, Any]) -> tuple[str, int, str | None]:
    """``(offer, count, team)`` from gpupool's keys of ``options`` (others are ignored), or
    :class:`InvalidRequest` saying what is wrong. ``offer`` must be there (see
    ``GPUSpawnerMixin.gpupool_defaults`` for what a start that names none gets)."""
    offer = options.get("offer")
    team = options.get("team") or None
    if not isinstance(offer, str) or not offer:
        raise InvalidRequest(f"user_options.offer must be an offer name, got {clip(offer)}.")
    count = whole_number(options.get("count", 1), "user_options.count", 1, MAX_COUNT)
    if team is not None and not isinstance(team, str):
        raise InvalidRequest(f"user_options.team must be a team name, got {clip(team)}.")
    return offer, count, team


@dataclass(frozen=True)
class OfferLimit:
    """The offers a start may take: ``offers``, because of ``who`` (a sentence's subject, such as
    ``Profile 'Deep learning'``)."""

    who: str
    offers: tuple[str, ...]

    def check(self, offer: str) -> None:
        """:class:`InvalidRequest` saying which offers ``who`` allows, unless ``offer`` is one."""
        if offer not in self.offers:
            raise InvalidRequest(
                f"{self.who} allows only the offers {', '.join(self.offers)}, "
                f"not {clip(offer)}: choose one of them, or another profile."
            )

    def needs_offer(self) -> InvalidRequest:
        """The refusal of a start that names no offer where the limit leaves several."""
        return InvalidRequest(f"{self.who} needs an offer: name one of {', '.join(self.offers)}.")


def from_form(form_data: Mapping[str, list[str]]) -> dict[str, Any]:
    """gpupool's keys from form data (the spawn form's :data:`FIELD`, or the keys themselves as
    a spawn link sends them); ``{}`` when it names none. :class:`InvalidRequest` for a value
    that is not one of the form's choices."""
    if FIELD in form_data:
        parts = _single(form_data, FIELD).split("|")
        if len(parts) != 3:
            raise InvalidRequest("Choose one of the offers on the form.")
        team, offer, count = parts
        if not offer:
            raise InvalidRequest("Choose one of the offers on the form.")
        return {
            "team": team or None,
            "offer": offer,
            "count": whole_number(count, "count", 1, MAX_COUNT),
        }
    found: dict[str, Any] = {k: _single(form_data, k) for k in KEYS if k in form_data}
    if "count" in found:
        found["count"] = whole_number(found["count"], "count", 1, MAX_COUNT)
    return found


def others(form_data: Mapping[str, Any]) -> dict[str, Any]:
    """The form data gpupool does not read, as it came."""
    return {k: v for k, v in form_data.items() if k not in FORM_KEYS}


def _single(form_data: Mapping[str, Any], key: str) -> str:
    value = form_data[key]
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0]
    if isinstance(value, str):
        return value
    raise InvalidRequest(f"{key} must be one value, got {clip(value)}.")
