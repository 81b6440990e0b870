"""After every speculative step the slot's KDA and conv states and the sequence's latents hold
exactly the accepted tokens: equal to the plain decode run's at the same length."""

from __future__ import annotations

import torch

from k3serve.engine.spec import Proposal, SpecConfig
from k3serve.engine.spec.draft import DraftProposer
from k3serve.sampling import SamplingParams
from tests.spec.helpers import make_engine, repo_prompts, run

K = 4


class Disagree:
    """A draft that always disagrees with the target: the target's own greedy tokens,
    each shifted by one id (acceptance 0)."""

    def __init__(self, inner: DraftProposer, vocab: int):
        self.inner, self.vocab = inner, vocab

    def propose(self, seqs, num_tokens):
        props = self.inner.propose(seqs, num_tokens)
        return [Proposal([(t + 1) % self.vocab for t in p.tokens]) for p in props]


def states(engine) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``num_computed → (kda, conv, latents[0:num_computed])`` of the engine's one sequence."""
    out = {}
    for req in engine.requests.values():
        seq = req.seqs[0]
        slot = engine.cm.slot(seq.seq_id)
        if slot is None or seq.is_prefill:
            continue
        pools, B, nc = engine.pools, engine.config.block_size, seq.num_computed
        pages = engine.cm.block_table(seq.seq_id)[: -(-nc // B)]
        lat = pools.mla_latent[:, pages].reshape(pools.mla_latent.shape[0], -1,
                                                 pools.mla_latent.shape[-1])[:, :nc]
        out[nc] = (pools.kda_state[:, slot].clone(), pools.conv_state[:, slot].clone(),
                   lat.clone())
    return out


def _trace(engine, prompt, params) -> dict:
    seen: dict = {}
    run(engine, [prompt], params, step_hook=lambda e: seen.update(states(e)))
    return seen


def test_states_equal_plain_decode_for_rejecting_and_accepting_drafts(tiny):
    net, cfg, _ = tiny
    prompt = repo_prompts(tiny[2], 1, 40, 41)[0]
    params = SamplingParams(temperature=0, max_tokens=20)
    ref = _trace(make_engine(tiny), prompt, params)
    sc = SpecConfig("draft", K, draft_model="k3-tiny", cost_per_token=0.0)
    for name, mk in (
        ("disagree", lambda: Disagree(DraftProposer(net, cfg, cfg.vocab_size, 4, 64, 16),
                                      cfg.vocab_size)),
        ("self", lambda: DraftProposer(net, cfg, cfg.vocab_size, 4, 64, 16)),
    ):
        eng = make_engine(tiny, sc, proposer=mk())
        got = _trace(eng, prompt, params)
        st = eng.spec.stats
        if name == "disagree":
            assert st.proposed > 0 and st.accepted == 0
        else:
            assert st.accepted == st.proposed > 0 and st.emitted > st.rows
        assert set(got) <= set(ref) and len(got) >= 3
        for nc, (kda, conv, lat) in got.items():
            rk, rc, rl = ref[nc]
            for what, a, b in (("kda", kda, rk), ("conv", conv, rc), ("latent", lat, rl)):
                err = (a - b).abs().max().item()
                assert err <= 1e-5, f"{name} at {nc} tokens: {what} max-abs {err}"
