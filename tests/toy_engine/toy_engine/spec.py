"""The toy engine's spec: the transformers engine's, under its own name and class."""

import dataclasses

from stagereplay.engines.transformers.spec import TRANSFORMERS

TOY = dataclasses.replace(
    TRANSFORMERS,
    name="toy",
    summary="the transformers engine under another name (a test's fourth engine)",
    engine_class_path="toy_engine.engine:ToyEngine",
)
