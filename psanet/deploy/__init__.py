"""The runtime of an exported PSANet: deploy.yaml, predictors, pre/post-processing, timing.

``config`` reads deploy.yaml, ``predictor`` and ``runtimes`` create Paddle
Inference, onnxruntime and OpenVINO runners, ``processing`` turns images into
batches and outputs into label maps, ``segmenter`` puts a runner between the
two (the Python API's runtime half), ``infer_images`` runs a Segmenter over
image files (the loop of deploy/python/infer.py and predict.py), ``quantize``
makes the INT8 model, ``timing`` measures the stages. It imports the leaves
(``psanet.compat``, ``contract``, ``errors``, ``interrupts``, ``log``) and the
op loader only, never the engine, the models or export; importing this
package loads none of its modules.
"""
