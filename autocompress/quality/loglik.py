"""Log-likelihoods of continuations as lm-evaluation-harness computes them: token pairs, batched forward passes, long inputs split."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from autocompress.quality.tasks import Item

# --------------------------------------------------------------------------- log-likelihoods


Pair = tuple[list[int], list[int]]  # (context ids, continuation ids)
Group = tuple[list[int], list[list[int]]]  # (shared context ids, one continuation per choice)


def encode_pair(tokenizer: Any, context: str, continuation: str) -> Pair:
    """lm-evaluation-harness's split: trailing context spaces move to the continuation; the continuation's ids
    are those of the whole text past the context's (so a merge across the boundary stays in the continuation)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False) if context else []
    if not ctx:  # an empty context: the end-of-text token stands in, as in lm-evaluation-harness
        return [int(getattr(tokenizer, "eos_token_id", 0) or 0)], list(whole)
    return list(ctx), list(whole[len(ctx) :])


def encode_item(tokenizer: Any, item: Item) -> list[Group]:
    """One group (shared context, every continuation) when the choices share their context, else one group per request."""
    pairs = [encode_pair(tokenizer, c, t) for c, t in zip(item.contexts, item.continuations, strict=True)]
    if all(ctx == pairs[0][0] for ctx, _ in pairs):
        return [(pairs[0][0], [cont for _, cont in pairs])]
    return [(ctx, [cont]) for ctx, cont in pairs]


def _row(group: Group, max_length: int) -> tuple[list[int], list[int], list[int]]:
    """Packed row of a group: context, then every continuation but its last token, each attending to the context and itself.

    Returns (ids, position ids, segment per token: -1 context, i continuation i). A context too long for
    `max_length` keeps its last tokens (as lm-evaluation-harness truncates from the left).
    """
    ctx, conts = group
    longest = max(len(c) for c in conts)
    ctx = ctx[-max(1, max_length + 1 - longest) :]
    ids, pos, seg = list(ctx), list(range(len(ctx))), [-1] * len(ctx)
    for i, cont in enumerate(conts):
        ids += cont[:-1]
        pos += range(len(ctx), len(ctx) + len(cont) - 1)
        seg += [i] * (len(cont) - 1)
    return ids, pos, seg


def _mask(segs: list[list[int]], width: int) -> torch.Tensor:
    """Additive mask [b, 1, s, s]: token q sees token k <= q when k is context or in q's segment; padding sees itself."""
    b = len(segs)
    seg = torch.full((b, width), -2, dtype=torch.long)
    for r, row in enumerate(segs):
        seg[r, : len(row)] = torch.tensor(row)
    idx = torch.arange(width)
    causal = idx[None, :] <= idx[:, None]  # [s, s]
    same = (seg[:, None, :] == -1) | (seg[:, None, :] == seg[:, :, None])  # [b, s, s]: key is context or same segment
    allowed = (causal[None] & same & (seg[:, None, :] != -2)) | torch.eye(width, dtype=torch.bool)[None]
    return torch.zeros(b, 1, width, width).masked_fill_(~allowed[:, None], torch.finfo(torch.float32).min)


def _forward_parts(model: Any) -> tuple[Any, Any] | None:
    """(decoder, LM head) when the model exposes them: logits are then computed for continuation positions only."""
    inner, head = getattr(model, "model", None), model.get_output_embeddings()
    return (inner, head) if inner is not None and head is not None else None


@torch.no_grad()
def _score_batch(model: Any, batch: list[Group], max_length: int) -> list[list[tuple[float, bool]]]:
    """Per group, per continuation: (sum log p(continuation | context), every continuation token greedy)."""
    rows = [_row(g, max_length) for g in batch]
    width = max(len(ids) for ids, _, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (row_ids, row_pos, _) in enumerate(rows):
        ids[r, : len(row_ids)], positions[r, : len(row_pos)] = torch.tensor(row_ids), torch.tensor(row_pos)
    mask = _mask([seg for _, _, seg in rows], width)
    where_r, where_p, targets, spans = [], [], [], []
    for r, ((_, conts), (_, _, seg)) in enumerate(zip(batch, rows, strict=True)):
        n_ctx = seg.count(-1)
        for i, cont in enumerate(conts):
            own = [p for p, s in enumerate(seg) if s == i]
            where_r += [r] * len(cont)
            where_p += [n_ctx - 1, *own]  # the last context token predicts the first continuation token
            targets += cont
            spans.append(len(cont))
    which, pos = torch.tensor(where_r), torch.tensor(where_p)
    parts = _forward_parts(model)
    if parts is not None:
        hidden = parts[0](input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).last_hidden_state
        logits = parts[1](hidden[which, pos]).float()  # [T, V]: only the positions that predict a continuation token
    else:
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits[which, pos].float()
    logp = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(targets)
    token_ll, token_greedy = logp.gather(1, target[:, None])[:, 0], logp.argmax(-1) == target
    flat, start = [], 0
    for n in spans:
        flat.append((float(token_ll[start : start + n].sum()), bool(token_greedy[start : start + n].all())))
        start += n
    out, k = [], 0
    for _, conts in batch:
        out.append(flat[k : k + len(conts)])
        k += len(conts)
    return out


def _length(group: Group, max_length: int) -> int:
    return len(_row(group, max_length)[0])


def _split_long(groups: Sequence[Group], max_length: int) -> tuple[list[Group], list[int]]:
    """Groups whose context must be truncated become one group per continuation (each truncated for its own length,
    as lm-evaluation-harness does); returns the work list and the group each entry belongs to."""
    work, owner = [], []
    for g, (ctx, conts) in enumerate(groups):
        parts = [(ctx, [c]) for c in conts] if len(conts) > 1 and len(ctx) + max(map(len, conts)) - 1 > max_length else [(ctx, conts)]
        work += parts
        owner += [g] * len(parts)
    return work, owner


def loglikelihoods(
    model: Any, groups: Sequence[Group], batch_tokens: int = 4096, max_length: int = 2048, desc: str = "", progress: bool = True
) -> list[list[tuple[float, bool]]]:
    """Score every group (longest first, batches of at most `batch_tokens` padded tokens): per continuation (log-likelihood, greedy)."""
    work, owner = _split_long(groups, max_length)
    lengths = [_length(g, max_length) for g in work]
    order = sorted(range(len(work)), key=lambda i: -lengths[i])
    scored: list[list[tuple[float, bool]]] = [[] for _ in work]
    bar = tqdm(total=sum(lengths), desc=desc, unit="tok", disable=not progress, dynamic_ncols=True, leave=False)
    start = 0
    while start < len(order):
        size = max(1, batch_tokens // max(1, lengths[order[start]]))
        chunk = order[start : start + size]
        for i, res in zip(chunk, _score_batch(model, [work[i] for i in chunk], max_length), strict=True):
            scored[i] = res
        bar.update(sum(lengths[i] for i in chunk))
        start += size
    bar.close()
    results: list[list[tuple[float, bool]]] = [[] for _ in groups]
    for g, res in zip(owner, scored, strict=True):
        results[g] += res
    return results
