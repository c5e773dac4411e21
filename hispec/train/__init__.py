"""Exit-head training for standard (not early-exit-trained) models: data sources, a
hidden-state cache, distillation, a layer probe and a speculation tuner.

The base model stays frozen throughout, so the target distribution (and the output of
every lossless strategy) stays exactly the original model's.
"""
