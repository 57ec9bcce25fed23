"""What the model does, as pictures, drawn with OpenCV.

- :mod:`psanet.visualize.attention`: PSANet's attention at chosen pixels, captured
  while the model runs and drawn over the image (tools/visualize_attention.py).
- :mod:`psanet.visualize.charts`: an evaluation's per-class IoU chart and
  confusion matrix (val.py --save_dir, training's VisualDL log).
- :mod:`psanet.visualize.drawing`: what both share: font, colours, text, stacking and
  scaling images, heat map, marker, legend, writing a PNG.

Importing this package loads none of them; they import nothing of the engine,
the models or paddleseg.
"""
