"""The hub's tasks (DESIGN §4.3): the task, worker and chunk lifecycles and the kinds that plug into them.

* :mod:`cloud.tasks.lifecycle`: reading a stored task and the hub's lines in its log; the legal moves of tasks
  and workers, and ending them; the workers' orders in their targets' desired documents; a sharded task's chunks,
  from creation to gathered outputs.
* :mod:`cloud.tasks.kind`: the :class:`~cloud.tasks.kind.TaskKind` hooks and the registry of kinds; the kinds
  themselves live with their domain (:mod:`cloud.tasks.kinds` for inference and batch inference,
  ``cloud.split_inference``, ``cloud.incremental.kind``, ``cloud.fl.kind``).

The REST operations are ``cloud.services.tasks``, the scheduler ``cloud.scheduler``, the workers' reports
``cloud.services.task_reports``: they call these modules and the kinds' hooks, never branch on a task's type.
"""
