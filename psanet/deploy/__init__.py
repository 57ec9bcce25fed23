"""The runtime of an exported PSANet: deploy.yaml, predictors, pre/post-processing, timing.

``config`` reads deploy.yaml, ``predictor`` creates Paddle Inference (or
onnxruntime) runners, ``processing`` turns images into batches and outputs
into label maps, ``infer_images`` runs a model over image files (the work of
deploy/python/infer.py), ``timing`` measures the stages. It imports the
leaves (``psanet.compat``, ``contract``, ``errors``, ``interrupts``, ``log``)
and the op loader only, never paddleseg, the engine, the models or export;
importing this package loads none of its modules.
"""
