"""A draft model as proposer: any model the engine can load with the target's vocabulary,
running on its own small cache.

Per sequence the draft keeps a state slot and pages covering the sequence's known tokens
(``num_computed`` of them). One :meth:`DraftProposer.propose` step::

    feed   token_ids[num_computed:]       one forward over every sequence (1 + accepted tokens,
                                          or the whole sequence the first time) → d_1
    save   slot → scratch slot            the state of exactly the known tokens
    decode d_1 … d_{m-1}                  m − 1 single-token forwards → d_2 … d_m
    restore scratch → slot                proposals leave no trace in the recurrent state

Latents written for proposed positions lie past ``num_computed`` (never read, overwritten by
the next feed). Greedy rows propose the draft's argmax; sampled rows draw from the draft's
filtered distribution (:func:`~k3serve.engine.spec.accept.draft_sample`) and report it, so
the verifier's rejection sampling stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3serve.cache.manager import CacheManager
from k3serve.cache.pools import KVPools
from k3serve.cache.specs import CacheConfig
from k3serve.cache.types import PrefixHit
from k3serve.config import ModelConfig
from k3serve.engine.runner import ModelRunner, Row, RunBatch
from k3serve.engine.sampler import SamplingRow
from k3serve.engine.sequence import SeqStatus
from k3serve.engine.sequence import Sequence as Seq
from k3serve.engine.spec.accept import draft_sample
from k3serve.engine.spec.proposer import Proposal


class DraftProposer:
    """Proposals from a draft model with its own cache.

    Args:
        model: the draft ``K3ForCausalLM`` (eval mode). model_config: its config.
        vocab_size: the target's vocabulary (must equal the draft's).
        num_slots: most sequences drafted at once. num_pages, block_size: its latent pages.
        dtype, device: of its pools (the model's).

    Raises:
        ValueError: the vocabularies differ.
    """

    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, vocab_size: int,
                 num_slots: int, num_pages: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if model_config.vocab_size != vocab_size:
            raise ValueError(
                f"draft_model: vocabulary {model_config.vocab_size} differs from the target's "
                f"{vocab_size}"
            )
        self.num_slots = num_slots
        self.pools = KVPools(model_config, 2 * num_slots, num_pages, block_size, 0, dtype,
                             device)  # slot s's scratch copy lives in slot s + num_slots
        self.cm = CacheManager(CacheConfig(num_pages, num_slots, 0, block_size, False), "draft")
        self.runner = ModelRunner(model, self.pools, device)
        self.seqs: dict[int, Seq] = {}
        self.computed: dict[int, int] = {}

    def _forget(self, sid: int) -> None:
        self.cm.remove(sid)
        del self.seqs[sid], self.computed[sid]

    def _ready(self, seq: Seq, k: int) -> bool:
        """Admit ``seq`` (first time) and take pages for its feed and ``k − 1`` decodes."""
        sid = seq.seq_id
        if sid not in self.seqs:
            self.cm.add(sid, seq.token_ids, plan_snapshots=False, lookup=False,
                        snapshot_on_finish=False)
            need = len(seq.token_ids) + k - 1
            if not self.cm.can_admit(sid, PrefixHit(0), need):
                self.cm.remove(sid)
                return False
            adm = self.cm.admit(sid, PrefixHit(0), need)
            self.pools.zero_slot(adm.slot)
            self.seqs[sid], self.computed[sid] = seq, 0
            return True
        need = len(seq.token_ids) + k - 1 - self.computed[sid]
        if not self.cm.can_allocate(sid, need):
            return False
        self.cm.allocate(sid, need)
        return True

    def _row(self, seq: Seq, tokens: Sequence[int], num_cached: int) -> Row:
        sid = seq.seq_id
        return Row(list(tokens), num_cached, self.cm.slot(sid), self.cm.block_table(sid))  # type: ignore[arg-type]

    @staticmethod
    def _choose(logits: torch.Tensor, seqs: Sequence[Seq], positions: Sequence[int]) -> tuple[
            list[int], list[torch.Tensor | None]]:
        toks: list[int] = logits.argmax(dim=-1).tolist()
        probs: list[torch.Tensor | None] = [None] * len(seqs)
        rand = [i for i, s in enumerate(seqs) if not s.request.params.is_greedy]
        if rand:
            rows = [SamplingRow(seqs[i].request.params, seqs[i].request.seed, positions[i],
                                seqs[i].choice) for i in rand]  # fmt: skip
            t, q = draft_sample(logits[rand], rows)
            for n, i in enumerate(rand):
                toks[i], probs[i] = t[n], q[n]
        return toks, probs

    @torch.inference_mode()
    def propose(self, seqs: Sequence[Seq], num_tokens: Sequence[int]) -> list[Proposal]:
        for sid in [s for s, q in self.seqs.items() if q.status is not SeqStatus.RUNNING]:
            self._forget(sid)
        live = [i for i, k in enumerate(num_tokens) if k > 0 and self._ready(seqs[i], k)]
        out = [Proposal([]) for _ in seqs]
        if not live:
            return out
        feed = []
        for i in live:
            sid = seqs[i].seq_id
            c = self.computed[sid]
            feed.append(self._row(seqs[i], seqs[i].token_ids[c:], c))
        logits = self.runner.execute(RunBatch(tuple(feed)))
        for i in live:
            sid = seqs[i].seq_id
            n = len(seqs[i].token_ids)
            self.cm.commit(sid, seqs[i].token_ids, n - self.computed[sid])
            self.computed[sid] = n
            slot = self.cm.slot(sid)
            self.pools.copy_slot(slot, slot + self.num_slots)  # type: ignore[operator]
        toks: dict[int, list[int]] = {i: [] for i in live}
        probs: dict[int, list[torch.Tensor | None]] = {i: [] for i in live}
        act = live
        for j in range(max(num_tokens[i] for i in live)):
            pos = [len(seqs[i].token_ids) + j for i in act]
            t, q = self._choose(logits, [seqs[i] for i in act], pos)
            for n, i in enumerate(act):
                toks[i].append(t[n])
                probs[i].append(q[n])
            act = [i for i in act if num_tokens[i] > j + 1]
            if not act:
                break
            rows = [self._row(seqs[i], [toks[i][-1]], len(seqs[i].token_ids) + j) for i in act]
            logits = self.runner.execute(RunBatch(tuple(rows)))
        for i in live:
            slot = self.cm.slot(seqs[i].seq_id)
            self.pools.copy_slot(slot + self.num_slots, slot)  # type: ignore[operator]
            ps = probs[i]
            dist = None if ps[0] is None else torch.stack(ps)  # type: ignore[arg-type]
            out[i] = Proposal(toks[i], dist)
        return out


__all__ = ["DraftProposer"]
