"""Cloud-side machine learning (DESIGN §5): :mod:`cloud.ml.train` trains and exports the small digits models
(``[train]`` extra: torch, scikit-learn, onnx); :mod:`cloud.ml.partition` cuts an ONNX model into a device head
and an edge tail and profiles the parts (``[hub]`` extra: onnx; ONNX Runtime for profiling). Nothing is imported
here, so that importing one does not load the other's dependencies."""
