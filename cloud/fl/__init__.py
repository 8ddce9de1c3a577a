"""Federated learning on the hub (DESIGN §5): :mod:`cloud.fl.simulate` simulates federated training (model quality
with many participants, computing efficiency with a large model and few). Nothing is imported here."""
