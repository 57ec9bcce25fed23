"""The deploy package: running an exported PSANet (deploy.yaml, backends, pre/post-processing,
INT8, timing).

``deploy_config`` reads deploy.yaml, ``predictor`` and ``backends`` create Paddle
Inference, onnxruntime and OpenVINO runners (``backend_choice`` times them to pick the
default), ``processing`` turns images into batches and outputs into label maps,
``pipeline`` puts a runner between the two (the deploy half of the Python API),
``infer_images`` runs a Pipeline over
image files (the loop of deploy/python/infer.py and predict.py), ``quantize``
makes the INT8 model, ``timing`` measures the stages. It imports the leaves and
the op library (``psanet.ops.library``) only, never the engine, the models or
export (docs/design.md, "Which way the imports point"); importing this package
loads none of its modules.
"""
