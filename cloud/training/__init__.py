"""The ``training`` task kind: a user's algorithm trained on one site's own data (``cloud.training.kind``)."""
