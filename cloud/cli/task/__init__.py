"""``aisynergy task``: AI tasks over the hub's REST API (DESIGN §4.3, interfaces/tasks/).

    aisynergy task create --type batch_inference --model detector:1.2.0 --inputs frames.npy --chunk-size 32 \\
        --selector zone=a --max-nodes 4 --watch
    aisynergy task create --type inference --model detector --nodes --accelerator gpu:1:inference --duration 1h
    aisynergy task create --type training --algorithm digits-torch-cnn:1.0.0 --dataset train=digits-train \
        --dataset test=digits-test --config '{"epochs": 2}' --steps 10 --checkpoint-every 2 --watch
    aisynergy task create --type federated_training --algorithm digits-torch-cnn:1.0.0 --dataset train=digits-train \
        --initial art-... --rounds 5 --local-fits 2 --variant framework=numpy=digits-numpy-cnn:1.0.0 --watch
    aisynergy task list --state RUNNING
    aisynergy task logs -f task-...          # live log lines (Server-Sent Events) until the task is final
    aisynergy task outputs task-... --out outputs.safetensors

Human-readable output by default; ``--json`` prints the hub's documents (``logs --json``: one log line a line).
A problem document from the hub is printed as one line, as ``aisynergy deploy`` does. ``create --watch`` and
``watch`` exit 0 when the task SUCCEEDED, 1 otherwise.

Everything the commands compute is in plain functions (``build_task_body``, ``SSEDecoder``, ``follow``,
``upload_inputs``, ...) so tests call them without the command line. One concern a module:

- ``options``: the command line's flags into a checked ``TaskCreate`` body;
- ``client``: the hub calls beyond one JSON request (the dataset upload of ``--inputs``, the outputs download);
- ``sse``: the ``text/event-stream`` decoder and the log follower that reconnects;
- ``view``: formatting, tables and the live view of one task;
- ``commands``: the click group ``task`` and its commands.
"""

from cloud.cli.task.client import (
    INPUT_FORMATS,
    dataset_identity,
    download_outputs,
    file_sha256,
    input_format,
    upload_inputs,
)
from cloud.cli.task.commands import task
from cloud.cli.task.options import (
    DURATION,
    build_task_body,
    check_task_body,
    load_spec,
    parse_accelerator,
    parse_algorithm,
    parse_duration,
    parse_model,
    parse_variant,
)
from cloud.cli.task.sse import SSE_MEDIA_TYPE, LogFollower, SSEDecoder, SSEEvent, StreamDropped, iter_sse
from cloud.cli.task.view import FINAL, TaskView, format_log_line, progress_summary, watch_task, workers_summary

__all__ = [
    "DURATION", "FINAL", "INPUT_FORMATS", "SSE_MEDIA_TYPE", "LogFollower", "SSEDecoder", "SSEEvent", "StreamDropped", "TaskView",
    "build_task_body", "check_task_body", "dataset_identity", "download_outputs", "file_sha256", "format_log_line", "input_format",
    "iter_sse", "load_spec", "parse_accelerator", "parse_algorithm", "parse_duration", "parse_model", "parse_variant", "progress_summary",
    "task", "upload_inputs", "watch_task", "workers_summary",
]  # fmt: skip
