"""RNN-T loss (Graves 2012) in plain torch, vectorized over the batch and the label axis.

torchaudio is not installed on the dev machine; on the GPU machine `torchaudio.functional.rnnt_loss`
may exist and the training script checks that both agree before it trusts either.

Forward variable alpha(t, u): log probability of having emitted the first u labels by frame t.

    alpha(0, u) = sum_{j<u} emit(0, j)
    alpha(t, u) = logaddexp(alpha(t-1, u) + blank(t-1, u), alpha(t, u-1) + emit(t, u-1))
    log P(y|x)  = alpha(T-1, U) + blank(T-1, U)

Within one frame the label recursion is a prefix scan; with E(u) = sum_{j<u} emit(t, j) it becomes
alpha(t, u) = E(u) + logcumsumexp_k<=u (alpha(t-1, k) + blank(t-1, k) - E(k)), so each frame is a few
tensor ops over (B, U+1) and autograd gives the gradient. The scan runs in float64: E(u) reaches
thousands of nats on badly aligned frames and float32 would lose the small terms.
"""

from __future__ import annotations

import torch


def rnnt_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int,
    reduction: str = "mean",
) -> torch.Tensor:
    """logits (B, T, U+1, V) raw joint outputs; targets (B, U) int (padding anything); lengths (B,).

    Returns the negative log-likelihood per utterance ("none"), summed ("sum"), or the mean over the
    batch of the per-utterance loss divided by its target length ("mean", as torchaudio's "mean" is
    not: torchaudio averages the plain per-utterance losses; use "mean_batch" for that).
    """
    b, t_max, u1, _ = logits.shape
    if targets.shape[1] + 1 != u1:
        raise ValueError(f"logits have U+1={u1} label positions but targets have U={targets.shape[1]}")
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    blank_lp = log_probs[..., blank].double()  # (B, T, U+1)
    safe_targets = targets.clamp(0, logits.shape[-1] - 1).long()
    emit_lp = torch.gather(log_probs[:, :, :-1, :], 3, safe_targets[:, None, :, None].expand(b, t_max, -1, 1))
    emit_lp = emit_lp.squeeze(-1).double()  # (B, T, U)
    zeros = torch.zeros(b, t_max, 1, dtype=torch.float64, device=logits.device)
    emit_cum = torch.cat([zeros, emit_lp.cumsum(dim=2)], dim=2)  # E(t, u), (B, T, U+1)

    alphas = [emit_cum[:, 0]]
    for t in range(1, t_max):
        from_below = alphas[-1] + blank_lp[:, t - 1]
        alphas.append(emit_cum[:, t] + torch.logcumsumexp(from_below - emit_cum[:, t], dim=1))
    alpha = torch.stack(alphas, dim=1)  # (B, T, U+1)

    batch = torch.arange(b, device=logits.device)
    last_t = (logit_lengths.long() - 1).clamp(min=0)
    last_u = target_lengths.long()
    log_likelihood = alpha[batch, last_t, last_u] + blank_lp[batch, last_t, last_u]
    nll = -log_likelihood.float()
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    if reduction == "mean_batch":
        return nll.mean()
    if reduction == "mean":
        return (nll / target_lengths.clamp(min=1).float()).mean()
    raise ValueError(f"unknown reduction {reduction!r}")


def rnnt_loss_reference(
    logits: torch.Tensor,
    targets: torch.Tensor,
    logit_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int,
) -> torch.Tensor:
    """The textbook double loop (one utterance at a time, python scalars): for tests only."""
    out = []
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    for i in range(logits.shape[0]):
        t_n, u_n = int(logit_lengths[i]), int(target_lengths[i])
        lp = log_probs[i]
        alpha = torch.full((t_n, u_n + 1), float("-inf"), dtype=torch.float64)
        for t in range(t_n):
            for u in range(u_n + 1):
                if t == 0 and u == 0:
                    alpha[t, u] = 0.0
                    continue
                terms = []
                if t > 0:
                    terms.append(alpha[t - 1, u] + lp[t - 1, u, blank])
                if u > 0:
                    terms.append(alpha[t, u - 1] + lp[t, u - 1, int(targets[i, u - 1])])
                alpha[t, u] = torch.logsumexp(torch.stack(terms), dim=0)
        out.append(-(alpha[t_n - 1, u_n] + lp[t_n - 1, u_n, blank]))
    return torch.stack(out).float()
