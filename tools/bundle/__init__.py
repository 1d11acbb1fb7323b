"""Bundle writer helpers: model sizes, weights (random or the reference's), ONNX graphs, tokens, filters.

Used by `ttg make-bundle` (tools/make_bundle.py), `ttg export` (tools/export.py) and the test fixtures.
"""
