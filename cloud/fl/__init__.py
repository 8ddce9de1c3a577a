"""Federated learning on the hub (DESIGN §5, seeds/000 and 002).

* :mod:`cloud.fl.task` and :mod:`cloud.fl.rounds`: the ``federated_training`` task type (admission, orders, rounds);
  :mod:`cloud.fl.evaluate`: scoring each round's global model on a held-out set.
* :mod:`cloud.fl.simulate`: ``aisynergy simulate`` (model quality with many participants, computing efficiency with
  a large model and few); :mod:`cloud.fl.experiment`: ``aisynergy experiment fl`` (local-only vs federated vs
  centralised). Nothing is imported here.
"""
