"""The hub's tasks (DESIGN §4.3): the task, worker and chunk lifecycles and the kinds that plug into them.

* :mod:`cloud.tasks.rows`: reading a stored task; the hub's lines in its log.
* :mod:`cloud.tasks.lifecycle`: the legal moves of tasks and workers; ending them.
* :mod:`cloud.tasks.chunks`: a sharded task's chunks, from creation to gathered outputs.
* :mod:`cloud.tasks.orders`: the workers' orders in their targets' desired documents.
* :mod:`cloud.tasks.kind`: the :class:`~cloud.tasks.kind.TaskKind` hooks and the registry of kinds; the kinds
  themselves live with their domain (:mod:`cloud.tasks.kinds` for inference and batch inference,
  ``cloud.split_inference``, ``cloud.incremental.task``, ``cloud.fl.task``).

The REST operations are ``cloud.services.tasks``, the scheduler ``cloud.scheduler``, the workers' reports
``cloud.services.task_reports``: they call these modules and the kinds' hooks, never branch on a task's type.
"""
