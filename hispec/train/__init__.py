"""Exits for standard (not early-exit-trained) models, and the tools around them.

One pipeline serves every exit command (``train-exits``, ``collect-exits``, ``distill-exits``):
``config.TrainConfig`` (its one configuration), ``collect`` (sequences: teacher-forced replies or
the engine's own greedy continuations; shards), ``teacher`` (the teacher pass: the model's own
layers through the engine's layer runner), ``distill`` (the one distiller, any exit design).
Beside it: ``sources`` (training text), ``probe`` (per-layer agreement) and ``tune`` (the
speculation tuner).

The base model stays frozen throughout, so the target distribution (and the output of
every lossless strategy) stays exactly the original model's.
"""
