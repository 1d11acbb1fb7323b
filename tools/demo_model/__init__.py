"""The embedded demo model: corpus (espeak-ng call-centre speech), vocabulary, training, packaging.

Modules used by the training script on the GPU machine (`data`, `g711`, `augment`, `frontend`,
`rnnt_loss`, `model`, `train`) import only numpy, torch, transformers, safetensors and sentencepiece.
See docs/demo-model.md.
"""
