"""DP incremental training on devices, the hub's side (DESIGN §5, standard 6.3.2 c 3 and 7.3.1 d).

::

    POST /tasks incremental_training
        -> task.admit            targets, model cut (surgery), budgets checked and reserved (budgets, accounting)
    scheduler places a worker    only on devices holding a reservation; its order carries the body, the layer, max_steps
        device trains (DP-SGD)   device.tasks.incremental
    task.output                  -> results.accept (the trained layer, kept once)
    worker ends                  -> task.worker_ended (reservation settled with the steps taken)
    scheduler tick               -> results.publish (new model version: signed artefact, deployable)

* :mod:`.accounting`: ε of DP-SGD runs with dp_accounting's RDP accountant.
* :mod:`.surgery`: the last dense layer of an ONNX model, the frozen body, the trained layer put back.
* :mod:`.budgets`: privacy budgets and spends in the database; the REST service.
* :mod:`.task`: the task type's rules at admission, placement, and the ends of workers and tasks.
* :mod:`.results`: trained layers received and published.
"""
