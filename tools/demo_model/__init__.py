"""The embedded demo model: corpus (espeak-ng call-centre speech), vocabulary, training, packaging.

Modules used by the training script on the GPU machine (`data`, `g711`, `augment`, `frontend`,
`rnnt_loss`, `model`, `train`) import only numpy, torch, transformers, safetensors and sentencepiece,
and from the repository only numpy-only modules (`gateway.audio.g711`, `tools.bundle.spec`).
See docs/demo-model.md.
"""
