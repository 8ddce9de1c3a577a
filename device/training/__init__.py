"""On-device training without an ML framework (DESIGN §5, standard 6.3.2 a-c): numpy only.

* :mod:`device.training.dpsgd`: DP-SGD for a softmax classifier's last dense layer (closed-form
  per-example gradients, clipping, Gaussian noise, Poisson sampling).
* :mod:`device.training.features`: the frozen body of a model run with ONNX Runtime over local data.

The ``incremental_training`` worker program (:mod:`device.tasks.incremental`) puts them together.
"""
