"""Pretrained weights (``PrepConfig.weights``) read straight into each rank's shards.

``source`` reads the files' headers into a ``WeightsSnapshot`` while planning (``header`` parses
and checks one header); ``plan`` matches it against the model, purely, into a ``WeightsPlan``
(byte ranges per parameter); the ``load_weights`` step (``fprep.apply.load_weights``) reads
them. See docs/finetune.md.
"""

from fprep.weights.records import TensorRead, WeightsPlan, WeightsSnapshot, WeightsTensor

__all__ = ["TensorRead", "WeightsPlan", "WeightsSnapshot", "WeightsTensor"]
