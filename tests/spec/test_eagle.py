"""The EAGLE-style head: training learns the target's greedy tokens, saved heads load back
identically, incremental drafting equals the training-time forward, and the engine runs with
`drafter=eagle:DIR` (lookahead and speculative acceptance)."""


import pytest
import torch
from conftest import MARKOV_CHUNK
from conftest import markov_corpus as corpus

from oasiskv import LLM, SamplingParams
from oasiskv.config import EngineConfig
from oasiskv.engine.engine import LLMEngine
from oasiskv.spec.drafters import make_drafter
from oasiskv.spec.eagle import EagleConfig, EagleHead, load_head
from oasiskv.train.drafter import (
    draft_vocabulary,
    evaluate,
    head_loss,
    in_loop,
    noisy,
    target_hidden,
    target_to_draft,
    train_head,
)
from oasiskv.train.features import load_shards, own_continuations, target_features
from oasiskv.train.spec import TrainSpec


@pytest.fixture
def trained(tiny_eagle):
    return tiny_eagle


def test_training_reduces_loss_and_beats_unigram(trained):
    _, result = trained
    held = result["heldout"]
    assert result["loss_last"] < 0.8 * result["loss_first"]
    assert held["greedy_accuracy"] > held["unigram_accuracy"] + 0.25, held
    assert 0 < held["sampled_accuracy"] <= 1
    # the learning curve: one held-out figure per epoch, ending at the final head's
    curve = result["heldout_by_epoch"]
    assert len(curve) == 12 and curve[-1] == held["greedy_accuracy"]
    assert curve[0] < curve[-1]


def test_accuracy_by_target_confidence_splits_the_held_out_rows(trained, tiny_llama):
    out, result = trained
    assert result["heldout"]["by_confidence"][0]["target_p"] == "[0.0, 0.3)"
    held = load_shards(sorted((out / "features").glob("heldout_0*.safetensors")))
    head = load_head(out, LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama))).model)
    # the tiny target is never sure, so give its rows confidences cycling through the bins
    confidence = torch.tensor([0.1, 0.4, 0.6, 0.8, 0.95, 1.0])
    n = held["top_logp"].shape[1]
    cycle = torch.arange(n) % len(confidence)  # [S] which confidence position p gets
    held["top_logp"][:, :, 0] = confidence[cycle].log()
    bins = evaluate(head, held)["by_confidence"]
    assert [b["target_p"] for b in bins] == ["[0.0, 0.3)", "[0.3, 0.5)", "[0.5, 0.7)",
                                             "[0.7, 0.9)", "[0.9, 1.0]"]
    # rows p >= 1: draft right where the head's argmax is the target's greedy token
    tokens, features, greedy = held["tokens"][:, 1:].long(), held["features"][:, :-1], (
        held["greedy"][:, 1:].long())
    hidden, _ = head(tokens, features.float(), torch.arange(1, n))
    right = head.d2t[head.logits(hidden).argmax(-1)] == greedy  # [C, S-1]
    rows_cycle = cycle[1:].expand_as(right)
    for k, members in enumerate([[0], [1], [2], [3], [4, 5]]):
        in_bin = torch.isin(rows_cycle, torch.tensor(members))
        assert bins[k]["share"] == pytest.approx(in_bin.float().mean().item())
        assert bins[k]["greedy_accuracy"] == pytest.approx(right[in_bin].float().mean().item())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_training_learns_in_either_autocast_dtype(trained, tiny_llama, dtype):
    out, _ = trained
    data, _, head = tiny_head(out, tiny_llama)
    spec = TrainSpec(model="tiny", out=out, chunk=MARKOV_CHUNK, self_prompt=1, epochs=6,
                     lr=3e-3, train_dtype=dtype, quiet=True)
    assert spec.autocast_dtype == getattr(torch, dtype)
    losses, curve = train_head(head, data, spec)
    assert curve == [] and sum(losses[-5:]) < 0.8 * sum(losses[:5])


def tiny_head(out, tiny_llama, aux_layers=(0, 1)):
    """(training data, target, an untrained head) on the trained fixture's features."""
    data = load_shards(sorted((out / "features").glob("train_0*.safetensors")))
    target = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama))).model
    d2t = draft_vocabulary(data["greedy"], 256)
    cfg = EagleConfig.for_target("tiny", target.config, len(d2t), list(aux_layers),
                                 MARKOV_CHUNK)
    torch.manual_seed(0)
    return data, target, EagleHead(cfg, target.model.embed_tokens.weight,
                                   target.lm_head.weight, d2t)


def test_target_hidden_is_what_the_targets_lm_head_reads(trained, tiny_llama):
    out, _ = trained
    data, target, _ = tiny_head(out, tiny_llama)
    # the engine's greedy tokens, recorded apart from the features, come back from them
    logits = target.lm_head(target_hidden(target, data["features"][:4]))
    agree = (logits.argmax(-1) == data["greedy"][:4]).float().mean().item()
    assert agree > 0.99  # fp16 features may flip a near tie


def test_soft_and_feature_losses_vanish_when_the_head_is_the_target(trained, tiny_llama):
    out, _ = trained
    data, target, head = tiny_head(out, tiny_llama)
    t2d = target_to_draft(head)
    goal = target_hidden(target, data["features"][:2, 1:])  # [2, S-1, D]
    greedy = data["greedy"][:2, 1:].long()
    logits = head.logits(goal)
    spec = TrainSpec(model="tiny", out=out, soft_weight=1.0, feature_weight=2.0)
    cross_entropy = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), t2d[greedy].flatten())
    torch.testing.assert_close(head_loss(head, logits, goal, greedy, t2d, spec, goal),
                               cross_entropy)
    # a head off by a known amount: smooth L1 of a constant 0.5 shift is 0.5^2 / 2 = 0.125
    plain = head_loss(head, logits, goal, greedy, t2d, spec, None)
    shifted = head_loss(head, logits, goal + 0.5, greedy, t2d, spec, goal)
    torch.testing.assert_close(shifted - plain, torch.tensor(2.0 * 0.125))


def test_distilled_training_learns_and_beats_unigram(trained, tiny_llama):
    out, _ = trained
    data, target, head = tiny_head(out, tiny_llama)
    heldout = load_shards([out / "features" / "heldout_00000.safetensors"])
    spec = TrainSpec(model="tiny", out=out, chunk=MARKOV_CHUNK, self_prompt=1, epochs=6,
                     lr=3e-3, soft_weight=1.0, feature_weight=1.0, quiet=True)
    losses, curve = train_head(head, data, spec, heldout, target)
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])
    assert curve[-1]["greedy_accuracy"] > curve[-1]["unigram_accuracy"] + 0.25, curve[-1]


def test_feature_noise_is_bounded_by_each_layers_rms():
    gen = torch.Generator().manual_seed(0)
    # two aux layers of width 4: RMS 2 (values +-2) and RMS 10 (constant 10)
    features = torch.cat([torch.tensor([2.0, -2.0, 2.0, -2.0]).expand(3, 50, 4),
                          torch.full((3, 50, 4), 10.0)], dim=-1)
    shift = noisy(features, 0.2, 4, gen) - features
    low, high = shift[..., :4].abs(), shift[..., 4:].abs()
    assert low.max() <= 0.2 * 2 and low.max() > 0.9 * 0.2 * 2
    assert high.max() <= 0.2 * 10 and high.max() > 0.9 * 0.2 * 10
    assert abs(shift[..., 4:].mean().item()) < 0.1  # zero-mean: U(-2, 2) over 600 draws
    assert torch.equal(noisy(features, 0.0, 4, gen), features)


def test_regularised_training_learns_with_smaller_weights(trained, tiny_llama):
    out, _ = trained
    heldout = load_shards([out / "features" / "heldout_00000.safetensors"])
    norms = {}
    for decay in (0.0, 2.0):
        data, target, head = tiny_head(out, tiny_llama)
        spec = TrainSpec(model="tiny", out=out, chunk=MARKOV_CHUNK, self_prompt=1, epochs=6,
                         lr=3e-3, weight_decay=decay, feature_noise=0.2, quiet=True)
        losses, curve = train_head(head, data, spec, heldout)
        assert sum(losses[-5:]) < 0.8 * sum(losses[:5])
        assert curve[-1]["greedy_accuracy"] > curve[-1]["unigram_accuracy"] + 0.25, curve[-1]
        norms[decay] = head.fc.weight.norm().item()
    assert norms[2.0] < 0.8 * norms[0.0], norms  # 0.68 here


def test_distillation_needs_the_targets_last_layer(trained, tiny_llama):
    out, _ = trained
    data, target, head = tiny_head(out, tiny_llama, aux_layers=(0,))
    spec = TrainSpec(model="tiny", out=out, soft_weight=1.0, quiet=True)
    with pytest.raises(ValueError, match=r"target's last layer \(1\) as the last aux layer"):
        train_head(head, data, spec, target=target)
    for name in ("feature_weight", "weight_decay", "feature_noise"):
        with pytest.raises(ValueError, match=f"{name} must be >= 0"):
            TrainSpec(model="m", out=out, **{name: -1})


def test_bad_train_dtype_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="train_dtype must be auto, float32 or bfloat16"):
        TrainSpec(model="m", out=tmp_path, train_dtype="float16")


def test_features_are_resumable_and_match_the_target(trained, tiny_llama):
    out, _ = trained
    shard = load_shards([out / "features" / "heldout_00000.safetensors"])
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama)))
    again = target_features(engine, shard["tokens"][0].tolist(), (0, 1), heldout=True)
    torch.testing.assert_close(again["features"], shard["features"][0])
    assert torch.equal(again["greedy"], shard["greedy"][0])
    # greedy = the target's own next-token argmax from the engine's dense prefill
    llm = LLM(str(tiny_llama))
    ids = shard["tokens"][0, :20].tolist()
    first = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                         use_tqdm=False)[0].token_ids[0]
    assert first == int(shard["greedy"][0, 19])


def test_own_continuations_are_the_targets_text_and_resume(trained, tiny_llama):
    out, result = trained
    prompt = MARKOV_CHUNK // 3
    held = load_shards([out / "features" / "heldout_own_00000.safetensors"])
    novel = load_shards([out / "features" / "heldout_00000.safetensors"])
    tokens, greedy = held["tokens"].long(), held["greedy"].long()
    assert torch.equal(tokens[:, :prompt], novel["tokens"][:, :prompt].long())
    # even chunks are greedy decoding: the target's argmax is the next token it wrote
    assert torch.equal(greedy[0::2, prompt - 1:-1], tokens[0::2, prompt:])
    # odd chunks are sampled at T=0.7: they leave the argmax somewhere
    assert not torch.equal(greedy[1::2, prompt - 1:-1], tokens[1::2, prompt:])
    # the figures count the generated rows only, half the held-out chunks each
    rows = len(novel["tokens"]) // 2 * (MARKOV_CHUNK - prompt)
    assert result["heldout_own_greedy"]["rows"] == result["heldout_own_sampled"]["rows"] == rows
    # greedy accuracy by hand: the draft of row p (x_p known) against the token the target
    # wrote next
    head = load_head(out, LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama))).model)
    t, f = tokens[0::2], held["features"][0::2].float()
    hidden, _ = head(t[:, 1:], f[:, :-1], torch.arange(1, MARKOV_CHUNK))
    draft = head.d2t[head.logits(hidden).argmax(-1)][:, prompt - 1:]
    wrote = torch.cat([t[:, prompt + 1:], greedy[0::2, -1:]], dim=1)
    assert result["heldout_own_greedy"]["greedy_accuracy"] == pytest.approx(
        (draft == wrote).float().mean().item())
    assert result["own_tokens"] == 16 * MARKOV_CHUNK
    assert len(list((out / "features").glob("own_*.safetensors"))) >= 2  # text + features

    class NoEngine:  # a resumed run reads the cached text and generates nothing
        def add_request(self, *args, **kwargs):
            raise AssertionError("generated again")

    spec = TrainSpec(model=str(tiny_llama), out=out, chunk=MARKOV_CHUNK, self_prompt=prompt,
                     quiet=True)
    prompts = [c[:prompt] for c in novel["tokens"].tolist()]
    assert own_continuations(NoEngine(), spec, "heldout_own", prompts) == tokens.tolist()
    # cached text of other prompts is not taken for these
    prompts[-1] = prompts[-1][::-1]
    with pytest.raises(AssertionError, match="generated again"):
        own_continuations(NoEngine(), spec, "heldout_own", prompts)


def test_in_loop_marks_repeated_ngrams():
    tokens = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4, 5], [7, 7, 7, 7, 7, 7, 1, 1, 1]])
    assert in_loop(tokens, n=4).int().tolist() == [[0, 0, 0, 0, 0, 0, 0, 1, 0],
                                                   [0, 0, 0, 0, 1, 1, 0, 0, 0]]


def heldout_drafter(name: str, out, tiny_llama):
    """A drafter from the trained head, the first held-out chunk (tokens, features) and the
    head's batch (training) forward drafts over it: drafts[p-1] guesses x_{p+1}."""
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama)))
    drafter = make_drafter(f"{name}:{out}", target=engine.model)
    data = load_shards([out / "features" / "heldout_00000.safetensors"])
    tokens, feats = data["tokens"][0].tolist(), data["features"][0].float()
    hidden, _ = drafter.head(torch.tensor(tokens[1:])[None], feats[None, :-1],
                             torch.arange(1, len(tokens)))
    drafts = drafter.head.d2t[drafter.head.logits(hidden[0]).argmax(-1)].tolist()
    return drafter, engine, tokens, feats, drafts


def test_saved_head_drafts_identically_and_incremental_equals_batch(trained, tiny_llama):
    out, _ = trained
    drafter, engine, tokens, feats, batch_drafts = heldout_drafter("eagle", out, tiny_llama)
    # incremental, as in the engine: observe a prompt, then one position per step
    drafter.observe("r", 0, feats[:20])
    drafts = [drafter.propose(tokens[:21], None, None, 1, "r")[0]]
    for p in range(20, len(tokens) - 1):
        drafter.observe("r", p, feats[p:p + 1])
        drafts.append(drafter.propose(tokens[:p + 2], None, None, 1, "r")[0])
    assert drafts == batch_drafts[19:]
    # the reloaded head (a second drafter from the same directory) drafts identically
    again = make_drafter(f"eagle:{out}", target=engine.model)
    again.observe("r", 0, feats[:40])
    assert again.propose(tokens[:41], None, None, 1, "r") == [batch_drafts[39]]
    # with their probabilities under the head (over its draft vocabulary)
    guesses, probs = again.propose_weighted(tokens[:41], None, None, 2, "r")
    top = torch.softmax(again.states["r"].logits, -1).topk(2)
    assert guesses == again.head.d2t[top.indices].tolist() and guesses[0] == batch_drafts[39]
    assert probs == pytest.approx(top.values.tolist())


def test_resync_eagle_chains_while_right_and_asks_the_caught_up_head_after_a_miss(
        trained, tiny_llama):
    out, _ = trained
    drafter, engine, tokens, feats, batch_drafts = heldout_drafter("resync-eagle", out,
                                                                   tiny_llama)
    drafter.observe("r", 0, feats[:20])
    assert drafter.propose(tokens[:21], None, None, 1, "r") == [batch_drafts[19]]
    g = torch.Generator().manual_seed(0)
    for p in range(20, len(tokens) - 1):
        drafter.observe("r", p, feats[p:p + 1])
        logits = torch.randn(engine.model_config.vocab_size, generator=g)
        if p % 3:  # the previous draft was right: the chain's guess, the head is skipped
            got = drafter.propose(tokens[:p + 2], logits, tokens[p + 1], 1, "r")
            assert got == [int(logits.argmax())]
        else:  # a miss: the head, caught up on the rows it skipped
            got = drafter.propose(tokens[:p + 2], logits, -1, 1, "r")
            assert got == [batch_drafts[p]], p


def test_window_limits_what_a_row_sees(tiny_llama):
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama)))
    mc, target = engine.model_config, engine.model
    cfg = EagleConfig.for_target("tiny", mc, 50, [1], window=8)
    torch.manual_seed(0)
    head = EagleHead(cfg, target.model.embed_tokens.weight, target.lm_head.weight,
                     torch.arange(50)).eval()
    tokens = torch.randint(0, 50, (1, 30))
    feats = torch.randn(1, 30, cfg.feature_size)
    full, _ = head(tokens, feats, torch.arange(30))
    # the last row sees rows 22..29 only: the same output from those rows alone
    tail, _ = head(tokens[:, 22:], feats[:, 22:], torch.arange(22, 30))
    torch.testing.assert_close(full[0, -1], tail[0, -1], atol=1e-5, rtol=1e-5)
    short, _ = head(tokens[:, 23:], feats[:, 23:], torch.arange(23, 30))
    assert not torch.allclose(full[0, -1], short[0, -1], atol=1e-4)


def test_engine_drafts_are_the_heads_and_acceptance_keeps_greedy_output(trained, tiny_llama,
                                                                       test_device):
    """On OASISKV_TEST_DEVICE (conftest): the head and its state on the target's device."""
    out, _ = trained
    prompts = corpus(3, 5)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = LLM(str(tiny_llama), device=test_device).generate(prompts, greedy, use_tqdm=False)
    llm = LLM(str(tiny_llama), drafter=f"eagle:{out}", speculative="accept", device=test_device)
    drafter = llm.engine.drafter
    device = llm.engine.device
    assert all(t.device.type == device.type for t in drafter.head.state_dict().values())
    proposed: dict[str, dict[int, int]] = {}
    propose = drafter.propose_weighted

    def record(tokens, draft_logits, prev, num=1, request_id=""):
        guess = propose(tokens, draft_logits, prev, num, request_id)
        proposed.setdefault(request_id, {})[len(tokens)] = guess[0][0]
        return guess

    drafter.propose_weighted = record
    got = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert llm.stats()["spec_accepted"] > 0
    for o in got:  # the head's batch forward over the final text gives the same drafts
        tokens = o.prompt_token_ids + o.token_ids
        feats = target_features(llm.engine, tokens, drafter.feature_layers, False)["features"]
        head = drafter.head
        hidden, _ = head(torch.tensor(tokens[1:], device=device)[None],
                         feats[None, :-1].float(), torch.arange(1, len(tokens), device=device))
        batch = head.d2t[head.logits(hidden[0]).argmax(-1)].tolist()  # batch[p-1] guesses x_{p+1}
        mine = proposed[o.request_id]
        assert len(mine) >= 12
        assert all(mine[n] == batch[n - 2] for n in mine), (mine, batch)


@pytest.mark.parametrize("mode", [dict(), dict(speculative="accept")])
def test_sparse_lookahead_with_the_head_decodes_like_dense(trained, tiny_llama, mode):
    """top_k=5 covers every block (48 + 24 tokens: 4 complete ones and the active one), so
    sparse decoding with the head's drafts must give dense greedy's tokens."""
    out, _ = trained
    prompts = corpus(3, 5)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    dense = LLM(str(tiny_llama)).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_llama), drafter=f"eagle:{out}", kv_mode="sparse", top_k=5, f_hbm=0.5,
              **mode)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in dense]
    stats = llm.stats()
    assert stats["drafts"] > 0 and stats["drafts_right"] > 0
    assert stats["sparse_predicted"] > 0
    assert (stats["spec_accepted"] > 0) == bool(mode)


def test_bad_head_directory_is_a_clear_error(tmp_path, tiny_llama):
    with pytest.raises(ValueError, match="holds no trained head"):
        LLM(str(tiny_llama), drafter=f"eagle:{tmp_path}", kv_mode="sparse")


def test_a_loaded_head_follows_the_targets_device(trained, tiny_llama):
    """Checkable without a GPU: a target on the meta device gets a head whose own weights
    (read from the file on the CPU) and buffers are all on the meta device too."""
    from oasiskv.models.llama import LlamaForCausalLM

    out, _ = trained
    mc = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama))).model_config
    with torch.device("meta"):
        target = LlamaForCausalLM(mc)
    head = load_head(out, target)
    placed = {name: t.device.type for name, t in [*head.named_parameters(),
                                                  *head.named_buffers()]}
    assert set(placed.values()) == {"meta"}, placed
