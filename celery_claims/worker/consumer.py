"""The consumer mixin: the claim gate as part of a fleet's own consumer class.

``install(app)`` adds the gate to ``app.steps['consumer']``, which every consumer built on
Celery's ``Consumer`` applies. A fleet that runs its own consumer class (``worker_consumer``)
can also declare the gate in that class, so the class carries it wherever it is used and a
worker that runs it without claims refuses to start instead of consuming unclaimed::

    from celery.worker.consumer import Consumer
    from celery_claims.worker import ClaimsConsumerMixin

    class FleetConsumer(ClaimsConsumerMixin, Consumer):
        ...

    app.conf.worker_consumer = "fleet.consumer:FleetConsumer"
    celery_claims.install(app)

The gate is the one the bootstep installs (:class:`~celery_claims.worker.steps.Gate`, one
step in the class's blueprint, never two), so both ways behave the same. It wraps
``on_task_request`` while the consumer is built, before the ``Tasks`` step builds the task
strategies that capture it: a wrapper the subclass sets after ``super().__init__()`` runs in
front of the gate, which stays the last call before the pool.
"""

from __future__ import annotations

from typing import Any

from celery_claims.errors import InvalidArgument
from celery_claims.worker.delivery.gate import ClaimGate
from celery_claims.worker.steps import Gate

__all__ = ["ClaimsConsumerMixin"]


class ClaimsConsumerMixin:
    """Mix into a subclass of Celery's ``Consumer`` (list it first) to carry the claim gate.

    Raises:
        InvalidArgument: at class creation, a class with no ``Blueprint`` (not a
            ``Consumer``); when the worker builds the consumer, a worker without claims
            (``install(app)`` was not called), with ``name`` ``worker_consumer``.
    """

    #: the gate in front of ``on_task_request`` (set by the Gate step while the consumer is built)
    claim_gate: ClaimGate | None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        blueprint = getattr(cls, "Blueprint", None)
        if blueprint is None or not hasattr(blueprint, "default_steps"):
            raise InvalidArgument(
                "worker_consumer",
                f"{cls.__qualname__}: ClaimsConsumerMixin goes on a celery.worker.consumer."
                "Consumer subclass",
            )
        if Gate not in blueprint.default_steps:
            # a blueprint of the class's own: Celery merges it with app.steps['consumer'] by
            # step, so with install(app) as well the gate is still one step
            blueprint_with_gate = type(
                blueprint.__name__,
                (blueprint,),
                {
                    "default_steps": [*blueprint.default_steps, Gate],
                    "__module__": cls.__module__,
                    "__qualname__": f"{cls.__qualname__}.{blueprint.__name__}",
                },
            )
            # setattr: the attribute belongs to the Consumer the mixin is combined with
            setattr(cls, "Blueprint", blueprint_with_gate)  # noqa: B010

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if getattr(self, "claim_gate", None) is None:
            raise InvalidArgument(
                "worker_consumer",
                f"{type(self).__qualname__} mixes in ClaimsConsumerMixin but the worker runs "
                "without claims: call celery_claims.install(app) before the worker starts",
            )
