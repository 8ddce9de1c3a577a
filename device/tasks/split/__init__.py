"""The ``split_inference`` worker programs (``SplitInferenceSpec`` + the order's ``SplitOrder``), by role.

**tail** (the edge node, one per task): fetches the tails the hub cut (and the whole model, for edge-only), each a
signed artefact verified like any download, and answers the task's requests on ``infer``
(:class:`edge.split.TailRouter`): decode the activation frame, run the tail named by the request's cut, send the
outputs back with its compute time. A probe is answered at once, empty. Metrics: ``requests``, ``errors``,
``probes``, ``tail_ms_p50``. It runs until its order is withdrawn (the hub withdraws it with the last head).

**head** (each device): checks that the model it runs is the one the hub cut (``base_sha256``, one float32
input), fetches the heads, then routes every request to that model through itself
(:meth:`~device.ota.models.ModelHost.set_route`: the ``infer`` command and the application alike):

* the plan's cut: run the head, send the activation (int8 when ``quantize``), the edge answers with the outputs;
  ``edge``: the raw input crosses; ``device``: the whole model runs here;
* the edge does not answer within ``timeout_ms`` (or is not connected, or says it cannot): the whole model runs
  here and the request counts as a **fallback**; for ``retry_after_s`` every request does, then the edge is
  measured again.

The plan comes from :class:`~device.split.planner.Planner`: at start (and after the edge failed) the worker
*calibrates*: it times each head (with encoding its frame and decoding the answer) and the whole model here on a
one-row input, sends each cut's activation to the edge a few times (the edge reports its compute time per cut;
the answer's size is counted on the link too), and probes the link
(:func:`~device.split.planner.probe_link`). Every request that crosses refines the link estimate (its time less
the edge's compute time, its bytes); the planner moves the cut when the link moved by more than a quarter.
While no request crosses, the link is probed again every ``probe_interval_s``. Until the first calibration
succeeds, requests run on the device (``device``; not fallbacks: nothing was promised yet). A pinned ``cut``
skips the planner (the measurements are still reported).

Metrics every ``report_interval_s``: ``requests``, ``errors``, ``split`` (answered through a cut), ``edge``,
``device``, ``fallbacks``, ``replans``, ``link_mbps``, ``rtt_ms``, ``cut_index`` (-1 device, 0 edge, i the
i-th part), ``estimate_ms`` (the plan's), ``latency_p50_ms``, ``latency_p99_ms``. Paused, requests run on the
device the usual way (``local``) until resumed.

One role a module: :mod:`~device.tasks.split.head` (the device), :mod:`~device.tasks.split.tail` (the edge), and
:mod:`~device.tasks.split.order` (what both read of the order).
"""

from __future__ import annotations

from device.tasks.split.head import Head
from device.tasks.split.tail import serve_tails
from device.tasks.worker import Rejected, Worker
from interfaces.tasks import SPLIT_HEAD, SPLIT_TAIL


def run(worker: Worker) -> None:
    role = worker.order.role
    if role == SPLIT_HEAD:
        Head(worker).run()
    elif role == SPLIT_TAIL:
        serve_tails(worker)
    else:
        raise Rejected(f"a split_inference worker is a {SPLIT_HEAD} (device) or a {SPLIT_TAIL} (edge), not {role!r}")
