"""Federated learning on the hub (DESIGN §5, seeds/000).

* :mod:`cloud.fl.task` and :mod:`cloud.fl.rounds`: the ``federated_training`` task type (admission, orders, rounds);
  :mod:`cloud.fl.evaluate`: scoring each round's global model on a held-out set.

The simulations (``aisynergy simulate``, ``aisynergy experiment fl``) are not part of it: they live in
:mod:`cloud.simulation`. Nothing is imported here.
"""
