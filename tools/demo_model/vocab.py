"""The demo model's SentencePiece vocabulary (its tokens.txt is written by `ttg export`, package.py).

Unigram, no byte fallback, `nmt_nfkc` (like the published model's tokenizer), trained on the training
split's labels only. Piece ids 0..N-1 come from SentencePiece (0 = `<unk>`, no BOS/EOS); the RNN-T blank
is one more id after them, N, written last in tokens.txt — as in the real model (blank = vocab_size - 1).
"""

from __future__ import annotations

import io
from pathlib import Path

import sentencepiece as spm


def train_sentencepiece(text_file: Path, model_path: Path, pieces: int) -> spm.SentencePieceProcessor:
    """Train a unigram model with `pieces` pieces (ids 0..pieces-1) and save it to `model_path`."""
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        input=str(text_file),
        model_writer=proto,
        model_type="unigram",
        vocab_size=pieces,
        character_coverage=1.0,
        byte_fallback=False,
        normalization_rule_name="nmt_nfkc",
        unk_id=0,
        bos_id=-1,
        eos_id=-1,
        pad_id=-1,
        split_digits=False,
        hard_vocab_limit=True,
        num_threads=1,
        minloglevel=2,
    )
    model_path.parent.mkdir(parents=True, exist_ok=True)
    model_path.write_bytes(proto.getvalue())
    return spm.SentencePieceProcessor(model_proto=proto.getvalue())
