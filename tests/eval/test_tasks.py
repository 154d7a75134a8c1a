"""Fidelity tasks: hand-made answers score as the rules say, prompts are a function of the
seed, needles land at the asked depths, prompts have the asked length, chat templates wrap."""

import random

import pytest
from conftest import build_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from oasiskv.eval import tasks as T
from oasiskv.eval.tasks import (
    KINDS,
    make_task,
    needle_task,
    passkey_task,
    score,
)

WORDS = ("the a of and to her his was she he it that with for not but had be as on at by "
         "sister letter morning house family brother evening father mother garden walk "
         "visit friend party ball carriage dinner room window estate fortune manner "
         "opinion affection reason heart pleasure happiness delight conversation gentleman "
         "lady young old good great little very much never always quite certainly "
         "indeed perhaps soon said replied thought felt knew could would should might "
         "must every other such own same long first last dear poor kind civil").split()


def synthetic_text(seed: int = 0, paragraphs: int = 160) -> str:
    """Prose-like filler without digits: sentences of common words, hard-wrapped at ~70
    characters like the Gutenberg text, blank lines between paragraphs."""
    rng = random.Random(seed)
    out = []
    for _ in range(paragraphs):
        sentences = []
        for _ in range(rng.randint(2, 6)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(6, 22))]
            end = rng.choice([".", ".", ".", "!", "?", ";\"", "."])
            sentences.append(" ".join(words).capitalize() + end)
        para, line = [], ""
        for word in " ".join(sentences).split():
            if len(line) + len(word) > 70:
                para.append(line)
                line = word
            else:
                line = f"{line} {word}".strip()
        para.append(line)
        out.append("\n".join(para))
    return "\n\n".join(out)


TEXT = synthetic_text()
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n"
                 "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def wide_tok():
    """A tokenizer trained on the filler and the task templates, so the instructions take few
    tokens of the prompt (as with a real model's vocabulary)."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    templates = [T.PASSKEY_HEADER, T.PASSKEY_QUESTION, T.NEEDLE_HEADER, T.NEEDLE_QUESTION,
                 T.NEEDLE_ANSWER_PREFIX, T.MULTIVALUE_QUESTION, T.MULTIVALUE_ANSWER_PREFIX,
                 T.NEEDLE_TEXT, T.PASSKEY_NEEDLE] * 20
    t.train_from_iterator([*TEXT.split("\n\n"), *templates], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def chat_tok():
    t = build_tokenizer()
    t.chat_template = CHAT_TEMPLATE
    return t


def task(tokenizer, kind, context=600, depth=0.5, seed=0, **kw):
    return make_task(kind, tokenizer, context, depth, seed, text=TEXT, **kw)


# ---- scoring -------------------------------------------------------------------------------


def test_passkey_scores_hand_made_answers(tok):
    t = task(tok, "passkey")
    key = t.answers[0]
    assert len(key) == 5 and key.isdigit() and t.kind == "passkey"
    assert score(t, key) == 1.0
    assert score(t, f" {key}.") == 1.0
    assert score(t, f"The pass key is {key}. Remember it.") == 1.0          # containment
    assert score(t, f"The pass key is {key[:2]},{key[2:]}!") == 1.0          # "48,213"
    assert score(t, f"it is {key[:2]} {key[2:]}") == 1.0                     # "48 213"
    assert score(t, f"{key}0") == 0.0                                        # another number
    assert score(t, f"0{key}") == 0.0
    wrong = str((int(key) - 10000 + 1) % 90000 + 10000)
    assert score(t, f"The pass key is {wrong}.") == 0.0
    assert score(t, "") == 0.0
    assert score(t, "I do not know.") == 0.0
    # Exact rule: the output is the answer and nothing else (spaces, final period, separators).
    assert score(t, key, rule="exact") == 1.0
    assert score(t, f"  {key}.\n", rule="exact") == 1.0
    assert score(t, f"{key[:2]},{key[2:]}", rule="exact") == 1.0
    assert score(t, f"The pass key is {key}.", rule="exact") == 0.0


@pytest.mark.parametrize("kind", ["single", "multikey"])
def test_needle_scores_hand_made_answers(tok, kind):
    t = task(tok, kind)
    value = t.answers[0]
    assert len(t.answers) == 1 and len(value) == 7 and value.isdigit()
    assert score(t, f"{t.answer_prefix} {value}.") == 1.0
    assert score(t, f"{value[0]},{value[1:4]},{value[4:]}") == 1.0        # "1,234,567"
    assert score(t, value, rule="exact") == 1.0
    assert score(t, value[:-1]) == 0.0
    if kind == "multikey":  # a distractor's value is wrong
        assert score(t, t.needles[1].value) == 0.0


def test_multivalue_scores_fraction_found(tok):
    t = task(tok, "multivalue")
    vals = t.answers
    assert len(vals) == 4 and len(set(vals)) == 4
    assert score(t, ", ".join(vals)) == 1.0
    assert score(t, " and ".join(reversed(vals)) + ".") == 1.0
    assert score(t, f"{vals[0]}, {vals[2]}") == 0.5
    assert score(t, f"The numbers are {vals[1]}, 123 and so on.") == 0.25
    assert score(t, "none") == 0.0
    grouped = ", ".join(f"{v[0]},{v[1:4]},{v[4:]}" for v in vals)          # 1,234,567, ...
    assert score(t, grouped) == 1.0
    assert score(t, "\n".join(vals), rule="exact") == 1.0
    assert score(t, "\n".join(vals[:3]), rule="exact") == 0.0


# ---- determinism ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_prompts_are_deterministic_for_a_seed(tok, kind):
    a, b = task(tok, kind, seed=7), task(tok, kind, seed=7)
    assert a.prompt == b.prompt and a.input_ids == b.input_ids and a.answers == b.answers
    assert a.needles == b.needles
    others = [task(tok, kind, seed=s) for s in (8, 9, 10)]
    assert all(o.answers != a.answers for o in others)
    assert all(o.prompt != a.prompt for o in others)
    if kind != "passkey":
        assert all(o.query != a.query for o in others)
    # One seed swept over depths and contexts asks the same thing.
    c = task(tok, kind, context=900, depth=0.2, seed=7)
    assert c.answers == a.answers and c.query == a.query and c.prompt != a.prompt


def test_default_text_is_austen_and_deterministic(tok):
    from oasiskv.data.austen import austen_text

    try:
        austen_text("prideprejudice")
    except FileNotFoundError:
        pytest.skip("janeaustenr not installed")
    a = passkey_task(tok, 1024, 0.5, seed=3, chat=False)
    b = passkey_task(tok, 1024, 0.5, seed=3, chat=False)
    assert a.prompt == b.prompt and abs(a.num_tokens - 1024) <= 10
    lo, hi = a.haystack_chars
    assert a.needles[0].text in a.prompt[lo:hi]


# ---- placement -----------------------------------------------------------------------------


DEPTHS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("depth", DEPTHS)
def test_needles_land_at_the_asked_depth(wide_tok, kind, depth):
    t = task(wide_tok, kind, context=4096, depth=depth, seed=1)
    assert t.depths[0] == depth
    for n, asked, landed, pos in zip(t.needles, t.depths, t.needle_depths, t.needle_positions,
                                     strict=True):
        assert t.prompt[n.char_start:n.char_end] == n.text
        assert n.text in wide_tok.decode(t.input_ids[n.token_start:n.token_end])
        assert abs(landed - asked) <= 0.02, (asked, landed)       # in the filler
        assert abs(pos - asked) <= 0.02, (asked, pos)             # token position / context
    asked = t.needles[0]
    if kind == "passkey":
        assert asked.value == t.answers[0] and f"The pass key is {asked.value}." in asked.text
    else:
        assert asked.key == t.query and asked.value == t.answers[0]
        assert f"special magic numbers for {t.query} is: {asked.value}." in asked.text


def test_needles_land_in_the_small_tokenizer(tok):
    for depth in DEPTHS:
        t = task(tok, "single", context=2048, depth=depth)
        n = t.needles[0]
        assert t.prompt[n.char_start:n.char_end] == n.text
        assert abs(t.needle_depths[0] - depth) <= 0.02


def test_multi_needle_depths(wide_tok):
    depths = [0.05, 0.3, 0.6, 0.95]
    for kind in ("multikey", "multivalue"):
        t = needle_task(wide_tok, 4096, depths, seed=2, kind=kind, text=TEXT)
        assert t.depths == tuple(depths)
        for asked, landed in zip(depths, t.needle_depths, strict=True):
            assert abs(landed - asked) <= 0.02
        keys = [n.key for n in t.needles]
        if kind == "multikey":
            assert len(set(keys)) == 4 and t.query == keys[0]
            assert t.answers == [t.needles[0].value]
            assert t.query in t.prompt[t.haystack_chars[1]:]      # asked after the haystack
        else:
            assert set(keys) == {t.query}
            assert t.answers == [n.value for n in t.needles]
    # One depth: the others are drawn from the seed, reproducibly.
    a = needle_task(wide_tok, 2048, 0.4, seed=5, kind="multikey", num_keys=6, text=TEXT)
    b = needle_task(wide_tok, 2048, 0.4, seed=5, kind="multikey", num_keys=6, text=TEXT)
    assert len(a.needles) == 6 and a.depths == b.depths and a.depths[0] == 0.4
    assert all(0 <= d <= 1 for d in a.depths)
    assert abs(a.needle_depths[0] - 0.4) <= 0.02


def test_needles_go_in_at_sentence_boundaries(wide_tok):
    t = task(wide_tok, "single", context=4096, depth=0.5)
    n = t.needles[0]
    before = t.prompt[:n.char_start].rstrip()
    assert before[-1] in ".!?\"", before[-40:]
    assert t.prompt[n.char_end] in " \n"


# ---- length --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("context", [800, 1000, 2048, 4096])
def test_context_length_within_one_percent(tok, kind, context):
    t = task(tok, kind, context=context, depth=0.3, chat=False)
    assert abs(t.num_tokens - context) <= 0.01 * context, t.num_tokens
    assert t.input_ids == tok.encode(t.prompt, add_special_tokens=True)
    assert t.prompt.endswith(t.answer_prefix) and t.context_tokens == context
    lo, hi = t.haystack_tokens
    assert 0 < lo < hi < t.num_tokens


def test_short_text_wraps_around(tok):
    short = synthetic_text(seed=3, paragraphs=5)
    t = passkey_task(tok, 3000, 0.5, seed=0, text=short)
    assert abs(t.num_tokens - 3000) <= 30
    assert abs(t.needle_depths[0] - 0.5) <= 0.02


def test_filler_is_unwrapped_prose(tok):
    t = task(tok, "passkey", context=2048)
    lo, hi = t.haystack_chars
    for para in t.prompt[lo:hi].split("\n\n"):
        assert "\n" not in para and "  " not in para


# ---- chat ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_chat_template_wraps_the_prompt(chat_tok, tok, kind):
    t = task(chat_tok, kind, context=1500, depth=0.4)
    assert t.chat
    assert t.prompt.startswith("<s>user\n") and t.prompt.endswith(f"<s>assistant\n"
                                                                  f"{t.answer_prefix}")
    assert abs(t.num_tokens - 1500) <= 15
    assert t.input_ids == chat_tok.encode(t.prompt, add_special_tokens=False)
    assert t.input_ids[0] == chat_tok.bos_token_id and t.input_ids[1] != chat_tok.bos_token_id
    n = t.needles[0]
    assert t.prompt[n.char_start:n.char_end] == n.text
    assert n.text in chat_tok.decode(t.input_ids[n.token_start:n.token_end])
    assert abs(t.needle_depths[0] - 0.4) <= 0.02
    plain = task(chat_tok, kind, context=1500, depth=0.4, chat=False)
    assert not plain.chat and not plain.prompt.startswith("<s>user")
    no_template = task(tok, kind, context=1500, depth=0.4, chat=True)
    assert not no_template.chat and no_template.prompt == plain.prompt


# ---- errors --------------------------------------------------------------------------------


def test_bad_arguments(tok):
    with pytest.raises(ValueError, match="depth"):
        task(tok, "passkey", depth=1.5)
    with pytest.raises(ValueError, match="kind"):
        needle_task(tok, 600, 0.5, 0, kind="multihop", text=TEXT)
    with pytest.raises(ValueError, match="no room"):
        task(tok, "single", context=20)
    with pytest.raises(ValueError, match="depths"):
        needle_task(tok, 600, [0.1, 0.2], 0, kind="multikey", text=TEXT)
    with pytest.raises(ValueError, match="one depth"):
        make_task("passkey", tok, 600, [0.1, 0.2], 0, text=TEXT)
    with pytest.raises(ValueError, match="empty"):
        passkey_task(tok, 600, 0.5, 0, text="")
