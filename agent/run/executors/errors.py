"""What an executor raises when it cannot build an order here (the registry, in __init__.py, then
tries the next one); its own module so that executor modules need not import their package."""

from __future__ import annotations

from tandoor_contract.errors import TandoorError


class Unavailable(TandoorError):
    """This executor cannot build this order here; the message says why (the caller falls back)."""

    exit_code = 3
